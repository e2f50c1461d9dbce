"""The ``attnopt`` command line. Each subcommand lives in ``attnopt/commands/<name>.py`` and exposes
``register(subparsers)``; the command's own imports happen only when it runs."""
from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = ("plans", "explain", "calibrate", "bench", "tune", "export_onnx")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attnopt", description="Find decode-time attention and run it with the fastest exact plan.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMANDS:
        importlib.import_module(f"attnopt.commands.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as exc:
        print(f"attnopt {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
