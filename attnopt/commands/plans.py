"""``attnopt plans [LOG]``: print the plan table of a plan log (JSON written by ``plan_log``)."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from attnopt.config import PLAN_LOG_ENV


def register(sub) -> None:
    p = sub.add_parser("plans", help="show the plan chosen for every attention site of a plan log")
    p.add_argument("log", nargs="?", help=f"plan log JSON (default: ${PLAN_LOG_ENV})")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")
    p.set_defaults(func=run)


def load_log(path: str):
    """A plan log holds one ``PlanReport`` JSON per line (one per compiled graph); merge them."""
    from attnopt.plan import PlanReport

    text = Path(path).read_text()
    reports = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            reports.append(PlanReport.from_json(line))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}:{lineno} is not a valid attnopt plan report: {exc}") from None
    if not reports:
        raise ValueError(f"{path} holds no plan report")
    return PlanReport.merge(reports)


def run(args) -> int:
    path = args.log or os.environ.get(PLAN_LOG_ENV)
    if not path:
        raise ValueError(f"give a plan log path or set ${PLAN_LOG_ENV}")
    report = load_log(path)
    if args.json:
        print(report.to_json(indent=2))
        return 0
    from rich.console import Console

    Console(width=max(120, Console().width)).print(report.rich_table())
    return 0
