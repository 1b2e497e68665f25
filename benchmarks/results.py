"""Keep benchmarks/RESULTS.md as sections that each benchmark replaces in place."""

from __future__ import annotations

from pathlib import Path


def replace_section(path: str, heading: str, body: str) -> None:
    """Replace the section under ``heading`` (up to the next ``## ``) with ``body``, or append it."""
    file = Path(path)
    text = file.read_text() if file.exists() else "# Benchmark results\n"
    lines = text.splitlines()
    try:
        start = lines.index(heading)
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        lines[start:end] = [heading, "", body, ""]
    except ValueError:
        lines += ["", heading, "", body, ""]
    file.write_text("\n".join(lines).rstrip("\n") + "\n")


def publish_section(section: str, out: "str | Path | None", heading: str) -> None:
    """Print a benchmark's section, and replace it in ``out`` (a markdown file) when given."""
    print(section)
    if out:
        replace_section(str(out), heading, section)
