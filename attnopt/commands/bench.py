"""``attnopt bench SUITE``: GPU benchmarks that write JSON (suites live in ``attnopt/bench/<suite>.py``)."""
from __future__ import annotations

import functools
import importlib

SUITES = ("kernels", "multigpu", "dispatch", "e2e", "planner", "headroom", "saap", "cascade", "variants")


def register(sub) -> None:
    p = sub.add_parser("bench", help="run a benchmark suite and write its JSON results")
    suites = p.add_subparsers(dest="suite", metavar="SUITE")
    suites.required = True
    for name in SUITES:
        importlib.import_module(f"attnopt.bench.{name}").register(suites)
        parser = suites.choices[name]
        parser.set_defaults(func=_out_checked(parser.get_default("func")))


def _out_checked(run):
    """``run`` after a check that the suite's ``--out`` can be written: a folder or an unwritable path is reported
    before the benchmark runs, not when its results are written minutes of GPU time later."""
    @functools.wraps(run)  # the suite's own name and module, which tests and tools read
    def checked(args) -> int:
        from attnopt.checks import writable_file

        if getattr(args, "out", None):
            writable_file("--out", args.out)
        return run(args)

    return checked
