"""The callback on a CUDA device: the exact noise scale inside the interval in fp32, fp16 with Lightning's real
CUDA GradScaler, and bf16; and the probe inside ``Trainer.fit`` measuring the allocator's peak. Parameters are
held fixed (SGD, lr=0) so every step samples the distribution whose exact value is computed by brute force over
all 1797 digits. Skipped without CUDA (the suite never needs a GPU); benchmarks/RESULTS.md records where they ran.
"""

import pytest
import torch
import torch.nn.functional as F

from gns_callback import GradientNoiseScaleCallback
from tests.helpers import assert_matches_exact, fit_with_gns, mlp
from tests.trust.models import seeded_hand_written, seeded_min_gpt, seeded_vit

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (runs on a GPU machine only)")


@pytest.fixture(scope="module")
def mlp_exact(digits, exact_gns):
    return exact_gns(mlp(), F.cross_entropy, *digits)[0]


@pytest.mark.parametrize("method", ["micro_batch", "per_example"])
@pytest.mark.parametrize("precision", ["32-true", "16-mixed", "bf16-mixed"])
def test_exact_value_inside_the_interval_on_cuda(digits, mlp_exact, method, precision):
    callback = GradientNoiseScaleCallback(method=method, verbose=False)
    cb, trainer, _ = fit_with_gns(mlp(), *digits, callback=callback, accelerator="gpu", precision=precision)
    if precision == "16-mixed":
        assert trainer.precision_plugin.scaler.get_scale() > 1.0  # the real CUDA GradScaler scaled the loss
    assert cb.run_estimate.method == method and cb.run_estimate.steps == 300
    assert_matches_exact(cb.run_estimate, mlp_exact)


@pytest.mark.parametrize("precision", ["32-true", "16-mixed", "bf16-mixed"])
def test_a_vit_s_bare_parameters_are_read_on_cuda(digits, exact_gns, precision):
    """The class token and position table read per example at their broadcasts (pre-hooks on CUDA autograd nodes),
    under the real CUDA GradScaler too, whose overflow steps leave the first check to the next pass."""
    x, y = digits
    images = x.reshape(-1, 1, 8, 8)
    callback = GradientNoiseScaleCallback(method="per_example", verbose=False)
    cb, _, _ = fit_with_gns(seeded_vit(), images, y, accumulate=1, batch_size=32, steps=150, callback=callback,
                            accelerator="gpu", precision=precision)
    assert cb.meter.coverage["fraction"] == 1.0 and cb.run_estimate.method == "per_example"
    assert_matches_exact(cb.run_estimate, exact_gns(seeded_vit(), F.cross_entropy, images, y)[0], max_ci_ratio=3.0)


@pytest.mark.parametrize("precision", ["32-true", "16-mixed", "bf16-mixed"])
@pytest.mark.parametrize("case", ["hand_written", "min_gpt"])
def test_weights_written_out_as_products_and_a_sliced_table_are_read_on_cuda(digits, exact_gns, case, precision):
    """Weights applied as matrix products (``x @ W + b``, a hand-written attention head: cuBLAS's mm/addmm nodes,
    autocast's casts) and minGPT's sliced position table, read per example on CUDA in each precision."""
    x, y = digits
    make, inputs = {"hand_written": (seeded_hand_written, x), "min_gpt": (seeded_min_gpt, (x * 16).round().long())}[case]
    callback = GradientNoiseScaleCallback(method="per_example", verbose=False)
    cb, _, _ = fit_with_gns(make(), inputs, y, accumulate=1, batch_size=32, steps=150, callback=callback,
                            accelerator="gpu", precision=precision)
    assert cb.meter.coverage["fraction"] == 1.0 and cb.run_estimate.method == "per_example"
    assert_matches_exact(cb.run_estimate, exact_gns(make(), F.cross_entropy, inputs, y)[0], max_ci_ratio=4.0)


def test_probe_inside_fit_measures_the_allocator_peak(digits):
    callback = GradientNoiseScaleCallback(method="micro_batch", verbose=False, probe=True,
                                          memory_budget_bytes=512 * 2**20)
    cb, _, _ = fit_with_gns(mlp(), *digits, callback=callback, steps=20, accelerator="gpu")
    assert cb.probe is not None and cb.probe.measure == "cuda" and cb.probe.max_micro_batch > 8


def test_a_fit_with_the_probe_is_bit_identical_to_one_without(digits):
    """Training for real (lr 0.1): the probe's trials, restores and timing leave the weights bit for bit as in the
    same run without the probe (a control pair without it first shows the GPU run itself is deterministic)."""

    def weights(callback):
        _, _, module = fit_with_gns(mlp(), *digits, steps=12, accelerator="gpu", module_kwargs={"lr": 0.1},
                                    callback=callback)
        return [p.detach().cpu().clone() for p in module.parameters()]

    control = [weights(GradientNoiseScaleCallback(method="micro_batch", verbose=False)) for _ in range(2)]
    if not all(torch.equal(a, b) for a, b in zip(*control)):
        pytest.skip("this GPU run is not deterministic by itself")
    probed = weights(GradientNoiseScaleCallback(method="micro_batch", verbose=False, probe=True,
                                                memory_budget_bytes=512 * 2**20))
    assert all(torch.equal(a, b) for a, b in zip(control[0], probed))
