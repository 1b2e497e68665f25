import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def load_benchmark():
    """``load_benchmark("overhead")`` imports ``benchmarks/overhead.py`` as a module (unloaded afterwards)."""
    loaded = []

    def load(name: str):
        spec = importlib.util.spec_from_file_location(f"gns_benchmarks_{name}", BENCHMARKS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
        spec.loader.exec_module(module)
        loaded.append(spec.name)
        return module

    yield load
    for name in loaded:
        sys.modules.pop(name, None)
