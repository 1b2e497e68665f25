"""Command line: ``python -m gns_callback demo [...]`` and ``python -m gns_callback report <report.json or run dir>``."""

import os
import sys

COMMANDS = {"demo": "gns_callback.demo", "report": "gns_callback.report_cli"}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        commands = ",".join(COMMANDS)
        print(f"usage: python -m gns_callback {{{commands}}} [options]   (python -m gns_callback <command> --help)")
        raise SystemExit(0 if argv and argv[0] in ("-h", "--help") else 2)
    import importlib

    try:
        importlib.import_module(COMMANDS[argv[0]]).main(argv[1:])
    except BrokenPipeError:  # the reader went away (``... | head``): the rest of the output is not wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes
        raise SystemExit(1)


if __name__ == "__main__":
    main()
