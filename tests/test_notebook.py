"""``notebooks/quickstart.ipynb`` runs top to bottom (nbclient, python3 kernel) and is committed without outputs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "notebooks" / "quickstart.ipynb"


def test_notebook_is_committed_without_outputs():
    nb = json.loads(NOTEBOOK.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert code
    assert all(c.get("outputs") == [] and c.get("execution_count") is None for c in code)


def test_quickstart_notebook_runs(tmp_path, monkeypatch):
    try:
        import ipykernel  # noqa: F401
        import nbclient
        import nbformat
    except ImportError as err:
        pytest.skip(f"nbclient/nbformat/ipykernel not installed: {err}")

    # The kernel is a subprocess: it finds gns_callback through PYTHONPATH, draws with Agg, and writes (if
    # anything) into tmp_path, its working directory, never into the repository.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=120, resources={"metadata": {"path": str(tmp_path)}})
    client.execute()

    outputs = "\n".join(
        out.get("text", "") for cell in nb.cells if cell.cell_type == "code" for out in cell.get("outputs", [])
        if out.get("output_type") == "stream"
    )
    assert "B_simple = " in outputs and "95% CI" in outputs
    assert "global batch size" in outputs and "Lightning settings:" in outputs  # summary_table()
    assert "probe on cpu" in outputs
    assert "'history': 'gns_history.png'" in outputs and "'tradeoff': 'gns_tradeoff.png'" in outputs
    figures = [cell for cell in nb.cells if cell.cell_type == "code" and "fig = plot_" in cell.source]
    assert len(figures) == 2
    for cell in figures:  # plot_history and plot_tradeoff each displayed a PNG
        assert any("image/png" in out.get("data", {}) for out in cell.outputs), cell.source
    assert not any(p.name.endswith(".ipynb") for p in tmp_path.iterdir())
