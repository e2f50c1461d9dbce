"""``attnopt bench SUITE``: GPU benchmarks that write JSON (suites live in ``attnopt/bench/<suite>.py``)."""
from __future__ import annotations

import importlib

SUITES = ("kernels", "multigpu", "dispatch", "e2e", "planner", "headroom", "saap", "cascade", "variants")


def register(sub) -> None:
    p = sub.add_parser("bench", help="run a benchmark suite and write its JSON results")
    suites = p.add_subparsers(dest="suite", metavar="SUITE")
    suites.required = True
    for name in SUITES:
        importlib.import_module(f"attnopt.bench.{name}").register(suites)
