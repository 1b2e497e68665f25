"""``benchmarks/cifar10_efficientnet.py``: the quick end-to-end run, and its parts (model, LAMB, CIFAR reader).

The quick run (``--quick --synthetic``) trains a 127k-parameter EfficientNet on 512 synthetic images for a few
seconds per phase (~20 s on 2 CPU cores); the other tests take well under a second each.
"""

from __future__ import annotations

import math
import pickle
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch


@pytest.fixture(scope="module")
def bench(load_benchmark):
    return load_benchmark("cifar10_efficientnet")


@pytest.fixture(scope="module")
def quick_run(bench, tmp_path_factory):
    out = tmp_path_factory.mktemp("cifar_quick")
    results = out / "RESULTS.md"
    results.write_text("# Benchmark results\n\n## Other benchmark\n\nkeep me\n")
    threads = torch.get_num_threads()
    result = bench.main(["--quick", "--synthetic", "--out", str(results), "--work-dir", str(out / "work")])
    assert torch.get_num_threads() == threads  # --quick's one thread is restored
    return result, results


# ------------------------------------------------------------------------------------------------ end to end
def test_quick_run_has_three_phases_estimate_and_recommendation(quick_run):
    result, _ = quick_run
    phases = result["phases"]
    assert [p.name for p in phases] == ["baseline", "GNS measurement", "recommended"]
    for p in phases:
        assert p.steps > 0 and p.examples > 0 and p.train_seconds > 0
        assert p.val_acc is not None and 0.0 <= p.val_acc <= 1.0
        assert p.stopped_by in ("time budget", "target reached", "20 optimizer steps")
    base, gns, _ = phases
    assert (base.batch_size, base.micro_batch_size, base.accumulate) == (32, 32, 1)
    assert (gns.micro_batch_size, gns.accumulate) == (16, 2)  # BatchNorm: micro_batch needs accumulation
    assert gns.steps <= 20
    run = result["run_estimate"]
    assert run["method"] == "micro_batch" and run["steps"] == gns.steps
    assert "b_simple" in run and "ci_low" in run and "ci_high" in run
    rec = result["recommendation"]
    assert rec is not None and rec["batch_size"] >= 1 and rec["learning_rate"] > 0
    assert rec["lr_rule"] == "noise_sqrt"  # LAMB is in the adaptive family
    assert rec["micro_batch_size"] * rec["accumulate_grad_batches"] == rec["batch_size"]
    final = phases[2]
    assert (final.micro_batch_size, final.accumulate) == (rec["micro_batch_size"], rec["accumulate_grad_batches"])
    assert math.isclose(final.lr, rec["learning_rate"])
    probe = result["probe"]
    assert probe["max_micro_batch"] > 0 and probe["throughput"]
    assert all(p.peak_memory_bytes and p.peak_memory_bytes > 0 for p in phases)
    assert result["synthetic"] is True and "NOT CIFAR-10" in result["data_source"]
    assert Path(result["work_dir"], "result.json").is_file()


def test_quick_run_writes_the_section_and_keeps_the_others(bench, quick_run):
    _, results = quick_run
    text = results.read_text()
    assert "## Other benchmark\n\nkeep me" in text
    section = text[text.index(bench.SECTION_HEADING):]
    assert bench.SYNTHETIC_SUBSECTION in section and "not CIFAR-10" in section
    assert "Real CIFAR-10: not run." in section
    rows = [line for line in section.splitlines() if line.startswith(("| baseline", "| GNS measurement", "| recommended"))]
    assert len(rows) == 3
    assert "B_simple (run average" in section and "Recommendation: batch" in section
    assert "--quick --synthetic" in section  # the exact command
    assert "| micro-batch | samples/s (probe) |" in section


def test_rewriting_keeps_the_other_data_subsection(bench, quick_run, tmp_path):
    result, _ = quick_run
    path = tmp_path / "RESULTS.md"
    real = dict(result, synthetic=False, data_source="CIFAR-10 from /data (50000 train / 10000 test images)")
    bench.write_section(path, real, 0.7)
    bench.write_section(path, result, 0.7)
    bench.write_section(path, result, 0.7)  # idempotent
    text = path.read_text()
    assert text.count(bench.REAL_SUBSECTION) == 1 and text.count(bench.SYNTHETIC_SUBSECTION) == 1
    assert text.index(bench.REAL_SUBSECTION) < text.index(bench.SYNTHETIC_SUBSECTION)
    assert "not done yet" not in text and text.count(bench.SECTION_HEADING) == 1


def test_missing_data_is_a_clear_error(bench, tmp_path):
    with pytest.raises(SystemExit, match="--data-dir"):
        bench.main(["--quick", "--data-dir", str(tmp_path / "nowhere")])


def test_phase_two_refuses_a_single_micro_batch(bench):
    with pytest.raises(SystemExit):
        bench.parse_args(["--synthetic", "--gns-accumulate", "1"])


def test_phase_three_follows_a_trusted_recommendation_with_warmup(bench):
    """A trusted estimate of 1024 at batch 64 / LR 1e-3 (the blog's case): batch 1024, LR ×4 (square-root rule
    for LAMB), a linear warmup; phase 3's module then warms up with LinearLR over exactly those steps."""
    from gns_callback import recommend

    args = bench.parse_args(["--synthetic"])
    estimate = {"b_simple": 1024.0, "ci_low": 800.0, "ci_high": 1300.0, "steps": 1000}
    rec = recommend(estimate, current_batch_size=64, current_lr=1e-3, optimizer="Lamb", current_micro_batch_size=32,
                    current_accumulate=2, max_micro_batch=256, dataset_size=50_000, steps_per_epoch=781,
                    lr_rule="sqrt")  # the blog's rule (the default, noise_sqrt, gives ×√8.5 here)
    assert rec.status == "ok" and rec.batch_size == 1024 and rec.lr_rule == "sqrt"
    micro, accumulate, lr, warmup, start = bench.recommended_settings(rec, args)
    assert micro * accumulate == 1024 and micro <= 256
    assert math.isclose(lr, 4e-3) and warmup > 0 and math.isclose(start, 0.25)

    module, _ = bench._new_module(args, lr, 50_000, warmup_steps=warmup, warmup_start_factor=start)
    config = module.configure_optimizers()
    optimizer, scheduler = config["optimizer"], config["lr_scheduler"]["scheduler"]
    assert config["lr_scheduler"]["interval"] == "step" and type(optimizer).__name__ == "Lamb"
    assert math.isclose(optimizer.param_groups[0]["lr"], 1e-3)  # starts at the baseline LR
    for _ in range(warmup):
        optimizer.step()
        scheduler.step()
    assert math.isclose(optimizer.param_groups[0]["lr"], 4e-3)

    assert bench.recommended_settings(None, args) == (64, 1, 1e-3, 0, None)  # no estimate: the baseline again


# ------------------------------------------------------------------------------------------------ model
def test_efficientnet_b0_fallback_shape_and_parameter_count():
    from benchmarks.cifar10.model import B0_PARAMS_10_CLASSES, EfficientNet, build_model, count_parameters

    model, description = build_model(10, impl="builtin")
    assert "stem stride 1" in description
    assert count_parameters(model) == B0_PARAMS_10_CLASSES == 4_020_358
    assert count_parameters(EfficientNet(num_classes=1000)) == 5_288_548  # timm/torchvision's B0 on ImageNet
    model.eval()
    with torch.no_grad():
        features = model.head(model.blocks(model.stem(torch.zeros(2, 3, 32, 32))))
        logits = model(torch.randn(2, 3, 32, 32))
    assert features.shape == (2, 1280, 2, 2)  # stride-1 stem: overall stride 16 on 32×32
    assert logits.shape == (2, 10)
    stages = [len(stage) for stage in model.blocks]
    assert stages == [1, 2, 2, 3, 3, 4, 1]
    assert [stage[-1].project[0].out_channels for stage in model.blocks] == [16, 24, 40, 80, 112, 192, 320]
    assert [stage[0].depthwise[0].kernel_size[0] for stage in model.blocks] == [3, 3, 5, 3, 5, 5, 3]


def test_tiny_efficientnet_and_stochastic_depth():
    from benchmarks.cifar10.model import EfficientNet, count_parameters, drop_path

    tiny = EfficientNet(10, width_mult=0.25, depth_mult=0.25)
    assert count_parameters(tiny) == 126_822
    assert tiny(torch.randn(3, 3, 32, 32)).shape == (3, 10)
    x = torch.ones(1000, 4)
    assert torch.equal(drop_path(x, 0.5, training=False), x)
    kept = drop_path(x, 0.5, training=True)
    assert set(kept[:, 0].tolist()) <= {0.0, 2.0} and 0.4 < (kept[:, 0] > 0).float().mean() < 0.6


def test_timm_model_matches_the_fallback():
    pytest.importorskip("timm")
    from benchmarks.cifar10.model import build_model, count_parameters

    model, _ = build_model(10, impl="timm")
    assert count_parameters(model) == 4_020_358
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)


# ------------------------------------------------------------------------------------------------ LAMB
def test_lamb_first_step_by_hand():
    """Step 1 with bias correction: m̂ = g, v̂ = g², r = g/(|g| + ε); u = r + λx; x ← x − η·(‖x‖/‖u‖)·u."""
    from benchmarks.cifar10.lamb import Lamb

    x = torch.tensor([3.0, -4.0], requires_grad=True)  # ‖x‖ = 5
    opt = Lamb([x], lr=0.1, betas=(0.9, 0.999), eps=0.0, weight_decay=0.5)
    x.grad = torch.tensor([0.2, 0.1])
    opt.step()
    # r = (1, 1); u = (1, 1) + 0.5·(3, −4) = (2.5, −1); ‖u‖ = √7.25; trust = 5/√7.25
    trust = 5.0 / math.sqrt(7.25)
    expected = torch.tensor([3.0 - 0.1 * trust * 2.5, -4.0 - 0.1 * trust * -1.0])
    torch.testing.assert_close(x.detach(), expected)


def _reference_lamb(x, grads, lr, betas, eps, wd):
    """Algorithm 2 of You et al. 2019 written out in numpy, step by step."""
    x = x.astype(np.float64).copy()
    m = np.zeros_like(x)
    v = np.zeros_like(x)
    for t, g in enumerate(grads, start=1):
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        r = (m / (1 - betas[0] ** t)) / (np.sqrt(v / (1 - betas[1] ** t)) + eps)
        u = r + wd * x
        wn, un = np.linalg.norm(x), np.linalg.norm(u)
        trust = wn / un if wn > 0 and un > 0 else 1.0
        x = x - lr * trust * u
    return x


def test_lamb_matches_the_paper_over_several_steps_and_layers():
    from benchmarks.cifar10.lamb import Lamb

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(4, 3, generator=gen, dtype=torch.float64)
    b = torch.zeros(3, dtype=torch.float64)  # zero weights: trust ratio 1
    grads_w = [torch.randn(4, 3, generator=gen, dtype=torch.float64) for _ in range(4)]
    grads_b = [torch.randn(3, generator=gen, dtype=torch.float64) for _ in range(4)]
    pw, pb = w.clone().requires_grad_(), b.clone().requires_grad_()
    opt = Lamb([{"params": [pw], "weight_decay": 0.01}, {"params": [pb], "weight_decay": 0.0}], lr=0.05, eps=1e-6)
    for gw, gb in zip(grads_w, grads_b):
        pw.grad, pb.grad = gw.clone(), gb.clone()
        opt.step()
    ref_w = _reference_lamb(w.numpy(), [g.numpy() for g in grads_w], 0.05, (0.9, 0.999), 1e-6, 0.01)
    ref_b = _reference_lamb(b.numpy(), [g.numpy() for g in grads_b], 0.05, (0.9, 0.999), 1e-6, 0.0)
    np.testing.assert_allclose(pw.detach().numpy(), ref_w, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(pb.detach().numpy(), ref_b, rtol=1e-12, atol=1e-12)


def test_lamb_builder_splits_weight_decay():
    from benchmarks.cifar10.lamb import build_lamb
    from benchmarks.cifar10.model import EfficientNet

    model = EfficientNet(10, 0.25, 0.25)
    opt, description = build_lamb(model, 1e-3, weight_decay=0.01, impl="builtin")
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.01 and all(p.ndim >= 2 for p in decay["params"])
    assert no_decay["weight_decay"] == 0.0 and all(p.ndim == 1 for p in no_decay["params"])
    assert type(opt).__name__ == "Lamb" and "You et al." in description


def test_timm_lamb_matches_the_fallback():
    pytest.importorskip("timm")
    from benchmarks.cifar10.lamb import build_lamb

    torch.manual_seed(0)
    nets = [torch.nn.Linear(5, 3) for _ in range(2)]
    nets[1].load_state_dict(nets[0].state_dict())
    opts = [build_lamb(nets[0], 0.01, impl="timm")[0], build_lamb(nets[1], 0.01, impl="builtin")[0]]
    for _ in range(3):
        g = [torch.randn_like(p) for p in nets[0].parameters()]
        for net, opt in zip(nets, opts):
            for p, gi in zip(net.parameters(), g):
                p.grad = gi.clone()
            opt.step()
    for a, b in zip(nets[0].parameters(), nets[1].parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------------ data
def _write_real_format(folder: Path, counts: dict[str, int]) -> dict[str, tuple[np.ndarray, list[int]]]:
    """Files laid out as the CIFAR-10 python version: pickled dicts with bytes keys, data N×3072 uint8."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    written = {}
    for name, n in counts.items():
        data = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
        labels = [int(v) for v in rng.integers(0, 10, size=n)]
        entry = {b"batch_label": name.encode(), b"labels": labels, b"data": data,
                 b"filenames": [f"img_{i}.png".encode() for i in range(n)]}
        with open(folder / name, "wb") as f:
            pickle.dump(entry, f, protocol=2)
        written[name] = (data, labels)
    (folder / "batches.meta").write_bytes(pickle.dumps({b"label_names": [b"airplane"]}))
    return written


def test_cifar_reader_on_files_in_the_real_format(tmp_path):
    from benchmarks.cifar10 import data as D

    counts = {**{f"data_batch_{i}": i + 1 for i in range(1, 6)}, "test_batch": 4}
    written = _write_real_format(tmp_path / "cifar-10-batches-py", counts)
    for root in (tmp_path, tmp_path / "cifar-10-batches-py"):  # the parent folder or the folder itself
        (xt, yt), (xv, yv) = D.load_cifar10(root)
        assert xt.shape == (2 + 3 + 4 + 5 + 6, 3, 32, 32) and xt.dtype == torch.uint8
        assert xv.shape == (4, 3, 32, 32) and yv.dtype == torch.int64
    first, labels = written["data_batch_1"]
    # row layout: 1024 red values, then green, then blue, each a row-major 32×32 image
    assert xt[0, 0, 0, 1] == first[0, 1] and xt[0, 1, 0, 0] == first[0, 1024] and xt[0, 2, 31, 31] == first[0, 3071]
    assert xt[1, 0, 1, 0] == first[1, 32]
    assert yt[:2].tolist() == labels and yv.tolist() == written["test_batch"][1]
    last = written["data_batch_5"][0]
    assert torch.equal(xt[-1].reshape(-1), torch.from_numpy(last[-1]))


def test_script_loads_real_format_files_and_labels_them_real(bench, tmp_path):
    _write_real_format(tmp_path / "cifar-10-batches-py", {**{f"data_batch_{i}": 3 for i in range(1, 6)}, "test_batch": 5})
    args = bench.parse_args(["--quick", "--data-dir", str(tmp_path), "--val-size", "4"])
    data = bench.load_data(args, log=lambda message: None)
    assert data["synthetic"] is False and data["source"].startswith("CIFAR-10 from")
    assert data["train"][0].shape == (15, 3, 32, 32) and data["val"][0].shape == (4, 3, 32, 32)


def test_cifar_reader_says_what_to_do_when_files_are_missing(tmp_path):
    from benchmarks.cifar10 import data as D

    with pytest.raises(D.DataMissing, match="--data-dir") as err:
        D.load_cifar10(tmp_path)
    assert "--synthetic" in str(err.value) and "--download" in str(err.value)


def test_download_checks_md5_and_extracts(tmp_path):
    from benchmarks.cifar10 import data as D

    source = tmp_path / "src"
    _write_real_format(source / "cifar-10-batches-py", {**{f"data_batch_{i}": 2 for i in range(1, 6)}, "test_batch": 2})
    archive = tmp_path / "cifar-10-python.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(source / "cifar-10-batches-py", arcname="cifar-10-batches-py")
    url = archive.as_uri()  # urllib reads file:// URLs: the real code path without a network
    with pytest.raises(D.DataMissing, match="md5"):
        D.download_cifar10(tmp_path / "bad", url=url, md5="0" * 32)
    folder = D.download_cifar10(tmp_path / "good", url=url, md5=D.md5sum(archive))
    (xt, _), (xv, _) = D.load_cifar10(folder)
    assert len(xt) == 10 and len(xv) == 2


def test_download_failure_is_a_clear_error(tmp_path, monkeypatch):
    import urllib.error
    import urllib.request

    from benchmarks.cifar10 import data as D

    def offline(*args, **kwargs):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    with pytest.raises(D.DataMissing, match="download cifar-10-python.tar.gz elsewhere"):
        D.download_cifar10(tmp_path)
    assert not list(tmp_path.glob("*.part"))


def test_augment_is_a_padded_crop_with_optional_flip():
    from benchmarks.cifar10 import data as D

    gen = torch.Generator().manual_seed(0)
    x = torch.randint(1, 256, (16, 3, 32, 32), dtype=torch.uint8, generator=gen)
    out = D.augment(x, generator=torch.Generator().manual_seed(1))
    assert out.shape == x.shape and out.dtype == torch.uint8
    padded = torch.nn.functional.pad(x, (4, 4, 4, 4))
    flips = 0
    for i in range(len(x)):
        crops = [(padded[i, :, t:t + 32, l:l + 32], f) for t in range(9) for l in range(9) for f in (False, True)]
        matches = [f for c, f in crops if torch.equal(out[i], c.flip(-1) if f else c)]
        assert matches, f"example {i} is not a crop of the padded image"
        flips += matches[0]
    assert 0 < flips < len(x)


def test_normalize_uses_cifar_statistics():
    from benchmarks.cifar10 import data as D

    x = torch.full((1, 3, 2, 2), 255, dtype=torch.uint8)
    out = D.normalize(x)
    expected = [(1 - m) / s for m, s in zip(D.CIFAR10_MEAN, D.CIFAR10_STD)]
    torch.testing.assert_close(out[0, :, 0, 0], torch.tensor(expected))


def test_synthetic_set_is_fixed_balanced_and_cifar_shaped():
    from benchmarks.cifar10 import data as D

    (xt, yt), (xv, yv) = D.synthetic_cifar10(200, 50, seed=3)
    (xt2, _), _ = D.synthetic_cifar10(200, 50, seed=3)
    assert xt.shape == (200, 3, 32, 32) and xt.dtype == torch.uint8 and xv.shape == (50, 3, 32, 32)
    assert torch.equal(xt, xt2)
    assert torch.bincount(yt, minlength=10).tolist() == [20] * 10
    assert 100 < xt.float().mean() < 156 and xt.float().std() > 20
