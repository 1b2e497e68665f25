"""``python -m gns_callback report <gns_report.json | run dir>``: the report's pictures and its recommendation.

Given a directory, the newest ``gns_report.json`` below it (recursively) is used. The PNGs go to ``--out``
(default: the report's directory). Without a recompute flag the recommendation stored in the report is printed;
any recompute flag recomputes it with :func:`gns_callback.recommendation.recommend` from the report's estimate,
its probe section and the current setup, each value not given on the command line read from the report and
printed with its source. See :data:`EPILOG` (``--help``) for how the flags depend on each other.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

from gns_callback.arguments import positive_float_option, positive_int_option
from gns_callback.estimate import GNSEstimate
from gns_callback.json_values import unmeasured
from gns_callback.report import DEFAULT_REPORT_NAME

if TYPE_CHECKING:  # pragma: no cover
    from gns_callback.recommendation import Recommendation

#: Top-level keys of a report written by the callback (any one of them makes a JSON object a report).
REPORT_SECTIONS = (
    "estimate", "run_estimate", "batch_target", "history", "recommendation", "probe", "adaptations", "coverage",
    "config", "run",
)
#: ``args`` attributes of the flags that recompute the recommendation.
RECOMPUTE_FLAGS = (
    "batch_size", "lr", "optimizer", "lr_rule", "devices", "accumulate", "dataset_size", "max_batch_size",
    "power_of_two", "price_per_device_hour", "estimate",
)
_UNNAMED_OPTIMIZERS = ("", "optimizer", "unknown")  # what a recommendation records when no optimizer was known
_SAVED = "the report's recommendation"

EPILOG = """\
how the flags depend on each other:
  Without any flag of the "recompute" group, the recommendation stored in the report is printed as it is.
  Any of them recomputes it from the report's estimate (--estimate), its probe section and the current setup.
  Each current value not given on the command line is read from the report, and the printout says where each
  value came from:
    batch size, learning rate, optimizer  the recommendation section's current batch, LR and optimizer
    devices, accumulation                 run.world_size, run.accumulate_grad_batches
    epoch length                          run.steps_per_epoch or the recommendation's steps per epoch
  --batch-size is required only when the report has no recommendation section (recommend=False, or a report
      from an older version).
  --lr: the report's LR is used only together with the report's own batch size. With another --batch-size,
      pass --lr, or the recommendation gives no learning rate.
  --optimizer picks the LR rule (SGD family or Adam family); --lr-rule overrides the rule. Both act on the
      learning rate only, so they need one (from the report or --lr).
  --max-batch-size and --power-of-two act only when the batch moves (status ok or toward_interval). Otherwise
      the current batch is kept, and the command says that they had no effect.
  --dataset-size sets the epoch length: steps per epoch, warmup steps and time per epoch. Without it, the
      report's steps per epoch are used when the batch is the report's. Runs on an IterableDataset record none:
      pass --dataset-size to get warmup steps.
  --price-per-device-hour needs the probe's throughput (callback probe=True) and an epoch length.
  --out and --no-plots exclude each other.
  Without matplotlib (pip install 'gns_callback[plots]') there are no pictures: a warning says so and
      the recommendation is printed.
exit status: 0 done, 1 no readable report, 2 wrong or missing flags, or a folder for the PNGs that can't be
  written.
"""


class ReportError(ValueError):
    """The path holds no readable GNS report."""


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


def load_report(path: Path) -> dict[str, Any]:
    """The report at ``path``; :class:`ReportError` naming the file and the problem when it is not one."""
    hint = f"pass the {DEFAULT_REPORT_NAME} that GradientNoiseScaleCallback wrote, or its run directory"
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ReportError(f"{path} is not a GNS report: it is not text; {hint}") from None
    except json.JSONDecodeError as err:
        raise ReportError(
            f"{path} is not a GNS report: it is not JSON ({err.msg} at line {err.lineno}, column {err.colno}); {hint}"
        ) from None
    if not isinstance(report, dict) or not any(k in report for k in REPORT_SECTIONS):
        raise ReportError(
            f"{path} is JSON but not a GNS report: it has none of the sections {', '.join(REPORT_SECTIONS)}; {hint}"
        )
    return report


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m gns_callback report",
        description="Plot a GNS report (history, trade-off, probe) and print its batch-size recommendation.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("path", help=f"a {DEFAULT_REPORT_NAME} or a run directory to search (newest report wins)")
    p.add_argument("--out", help="directory for the PNGs (default: the report's directory); not with --no-plots")
    p.add_argument("--no-plots", action="store_true", help="only print the recommendation")
    g = p.add_argument_group("recompute the recommendation (any of these; unset values come from the report)")
    g.add_argument("--batch-size", type=positive_int_option, help="current global batch (default: the report's)")
    g.add_argument("--lr", type=positive_float_option,
                   help="current base learning rate (default: the report's, if --batch-size is the report's)")
    g.add_argument("--optimizer", help="optimizer class name, e.g. SGD, AdamW (default: the report's); picks the "
                                       "LR rule")
    g.add_argument("--lr-rule", help="LR scaling rule, overriding the optimizer's (e.g. linear, sqrt, none)")
    g.add_argument("--devices", type=positive_int_option, help="data-parallel devices (default: run.world_size)")
    g.add_argument("--accumulate", type=positive_int_option,
                   help="current accumulate_grad_batches (default: run.accumulate_grad_batches)")
    g.add_argument("--dataset-size", type=positive_int_option,
                   help="training examples per epoch: steps per epoch, warmup steps, time per epoch")
    g.add_argument("--max-batch-size", type=positive_int_option,
                   help="upper bound on the recommended global batch (acts only when the batch moves: status ok or toward_interval)")
    g.add_argument("--power-of-two", action=argparse.BooleanOptionalAction, default=None,
                   help="round the recommended batch to a power of two (acts only when the batch moves: status ok or toward_interval)")
    g.add_argument("--price-per-device-hour", type=positive_float_option,
                   help="for cost per epoch (needs the probe's throughput and an epoch length)")
    g.add_argument("--estimate", help="report section to recommend from (default: batch_target, the critical batch the callback "
                        "recommended from; in older reports run_estimate, the run average)")
    return p


@dataclass
class Setup:
    """The inputs of a recomputed recommendation, and where each came from (``sources[name]``)."""

    estimate_section: str
    batch_size: int
    lr: Optional[float]
    optimizer: Optional[str]
    devices: int
    accumulate: Optional[int]
    micro_batch_size: Optional[int]
    dataset_size: Optional[int]
    steps_per_epoch: Optional[int]
    options: dict[str, Any]
    sources: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


class FlagError(ValueError):
    """The flags given cannot work with this report."""


def _pick(sources: dict[str, str], name: str, *candidates: tuple[Any, str]) -> Any:
    """The first candidate value that is not ``None``, recording its source under ``name``."""
    for value, source in candidates:
        if value is not None:
            sources[name] = source
            return value
    return None


def read_setup(report: Mapping[str, Any], args: argparse.Namespace, saved: Optional["Recommendation"]) -> Setup:
    """The current setup for recomputing: each flag, else the report's value (see :data:`EPILOG`)."""
    run = report.get("run") or {}
    cur = saved.current if saved is not None else None
    src: dict[str, str] = {}
    batch = _pick(src, "batch size", (args.batch_size, "--batch-size"), (cur and cur.batch_size, _SAVED))
    if batch is None:
        raise FlagError(
            "the current batch size is unknown: the report has no recommendation section to read it from "
            "(written with recommend=False, or by an older version); pass --batch-size"
        )
    same_batch = cur is not None and batch == cur.batch_size
    split_given = any(v is not None for v in (args.batch_size, args.devices, args.accumulate))
    setup = Setup(
        estimate_section=_estimate_section(report, args, src),
        batch_size=batch,
        lr=_pick(src, "learning rate", (args.lr, "--lr"), (cur.learning_rate if same_batch else None, _SAVED)),
        optimizer=_pick(src, "optimizer", (args.optimizer, "--optimizer"), (_saved_optimizer(saved), _SAVED)),
        devices=_pick(src, "devices", (args.devices, "--devices"), (run.get("world_size"), "run.world_size"),
                      (cur and cur.num_devices, _SAVED), (1, "default")),
        accumulate=_pick(src, "accumulate", (args.accumulate, "--accumulate"),
                         (run.get("accumulate_grad_batches"), "run.accumulate_grad_batches"),
                         (cur and cur.accumulate_grad_batches, _SAVED)),
        micro_batch_size=None if split_given or cur is None else cur.micro_batch_size,
        dataset_size=_pick(src, "dataset size", (args.dataset_size, "--dataset-size"),
                           (run.get("dataset_size"), "run.dataset_size")),
        steps_per_epoch=None,
        options=_options(report, args, saved, src),
        sources=src,
    )
    _check_split(setup)
    if setup.dataset_size is None and same_batch:
        setup.steps_per_epoch = _pick(src, "steps per epoch", (run.get("steps_per_epoch"), "run.steps_per_epoch"),
                                      (cur.steps_per_epoch, _SAVED))
    _explain_missing(setup, cur, same_batch)
    return setup


def _check_split(setup: Setup) -> None:
    """``batch = micro × accumulate × devices`` must be possible for the current setup."""
    per_micro = setup.devices * (setup.accumulate or 1)
    if setup.batch_size % per_micro:
        given = ", ".join(f"{name} {getattr(setup, attr)} ({setup.sources[name]})"
                          for name, attr in (("batch size", "batch_size"), ("accumulate", "accumulate"),
                                             ("devices", "devices")) if name in setup.sources)
        raise FlagError(
            f"the current batch does not split: {given}; the batch must be a multiple of accumulate × devices "
            f"= {per_micro}. Pass a consistent --batch-size, --accumulate and --devices"
        )


def _estimate_section(report: Mapping[str, Any], args: argparse.Namespace, sources: dict[str, str]) -> str:
    if args.estimate is not None:
        section = report.get(args.estimate)
        if not isinstance(section, Mapping) or "b_simple" not in section:
            names = [k for k, v in report.items() if isinstance(v, Mapping) and "b_simple" in v]
            raise FlagError(f"--estimate {args.estimate}: the report has no such estimate; it has: {', '.join(names)}")
        sources["estimate"] = "--estimate"
        return args.estimate
    for name in ("batch_target", "run_estimate", "estimate"):
        if isinstance(report.get(name), Mapping):
            sources["estimate"] = "default" if name != "estimate" else "the only estimate in the report"
            return name
    raise FlagError("the report has no estimate section (run_estimate or estimate) to recommend from")


def _saved_optimizer(saved: Optional["Recommendation"]) -> Optional[str]:
    name = getattr(saved, "optimizer", None)
    return None if name is None or str(name).strip().lower() in _UNNAMED_OPTIMIZERS else str(name)


def _options(
    report: Mapping[str, Any], args: argparse.Namespace, saved: Optional["Recommendation"], sources: dict[str, str]
) -> dict[str, Any]:
    """Options of ``recommend``: the flags, else the callback's (``config.recommend_options``, when recorded),
    else an LR rule the saved recommendation says the user chose."""
    from gns_callback.recommendation import recommend

    accepted = set(inspect.signature(recommend).parameters)
    recorded = (report.get("config") or {}).get("recommend_options") or {}
    options = {k: v for k, v in recorded.items() if k in accepted and v is not None}
    for key in options:
        sources[key] = "config.recommend_options"
    if "lr_rule" not in options and saved is not None and saved.lr_rule_source == "user override":
        options["lr_rule"] = saved.lr_rule
        sources["lr_rule"] = "the report (a user override)"
    flags = {"lr_rule": args.lr_rule, "max_batch_size": args.max_batch_size, "power_of_two": args.power_of_two,
             "price_per_device_hour": args.price_per_device_hour}
    for key, value in flags.items():
        if value is not None:
            options[key] = value
            sources[key] = "--" + key.replace("_", "-")
    return options


def _explain_missing(setup: Setup, cur: Any, same_batch: bool) -> None:
    if setup.lr is None:
        if cur is not None and cur.learning_rate is not None and not same_batch:
            setup.notes.append(
                f"no learning-rate advice: the report's LR {cur.learning_rate:g} was used at batch {cur.batch_size}, "
                f"not {setup.batch_size}; pass --lr"
            )
        else:
            setup.notes.append("no learning-rate advice: the report records no learning rate; pass --lr")
    if setup.optimizer is None and "lr_rule" not in setup.options:
        setup.notes.append(
            "no optimizer recorded in the report: the LR rule falls back to recommend()'s default for an unknown "
            "optimizer; pass --optimizer (e.g. SGD, AdamW) or --lr-rule"
        )
    if setup.dataset_size is None and setup.steps_per_epoch is None:
        setup.notes.append("epoch length unknown (no steps per epoch recorded for this batch size): pass "
                           "--dataset-size for steps per epoch and warmup steps")


def recompute(report: Mapping[str, Any], setup: Setup) -> "Recommendation":
    """:func:`recommend` on the report's estimate and probe with ``setup``."""
    from gns_callback.recommendation import recommend, rules

    allowed = getattr(rules, "LR_RULES", ())
    rule = setup.options.get("lr_rule")
    if rule is not None and allowed and rule not in allowed:
        source = setup.sources.get("lr_rule", "--lr-rule")
        where = f"--lr-rule {rule}" if source == "--lr-rule" else f"LR rule {rule!r} ({source})"
        raise FlagError(f"{where}: not a rule; use one of {', '.join(allowed)}")
    try:
        return recommend(
            report[setup.estimate_section],
            current_batch_size=setup.batch_size,
            current_lr=setup.lr,
            optimizer=setup.optimizer,
            num_devices=setup.devices,
            current_micro_batch_size=setup.micro_batch_size,
            current_accumulate=setup.accumulate,
            probe=report.get("probe"),
            dataset_size=setup.dataset_size,
            steps_per_epoch=setup.steps_per_epoch,
            **setup.options,
        )
    except ValueError as err:
        raise FlagError(f"cannot recompute the recommendation with these values: {err}") from None


def flag_effects(args: argparse.Namespace, rec: "Recommendation") -> list[str]:
    """A sentence for each flag given that could not change the result, saying why."""
    from gns_callback.recommendation.result import OK, TOWARD_INTERVAL

    notes = []
    kept = rec.status not in (OK, TOWARD_INTERVAL)
    for flag, value in (("--max-batch-size", args.max_batch_size), ("--power-of-two", args.power_of_two)):
        if value is not None and kept:
            notes.append(f"{flag} had no effect: status {rec.status} keeps the current batch {rec.current.batch_size}"
                         " (only status ok or toward_interval moves it)")
    if args.max_batch_size is not None and not kept and rec.target_batch_size <= args.max_batch_size:
        notes.append(f"--max-batch-size {args.max_batch_size} is not binding: the target B_simple = "
                     f"{rec.target_batch_size:.4g} lies below it")
    if args.price_per_device_hour is not None and rec.recommended.cost_per_epoch is None:
        notes.append("--price-per-device-hour had no effect: a cost needs the time per epoch, i.e. the probe's "
                     "throughput (run the callback with probe=True) and an epoch length (--dataset-size)")
    if rec.learning_rate is None:
        for flag, value in (("--optimizer", args.optimizer), ("--lr-rule", args.lr_rule)):
            if value is not None:
                notes.append(f"{flag} had no effect: it acts on the learning rate, and there is none; pass --lr")
    if args.optimizer is not None and args.lr_rule is not None and rec.learning_rate is not None:
        notes.append("--optimizer does not pick the LR rule here: --lr-rule overrides it")
    return notes


def warmup_hint(rec: "Recommendation") -> Optional[str]:
    """Where warmup steps come from when the recommendation could only give epochs."""
    if rec.warmup_steps is not None or not rec.warmup_epochs > 0:
        return None
    return (f"Warmup steps: unknown. The epoch length is not known (a training set without a length, such as an "
            f"IterableDataset, records none), so the {rec.warmup_epochs:.3g}-epoch warmup cannot be given in "
            "steps. Rerun this command with --dataset-size N (training examples per epoch).")


def _describe(setup: Setup) -> list[str]:
    values = {
        "estimate": setup.estimate_section, "batch size": setup.batch_size, "learning rate": setup.lr,
        "optimizer": setup.optimizer, "devices": setup.devices, "accumulate": setup.accumulate,
        "dataset size": setup.dataset_size, "steps per epoch": setup.steps_per_epoch, **setup.options,
    }
    lines = [f"Recommendation recomputed from the report's {setup.estimate_section}:"]
    lines += [f"  {name}: {values[name]}  ({source})" for name, source in setup.sources.items()]
    return lines + [f"  note: {n}" for n in setup.notes]


def _fail(message: str, code: int) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(code)


def _saved_recommendation(report: Mapping[str, Any]) -> Optional["Recommendation"]:
    from gns_callback.plots.render import report_recommendation

    try:
        return report_recommendation(report)
    except ValueError as err:
        print(f"warning: {err}", file=sys.stderr)
        return None


def _choose_recommendation(report: Mapping[str, Any], args: argparse.Namespace) -> Optional["Recommendation"]:
    """The saved recommendation, or a recomputed one (printing its inputs and the flags' effects)."""
    saved = _saved_recommendation(report)
    if not any(getattr(args, name) is not None for name in RECOMPUTE_FLAGS):
        estimate = report.get("run_estimate") or report.get("estimate")
        if saved is None and isinstance(estimate, Mapping) and unmeasured(estimate):
            print("no recommendation in the report, and no measured estimate to compute one from")
        elif saved is None and estimate:
            print("no recommendation in the report: pass --batch-size (and --lr) to compute one")
        return saved
    try:
        setup = read_setup(report, args, saved)
        rec = recompute(report, setup)
    except FlagError as err:
        _fail(str(err), 2)
    print("\n".join(_describe(setup)))
    for note in flag_effects(args, rec):
        print(f"  note: {note}")
    return rec


NO_MATPLOTLIB = ("no plots: matplotlib is not installed (pip install matplotlib, or 'gns_callback[plots]'); the "
                 "recommendation follows. Pass --no-plots to skip the pictures")


def measured_lines(report: Mapping[str, Any]) -> list[str]:
    """What the report measured, before any recommendation: whether the fit was interrupted, and its estimates
    (the run average and the recent value, "not measured" with the reason). Before, the command printed neither: on
    the report of a fit stopped by Ctrl-C it said only "no recommendation in the report"."""
    lines = []
    interrupted = (report.get("run") or {}).get("interrupted")
    if interrupted:
        lines.append(f"the fit was interrupted ({interrupted}); the report holds the steps measured before that")
    for name, label in (("run_estimate", "run average"), ("estimate", "recent")):
        section = report.get(name)
        if isinstance(section, Mapping):
            try:
                lines.append(f"{label}: {GNSEstimate.from_dict(dict(section))}")
            except (KeyError, TypeError, ValueError) as err:
                lines.append(f"{label}: unreadable ({err!r}; a report from another version)")
    return lines


def _render(report: Mapping[str, Any], path: Path, args: argparse.Namespace, rec: Any) -> None:
    """The report's PNGs; without matplotlib (an optional dependency) a line on stderr says so, and the command goes
    on to print the recommendation. Before, it stopped with matplotlib's ``ModuleNotFoundError`` traceback and
    printed no recommendation."""
    from gns_callback.plots.axes import require_matplotlib

    try:
        require_matplotlib()
    except ImportError:
        print(f"warning: {NO_MATPLOTLIB}", file=sys.stderr)
        return
    from gns_callback.plots import render_report

    out = Path(args.out) if args.out else path.parent
    try:
        written = render_report(report, out, recommendation=rec)
    except OSError as err:
        _fail(f"could not write the pictures to {out} ({err.strerror or err}): pass --out with a folder you can "
              "write to, or --no-plots", 2)
    for name, png in written.items():
        print(f"wrote {name}: {png}")
    if not written:
        print("no plots: the report has no history, finite estimate or probe data to draw")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.out is not None and args.no_plots:
        parser.error("--out has no effect with --no-plots: drop one of them")
    if args.out is not None and Path(args.out).exists() and not Path(args.out).is_dir():
        parser.error(f"--out {args.out} is a file: pass a folder for the PNGs")
    try:
        path = find_report(args.path)
        report = load_report(path)
    except (FileNotFoundError, ReportError) as err:
        _fail(str(err), 1)
    print(f"report: {path}")
    for line in measured_lines(report):
        print(line)
    rec = _choose_recommendation(report, args)
    if not args.no_plots:
        _render(report, path, args, rec)
    if rec is not None:
        print()
        print(rec.summary_table())
        hint = warmup_hint(rec)
        if hint:
            print(hint)
    return 0


if __name__ == "__main__":
    main()
