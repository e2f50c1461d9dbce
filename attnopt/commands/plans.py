"""``attnopt plans [LOG]``: print the plans of a plan log (JSON written by ``plan_log``).

A one-line summary (sites, rewritten by plan kind, left alone by reason, hardware profile, op calls), then a
table with one row per group of like sites (same graph, shapes, mask and outcome) and its best alternatives.
``--all`` prints one row per site with every alternative; ``--json`` the merged report as JSON.
"""
from __future__ import annotations

import io
import json
import os
import sys
from pathlib import Path

from attnopt.config import PLAN_LOG_ENV

#: Table width when stdout is not a terminal (a pipe, a file) and ``$COLUMNS`` is not set.
DEFAULT_WIDTH = 160


def register(sub) -> None:
    p = sub.add_parser("plans", help="show the plan chosen for every attention site of a plan log")
    p.add_argument("log", nargs="?", help=f"plan log JSON (default: ${PLAN_LOG_ENV})")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")
    p.add_argument("--all", action="store_true",
                   help="one row per site with every candidate and rejection (default: like sites grouped, "
                        "the best 3 alternatives each)")
    p.add_argument("--width", type=int, default=None,
                   help=f"table width in columns (default: the terminal's; {DEFAULT_WIDTH} when not a terminal "
                        "and $COLUMNS is unset)")
    p.set_defaults(func=run)


_JSON_TYPES = {dict: "object", list: "array", str: "string", int: "number", float: "number", bool: "boolean",
               type(None): "null"}


def load_log(path: str, all_sites: bool = False):
    """A plan log holds one ``PlanReport`` JSON per line (one per compiled graph); merge them.

    Anything else (a directory, a binary file, a line that is not a JSON object or has fields of the wrong type)
    raises ``ValueError`` naming the file and the line."""
    from rich.console import Console
    from rich.errors import NotRenderableError

    from attnopt.report import PlanReport

    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{path} is a directory, not a plan log (the JSON-lines file that plan_log or "
                         f"${PLAN_LOG_ENV} names)")
    data = p.read_bytes()
    reports = []
    for lineno, raw in enumerate(data.split(b"\n"), 1):
        if not raw.strip():
            continue
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{path}:{lineno} is not text (bytes that are not UTF-8): not an attnopt plan log") from None
        try:
            obj = json.loads(line)
            if not isinstance(obj, dict):
                raise ValueError(f"a JSON {_JSON_TYPES.get(type(obj), type(obj).__name__)}, not an object")
            report = PlanReport.from_dict(obj)
            # every field the table reads, read and drawn once (a number where a name belongs fails only when rich
            # draws the cell; an id that is no string, when the graphs are merged): a wrong type fails here, with
            # its line
            PlanReport.merge([report]).render(Console(file=io.StringIO(), width=DEFAULT_WIDTH), all_sites=all_sites)
        except KeyError as exc:
            raise ValueError(f"{path}:{lineno} is not a valid attnopt plan report: missing field {exc}") from None
        except (TypeError, ValueError, AttributeError, OverflowError, NotRenderableError) as exc:  # JSONDecodeError
            # is a ValueError; OverflowError: int() of an infinite number
            reason = " ".join(str(exc).split())
            raise ValueError(f"{path}:{lineno} is not a valid attnopt plan report: {reason}") from None
        reports.append(report)
    if not reports:
        raise ValueError(f"{path} holds no plan report")
    return PlanReport.merge(reports)


def run(args) -> int:
    path = args.log or os.environ.get(PLAN_LOG_ENV)
    if not path:
        raise ValueError(f"give a plan log path or set ${PLAN_LOG_ENV}")
    report = load_log(path, all_sites=args.all)
    if args.json:
        print(report.to_json(indent=2))
        return 0
    report.render(make_console(args.width), all_sites=args.all)
    return 0


def make_console(width: int | None = None):
    """A console for stdout: ``width`` if given; else the terminal's width (rich folds the cells of a narrow
    one); else ``$COLUMNS``; else ``DEFAULT_WIDTH`` (rich's 80 columns would fold a piped table badly)."""
    from rich.console import Console

    if width is not None:
        if width < 40:
            raise ValueError(f"--width {width} is too narrow for the table (at least 40)")
        return Console(width=width)
    console = Console()
    if not console.is_terminal and not os.environ.get("COLUMNS"):
        console = Console(width=DEFAULT_WIDTH)
    return console
