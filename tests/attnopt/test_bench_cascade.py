"""``attnopt bench cascade``: registered, and a smoke run of the tiny case on the CPU (Triton interpreter for the
cascade kernels): every method runs, is exact, and the shared-prefix function is planned as the cascade."""
import argparse

import pytest

from attnopt.cli import build_parser


def test_bench_cascade_is_registered():
    args = build_parser().parse_args(["bench", "cascade", "--cases", "parallel-16x32k"])
    assert args.cases == "parallel-16x32k" and args.func.__module__ == "attnopt.bench.cascade"


def test_unknown_case_is_an_error_naming_the_known_ones():
    from attnopt.bench.cascade import run

    with pytest.raises(ValueError, match="known: tiny, parallel-16x32k"):
        run(argparse.Namespace(cases="nope", dtype="fp16", commit=None))


def test_bench_cascade_tiny_smoke(monkeypatch, tmp_path):
    import torch

    from attnopt.bench.cascade import run
    from attnopt.runtime.kernels import triton_usable
    from attnopt.runtime.ops import reset_runtime_state

    if torch.cuda.is_available():
        pytest.skip("the CPU smoke run; on a GPU run `attnopt bench cascade`")
    if triton_usable("cpu"):
        monkeypatch.setenv("ATTNOPT_CPU_KERNELS", "interpret")  # the cascade's Triton kernels, interpreted
    reset_runtime_state()
    try:
        res = run(argparse.Namespace(cases="tiny", dtype="fp16", commit=None))
    finally:
        reset_runtime_state()
    rows = {r["method"]: r for r in res["rows"]}
    assert set(rows) == {"attnopt:shared-prefix", "attnopt:per-row-cache", "attnopt:shared-prefix-plain", "sdpa"}
    assert all("us" in r and r["rel_err"] < 2e-3 for r in rows.values()), rows
    assert rows["attnopt:shared-prefix"]["plan"].startswith("cascade(")
    assert rows["attnopt:shared-prefix-plain"]["plan"].startswith("split_kv(")
    assert rows["attnopt:shared-prefix"]["read_bytes"] < rows["attnopt:per-row-cache"]["read_bytes"]
