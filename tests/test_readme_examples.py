"""The README's code examples run as written (each block whose first line is ``# example: ...``)."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(# example: [^\n]*\n.*?)```", README.read_text(), flags=re.S)


def test_the_readme_has_examples():
    names = [block.splitlines()[0] for block in BLOCKS]
    assert {"# example: plain loop, per_example", "# example: plain loop, micro_batch", "# example: fabric"} <= set(names)


@pytest.mark.parametrize("block", BLOCKS, ids=[b.splitlines()[0][len("# example: "):] for b in BLOCKS])
def test_example_runs_and_measures(block, capsys):
    namespace: dict = {}
    exec(compile(block, str(README), "exec"), namespace)
    meter = namespace["meter"]
    assert meter.run_estimate.steps == 200 and meter.run_estimate.measured
    assert "B_simple = " in capsys.readouterr().out
