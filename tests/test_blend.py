"""PairBlend: the weight goes to the less noisy |G|² estimate, from earlier steps only."""

import pytest
import torch

from gns_callback.blend import MIN_STEPS, PairBlend


def _run(noise_pairs: float, noise_two: float, steps: int = 400, seed: int = 0) -> tuple[PairBlend, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    blend, out = PairBlend(), []
    for _ in range(steps):
        m = torch.tensor(2.0, dtype=torch.float64)  # tr Σ = 1, |G|² = 1: R = 1
        y_pairs = 1.0 + noise_pairs * torch.randn((), generator=gen, dtype=torch.float64)
        y_two = 1.0 + noise_two * torch.randn((), generator=gen, dtype=torch.float64)
        out.append(blend.blend(m, y_pairs, y_two, torch.tensor(True)))
    return blend, torch.stack(out)


@pytest.mark.parametrize("noise_pairs, noise_two, expected", [(0.1, 0.4, 16 / 17), (0.4, 0.1, 1 / 17)])
def test_the_weight_is_inverse_variance(noise_pairs, noise_two, expected):
    """Independent errors: λ = V_two/(V_pairs + V_two), within the sampling error of 400 steps' variances."""
    blend, _ = _run(noise_pairs, noise_two)
    assert blend.weight().item() == pytest.approx(expected, abs=0.05)


def test_an_even_blend_before_enough_steps_and_nothing_learnt_when_unused():
    blend, out = _run(0.1, 0.4, steps=MIN_STEPS - 1)
    assert blend.weight().item() == 0.5
    unused = PairBlend()
    y = unused.blend(torch.tensor(2.0), torch.tensor(1.5), torch.tensor(0.5), torch.tensor(False))
    assert y.item() == 1.5 and unused.sums.abs().sum().item() == 0.0


def test_the_blend_stays_unbiased():
    """Mean over many steps of the blended |G|² is the truth (tolerance from its standard error)."""
    _, out = _run(0.3, 0.3, steps=3000, seed=1)
    se = out.std() / len(out) ** 0.5
    assert abs(out.mean().item() - 1.0) < 4 * se.item()


def test_state_round_trip():
    blend, _ = _run(0.1, 0.4, steps=50)
    fresh = PairBlend()
    fresh.load_state_dict(blend.state_dict())
    assert torch.equal(fresh.sums, blend.sums)


def test_host_scalars_blend_as_the_tensors_do_to_the_bit():
    """The CPU fast path (NumPy float64 scalars) keeps the same moments and blends, bit for bit, used or not."""
    import numpy as np

    gen = torch.Generator().manual_seed(3)
    device, host = PairBlend(), PairBlend()
    for step in range(60):
        m, y_pairs, y_two = (1.0 + torch.randn((), generator=gen, dtype=torch.float64) for _ in range(3))
        use = step % 7 != 3
        a = device.blend(m, y_pairs, y_two, torch.tensor(use))
        b = host.blend(np.float64(m), np.float64(y_pairs), np.float64(y_two), use)
        assert float(b) == a.item()
    assert torch.equal(device.sums, host.sums) and device.sums[0].item() > MIN_STEPS
