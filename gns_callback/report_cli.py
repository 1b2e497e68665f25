"""``python -m gns_callback report <gns_report.json | run dir> [--out DIR]``: plots and the recommendation.

Given a directory, the newest ``gns_report.json`` below it (recursively) is used. The PNGs go to ``--out``
(default: the report's directory). With ``--batch-size`` and ``--lr`` a recommendation is computed from the
report's run-averaged estimate (and its ``"probe"`` section) instead of read from its ``"recommendation"``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional, Sequence

from gns_callback.report import DEFAULT_REPORT_NAME, read_report


def find_report(path: str | Path) -> Path:
    """``path`` itself if a file, else the most recently modified ``gns_report.json`` under it."""
    path = Path(path)
    if path.is_file():
        return path
    if not path.is_dir():
        raise FileNotFoundError(f"no such file or directory: {path}")
    found = [p for p in path.rglob(DEFAULT_REPORT_NAME) if p.is_file()]
    if not found:
        raise FileNotFoundError(f"no {DEFAULT_REPORT_NAME} under {path}")
    return max(found, key=lambda p: (p.stat().st_mtime, str(p)))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m gns_callback report",
        description="Plot a GNS report (history, trade-off, probe) and print its batch-size recommendation.",
    )
    p.add_argument("path", help=f"a {DEFAULT_REPORT_NAME} or a run directory to search (newest report wins)")
    p.add_argument("--out", help="directory for the PNGs (default: the report's directory)")
    p.add_argument("--no-plots", action="store_true", help="only print the recommendation")
    g = p.add_argument_group("recompute the recommendation (optional)")
    g.add_argument("--batch-size", type=int, help="current global batch size")
    g.add_argument("--lr", type=float, help="current (base) learning rate")
    g.add_argument("--optimizer", default=None, help="optimizer class name, e.g. SGD, AdamW")
    g.add_argument("--devices", type=int, help="devices (default: the report's run.world_size)")
    g.add_argument("--accumulate", type=int, help="current accumulate_grad_batches (default: the report's)")
    g.add_argument("--dataset-size", type=int, help="training examples per epoch")
    g.add_argument("--max-batch-size", type=int)
    g.add_argument("--power-of-two", action="store_true")
    g.add_argument("--price-per-device-hour", type=float)
    g.add_argument("--estimate", choices=("run_estimate", "estimate"), default="run_estimate",
                   help="which estimate to recommend from (default: the run average)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        path = find_report(args.path)
        report = read_report(path)
    except (FileNotFoundError, json.JSONDecodeError) as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(1)
    print(f"report: {path}")

    from gns_callback.recommendation import Recommendation, recommend

    rec = None
    if args.batch_size is not None:
        if args.lr is None:
            print("error: --batch-size needs --lr", file=sys.stderr)
            raise SystemExit(2)
        run = report.get("run") or {}
        estimate = report.get(args.estimate) or report.get("estimate")
        rec = recommend(
            estimate,
            current_batch_size=args.batch_size,
            current_lr=args.lr,
            optimizer=args.optimizer,
            num_devices=args.devices or int(run.get("world_size") or 1),
            current_accumulate=args.accumulate or run.get("accumulate_grad_batches"),
            probe=report.get("probe"),
            dataset_size=args.dataset_size,
            max_batch_size=args.max_batch_size,
            power_of_two=args.power_of_two,
            price_per_device_hour=args.price_per_device_hour,
        )
    elif report.get("recommendation"):
        try:
            rec = Recommendation.from_dict(report["recommendation"])
        except (KeyError, TypeError) as err:
            print(f"warning: unreadable recommendation section ({err!r})", file=sys.stderr)

    if not args.no_plots:
        from gns_callback.plots import render_report

        out = Path(args.out) if args.out else path.parent
        written = render_report(report, out, recommendation=rec)
        for name, png in written.items():
            print(f"wrote {name}: {png}")
        if not written:
            print("no plots: the report has no history, estimate or probe data to draw")

    if rec is not None:
        print()
        print(rec.summary_table())
    return 0


if __name__ == "__main__":
    main()
