"""The probe without Lightning: every probe module but the adapter imports with Lightning blocked, and
``probe_micro_batch`` runs on a tiny MLP; keyword settings and a ``ProbeConfig`` are the same thing."""

import json
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from gns_callback.probe import ProbeConfig, probe_micro_batch
from tests.helpers import mlp

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROBE = ROOT / "gns_callback" / "probe"
BLOCKED = ("pytorch_lightning", "lightning", "lightning_fabric", "lightning_utilities", "torchmetrics")

SCRIPT = textwrap.dedent(
    """
    import importlib, json, sys, types
    root, modules, blocked = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
    for name in blocked:
        sys.modules[name] = None  # any import of it raises ImportError
    # gns_callback/__init__.py imports the Lightning callback: load the package without running it
    package = types.ModuleType("gns_callback")
    package.__path__ = [root + "/gns_callback"]
    sys.modules["gns_callback"] = package
    for module in modules:
        importlib.import_module("gns_callback.probe." + module)
    try:
        importlib.import_module("gns_callback.probe.lightning")
        adapter = "imported"
    except ImportError:
        adapter = "blocked"

    import torch
    import torch.nn.functional as F
    from gns_callback.probe import probe_micro_batch

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    batch = (torch.randn(8, 16), torch.randint(0, 4, (8,)))
    result = probe_micro_batch(net, torch.optim.SGD(net.parameters(), lr=0.1), batch,
                               lambda b: F.cross_entropy(net(b[0]), b[1]), memory_budget_bytes=200_000,
                               throughput_sizes=[4], timed_steps=1, timing_budget_s=0.0, progress_bar=False)
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in blocked and sys.modules[m] is not None)
    print(json.dumps({"adapter": adapter, "loaded": loaded, "result": result.to_dict()}))
    """
)


def pure_modules():
    return sorted(p.stem for p in PROBE.glob("*.py") if p.stem not in ("__init__", "lightning"))


def test_every_probe_module_but_the_adapter_works_with_lightning_blocked():
    modules = pure_modules()
    assert {"config", "batches", "trial", "agreement", "search", "standalone", "split", "state"} <= set(modules)
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(ROOT), json.dumps(modules), json.dumps(BLOCKED)],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["adapter"] == "blocked"  # the block works: the adapter cannot import
    assert report["loaded"] == []
    result = report["result"]
    assert result["max_micro_batch"] > 8 and {p["size"] for p in result["throughput"]} == {4, result["max_micro_batch"]}


def tiny_probe(**kwargs):
    net = mlp()
    batch = (torch.randn(8, 64), torch.randint(0, 10, (8,)))
    return probe_micro_batch(net, None, batch, lambda b: F.cross_entropy(net(b[0]), b[1]), **kwargs)


def test_keywords_and_a_config_are_the_same_settings():
    settings = dict(memory_budget_bytes=100_000, throughput=False, progress_bar=False)
    by_keywords = tiny_probe(**settings)
    by_config = tiny_probe(config=ProbeConfig(**settings))
    by_both = tiny_probe(config=ProbeConfig(memory_budget_bytes=1, progress_bar=False),
                         memory_budget_bytes=100_000, throughput=False)  # keywords override the config
    assert by_keywords.max_micro_batch == by_config.max_micro_batch == by_both.max_micro_batch > 8


@pytest.mark.parametrize("bad, match", [
    (dict(headroom=1.5), "headroom"),
    (dict(memory_budget_bytes=-1), "memory_budget_bytes"),
    (dict(fit_sizes=(2, 0)), "fit_sizes"),
    (dict(measure="gpu"), "measure"),
    (dict(timed_steps=0), "timed_steps"),
])
def test_bad_settings_name_the_argument(bad, match):
    with pytest.raises(ValueError, match=match):
        tiny_probe(**bad)


def test_an_unknown_setting_is_refused_with_the_known_ones():
    with pytest.raises(TypeError, match="headroomm.*headroom"):
        tiny_probe(headroomm=0.5)


def test_the_settings_search_plan_timing_agreement_and_result_need_not_even_torch():
    script = textwrap.dedent(
        """
        import importlib, sys, types
        sys.modules["torch"] = None
        for name, path in (("gns_callback", "gns_callback"), ("gns_callback.probe", "gns_callback/probe")):
            package = types.ModuleType(name)  # their __init__ files import the rest
            package.__path__ = [sys.argv[1] + "/" + path]
            sys.modules[name] = package
        for module in ("config", "memory_model", "timing", "agreement", "split", "result"):
            importlib.import_module("gns_callback.probe." + module)
        """
    )
    out = subprocess.run([sys.executable, "-c", script, str(ROOT)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
