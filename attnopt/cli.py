"""The ``attnopt`` command line. Each subcommand lives in ``attnopt/commands/<name>.py`` and exposes
``register(subparsers)``; the command's own imports happen only when it runs."""
from __future__ import annotations

import argparse
import importlib
import os
import sys

COMMANDS = ("plans", "explain", "calibrate", "bench", "tune", "export_onnx", "saap")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attnopt", description="Find decode-time attention and run it with the fastest exact plan.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMANDS:
        importlib.import_module(f"attnopt.commands.{name}").register(sub)
    return parser


#: Exit status after the reader of stdout went away (``attnopt plans --json log | head``): 128 + SIGPIPE, what a
#: command killed by the signal reports.
EXIT_BROKEN_PIPE = 141


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        rc = int(args.func(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
        return rc
    except BrokenPipeError:
        # Point stdout at /dev/null so that Python's own flush at exit does not raise again, and stop quietly.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except (ValueError, OSError) as exc:
        print(f"attnopt {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
