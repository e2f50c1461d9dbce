"""Bad distributed input is a clear error before any collective: the collective timeout
(``ATTNOPT_DIST_TIMEOUT_S`` or ``register_group(timeout=)``), and ranks that call the public functions with
different shapes, dtypes, calls or collectives (gloo, 2 processes on 127.0.0.1, under a deadline).

Without the cross-rank check, a query-head mismatch made one gloo rank abort (SIGABRT) inside the all-gather and
the other return garbage; here every rank raises ``DistributedDecodeError`` naming each rank's values, and the
group stays usable for a matching call afterwards.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_distributed import ok_payloads, run_ranks  # noqa: E402  (the gloo harness)


# ============================================================================================ timeout values
@pytest.mark.parametrize("raw", ["abc", "0", "-3", "nan", "inf", "1e400"])
def test_bad_timeout_environment_variable_is_named(monkeypatch, raw):
    from attnopt.runtime.distributed import default_timeout_s

    monkeypatch.setenv("ATTNOPT_DIST_TIMEOUT_S", raw)
    with pytest.raises(ValueError, match="ATTNOPT_DIST_TIMEOUT_S") as info:
        default_timeout_s()
    assert repr(raw) in str(info.value) and "> 0" in str(info.value)


def test_timeout_environment_variable_is_read_when_set(monkeypatch):
    from attnopt.runtime.distributed import DEFAULT_TIMEOUT_S, default_timeout_s

    monkeypatch.setenv("ATTNOPT_DIST_TIMEOUT_S", " 2.5 ")
    assert default_timeout_s() == 2.5
    monkeypatch.delenv("ATTNOPT_DIST_TIMEOUT_S")
    assert default_timeout_s() == DEFAULT_TIMEOUT_S == 120.0


@pytest.mark.parametrize("timeout", [0, -1.0, float("nan"), "soon", True])
def test_bad_register_group_timeout_is_an_error_before_anything_else(timeout):
    """Checked first: here torch.distributed is not even initialised, and the timeout is what is named."""
    from attnopt.runtime.distributed import register_group

    with pytest.raises(ValueError, match="timeout"):
        register_group(timeout=timeout)


@pytest.mark.parametrize("raw,expected", [("", 256), ("0", 0), (" 12 ", 12), ("-1", None), ("many", None)])
def test_step_graph_limit_environment_variable_is_a_count_or_named(monkeypatch, raw, expected):
    from attnopt.runtime.distributed.graphs import _env_count

    monkeypatch.setenv("ATTNOPT_TREE_STEP_GRAPHS", raw)
    if expected is None:
        with pytest.raises(ValueError, match=f"ATTNOPT_TREE_STEP_GRAPHS={raw!r} is not a whole number >= 0"):
            _env_count("ATTNOPT_TREE_STEP_GRAPHS", 256)
    else:
        assert _env_count("ATTNOPT_TREE_STEP_GRAPHS", 256) == expected


# ============================================================================================ cross-rank checks
def _error(fn):
    from attnopt.runtime.distributed import DistributedDecodeError

    try:
        fn()
        return None
    except DistributedDecodeError as exc:
        return str(exc)


def _mismatched_calls(rank, world):
    """Each case makes rank 1 differ from rank 0 in one way; the results say what every rank saw."""
    from attnopt.runtime import distributed as D

    out = {}
    os.environ["ATTNOPT_DIST_TIMEOUT_S"] = "abc"
    try:
        D.register_group()
        out["env"] = None
    except ValueError as exc:
        out["env"] = str(exc)
    del os.environ["ATTNOPT_DIST_TIMEOUT_S"]
    g = D.register_group(timeout=10.0)
    gen = torch.Generator().manual_seed(rank)

    def qkv(hq=4, hkv=2, d=16, n=5 + rank, dtype=torch.float32):
        return (torch.randn(1, hq, 1, d, generator=gen).to(dtype), torch.randn(1, hkv, n, d, generator=gen).to(dtype),
                torch.randn(1, hkv, n, d, generator=gen).to(dtype))

    q, k, v = qkv(hq=8 if rank else 4)
    out["tree_heads"] = _error(lambda: D.tree_decode(q, k, v, g))
    q, k, v = qkv(dtype=torch.float64 if rank else torch.float32)
    out["ring_dtype"] = _error(lambda: D.ring_decode(q, k, v, g, variant="pass_q"))
    q, k, v = qkv()
    out["tree_collective"] = _error(lambda: D.tree_decode(q, k, v, g, collective="all_reduce" if rank else "all_gather"))
    out["call"] = _error(lambda: D.ring_decode(q, k, v, g) if rank else D.tree_decode(q, k, v, g))
    mask = torch.ones(1, 1, 1, k.shape[2], dtype=torch.bool)
    out["ring_mask"] = _error(lambda: D.ring_pass_kv(q, k, v, g, attn_mask=mask if rank else None))
    o, lse = torch.randn(1, 4, 1, 16 + 8 * rank), torch.randn(1, 4, 1)
    out["combine_dv"] = _error(lambda: D.combine_tree(o, lse, g))
    # after all that the group still works: a matching call is exact, and the same call again checks nothing new
    k_full, v_full = torch.randn(1, 2, 11, 16, generator=torch.Generator().manual_seed(7)), \
        torch.randn(1, 2, 11, 16, generator=torch.Generator().manual_seed(8))
    q = torch.randn(1, 4, 1, 16, generator=torch.Generator().manual_seed(9))
    a, b = D.balanced_bounds(11, world)[rank]
    checked = len(g._checked)
    got = D.tree_decode(q, k_full[:, :, a:b], v_full[:, :, a:b], g)
    again = D.tree_decode(q, k_full[:, :, a:b], v_full[:, :, a:b], g)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k_full.repeat_interleave(2, 1), v_full.repeat_interleave(2, 1))
    out["after"] = (float((got - ref).abs().max()), float((again - ref).abs().max()), len(g._checked) - checked)
    return out


_RESULTS: list = []


def mismatch_results():
    if not _RESULTS:
        _RESULTS.append(ok_payloads(run_ranks(_mismatched_calls, 2, deadline=60)))
    return _RESULTS[0]


@pytest.mark.timeout(90)
def test_bad_timeout_variable_is_named_on_every_rank():
    for r, res in mismatch_results().items():
        assert res["env"] and "ATTNOPT_DIST_TIMEOUT_S='abc'" in res["env"], (r, res["env"])


@pytest.mark.timeout(90)
@pytest.mark.parametrize("case,rank0,rank1", [
    ("tree_heads", "rank 0: tree_decode(B=1, Hq=4", "rank 1: tree_decode(B=1, Hq=8"),
    ("ring_dtype", "dtype=float32", "dtype=float64"),
    ("tree_collective", "collective=0", "collective=1"),
    ("call", "rank 0: tree_decode(", "rank 1: ring_pass_kv("),
    ("ring_mask", "mask_heads=0", "mask_heads=1"),
    ("combine_dv", "rank 0: combine_tree(B=1, Hq=4, L=1, Dv=16", "rank 1: combine_tree(B=1, Hq=4, L=1, Dv=24"),
])
def test_ranks_that_disagree_get_the_same_clear_error(case, rank0, rank1):
    res = mismatch_results()
    messages = [res[r][case] for r in range(2)]
    assert messages[0] is not None and messages[0] == messages[1], messages
    assert "ranks disagree" in messages[0] and rank0 in messages[0] and rank1 in messages[0], messages[0]


@pytest.mark.timeout(90)
def test_group_works_after_the_errors_and_checks_a_shape_once():
    for r, res in mismatch_results().items():
        err, err_again, new_checks = res["after"]
        assert err < 1e-5 and err_again < 1e-5, (r, err, err_again)
        assert new_checks == 1, (r, new_checks)  # one signature for two calls of the same shape
