"""Split-KV in one launch (``SplitKVPlan.fused_merge``): the last split to finish a tile merges the tile's partials
in the same kernel (an arrival counter per tile, reset by the program that merges). Through one prepared workspace
at lengths of several grids (a grid that follows the cache's length), each length run twice (the counters are
back at zero and the second launch gives the same bits), with rows that see no key, against the float64 reference;
on a GPU also bf16 TMA tiles and head chunks captured in CUDA graphs and replayed. In the interpreter the programs
run one after another in grid order, so the last program of each tile is the one that merges."""
from __future__ import annotations

import math

import pytest
import torch

from attnopt.plan import SplitKVPlan
from attnopt.runtime.reference import sdpa_float64
from attnopt.runtime.strategies import get_strategy

pytest.importorskip("triton")


def _rows_without_keys(B, Hq, L, N, device):
    """A bool (B, Hq, L, N) mask (True = attend) in which query head 1 at position 0 of batch row 0 sees no key, and
    every other row sees a random two thirds of them."""
    mask = torch.rand(B, Hq, L, N, device=device) > 0.33
    mask[..., 0] = True
    mask[0, 1, 0, :] = False
    return mask


@pytest.mark.parametrize("masked", [False, True], ids=["valid-len", "mask-tiles"])
def test_one_launch_through_one_workspace(kernel_device, monkeypatch, masked):
    """Lengths of 1 to ``num_splits`` + 2 tiles through one workspace: grids of 2 to 5 splits (the merge then loads
    its partials over several steps: 8 rows of 64 columns take 4 partials a step), each run twice."""
    from attnopt.runtime.kernels.common import MERGE_ELEMS, decode_geometry

    dev = kernel_device
    monkeypatch.setenv("ATTNOPT_CPU_KERNELS", "interpret")
    torch.manual_seed(3)
    B, Hkv, G, L, D, bn = 2, 2, 3, 2, 64, 16
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    plan = SplitKVPlan(num_splits=5, block_n=bn, num_warps=4, num_stages=2, tiles_per_split=1, fused_merge=True)
    strategy = get_strategy("split_kv")
    n_max = (plan.num_splits + 2) * bn
    q = torch.randn(B, Hkv * G, L, D, device=dev, dtype=dtype)
    k_all = torch.randn(B, Hkv, n_max, D, device=dev, dtype=dtype)
    v_all = torch.randn(B, Hkv, n_max, D, device=dev, dtype=dtype)
    geo = decode_geometry(q, k_all, v_all)
    assert geo.merge_p * geo.block_r * geo.block_dv <= MERGE_ELEMS and geo.merge_p < plan.num_splits
    state = strategy.prepare(plan, q, k_all[:, :, :bn], v_all[:, :, :bn])
    o_ws, lse_ws, counters = state.workspace
    o_ws.fill_(math.nan)  # a row the merge read but no split wrote would show
    lse_ws.fill_(math.nan)
    seen = set()
    for n in (1, bn + 1, 3 * bn - 1, 5 * bn, n_max):
        k, v = k_all[:, :, :n], v_all[:, :, :n]
        valid = torch.tensor([n, max(1, n - bn)], dtype=torch.int32, device=dev)
        mask = _rows_without_keys(B, Hkv * G, L, n, dev) if masked else None
        seen.add(plan.splits_at(n))
        outs = []
        for _ in range(2):
            outs.append(strategy.run(state, plan, q, k, v, mask, None if masked else valid, None, False))
            assert int(counters.abs().sum()) == 0, f"n={n}: an arrival counter was left non-zero"
        assert torch.equal(outs[0], outs[1]), f"n={n}: the second launch differs from the first"
        ref = sdpa_float64(q, k, v, attn_mask=mask, valid_len=None if masked else valid)
        assert not torch.isnan(outs[0]).any()
        torch.testing.assert_close(outs[0].double(), ref, atol=tol, rtol=tol)
        if masked:
            assert bool((outs[0][0, 1, 0] == 0).all()), "a row that sees no key must be 0"
    assert seen == {2, 3, 5}


def test_states_of_one_launch_keep_empty_rows_empty(kernel_device, monkeypatch):
    """``run_states`` of a fused plan: the merged LSE is -inf where a row sees no key and matches the reference's
    elsewhere (a later merge, a multi-GPU combine, reads it)."""
    from attnopt.runtime.reference import attention_states

    dev = kernel_device
    monkeypatch.setenv("ATTNOPT_CPU_KERNELS", "interpret")
    torch.manual_seed(4)
    B, Hkv, G, L, N, D = 1, 2, 2, 1, 70, 64
    dtype = torch.float32 if dev.type == "cpu" else torch.float16
    plan = SplitKVPlan(num_splits=4, block_n=16, fused_merge=True)
    strategy = get_strategy("split_kv")
    q = torch.randn(B, Hkv * G, L, D, device=dev, dtype=dtype)
    k = torch.randn(B, Hkv, N, D, device=dev, dtype=dtype)
    v = torch.randn(B, Hkv, N, D, device=dev, dtype=dtype)
    mask = _rows_without_keys(B, Hkv * G, L, N, dev)
    state = strategy.prepare(plan, q, k, v)
    o, lse = strategy.run_states(state, plan, q, k, v, mask, None, None, False)
    ref_o, ref_lse = attention_states(q, k, v, attn_mask=mask, compute_dtype=torch.float64)
    assert bool(torch.isneginf(lse[0, 1, 0])) and bool(torch.isneginf(ref_lse[0, 1, 0]))
    finite = ~torch.isneginf(ref_lse)
    torch.testing.assert_close(lse[finite].double(), ref_lse[finite], atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(o.double(), ref_o.double(), atol=3e-3, rtol=3e-3)
    assert int(state.workspace[2].abs().sum()) == 0


@pytest.mark.cuda
@pytest.mark.parametrize("head_dim,chunks", [(128, False), (80, True), (96, False)], ids=["d128", "d80-chunks",
                                                                                        "d96-padded"])
def test_one_launch_captured_and_replayed(head_dim, chunks):
    """bf16, TMA tiles, compiled: each length captured once in a CUDA graph with the plan's grid for it (the grid
    follows the cache's length), replayed three times (the counters must be back at zero for every replay; every
    replay gives the same bits), against the reference. Shapes of the planner grid's short dynamic losers (lhs04: B7
    4/2 D96, lhs33's D80) with one 128-key tile per split."""
    dev = torch.device("cuda")
    torch.manual_seed(5)
    B, Hkv, G = 7, 2, 2
    plan = SplitKVPlan(num_splits=52, block_n=128, num_warps=4, num_stages=2, tma=True, head_chunks=chunks,
                       tiles_per_split=1, fused_merge=True)
    strategy = get_strategy("split_kv")
    n_max = 4096
    q = torch.randn(B, Hkv * G, 1, head_dim, device=dev, dtype=torch.bfloat16)
    k_all = torch.randn(B, Hkv, n_max, head_dim, device=dev, dtype=torch.bfloat16)
    v_all = torch.randn(B, Hkv, n_max, head_dim, device=dev, dtype=torch.bfloat16)
    state = strategy.prepare(plan, q, k_all, v_all)
    scale = 1.0 / math.sqrt(head_dim)
    for n in (2048, 2880, 3264, 4096):
        k, v = k_all[:, :, :n], v_all[:, :, :n]
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            strategy.run(state, plan, q, k, v, None, None, scale, False)  # compile outside the capture
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = strategy.run(state, plan, q, k, v, None, None, scale, False)
        ref = sdpa_float64(q, k, v, scale=scale)
        first = None
        for _ in range(3):
            out.fill_(math.nan)
            graph.replay()
            torch.cuda.synchronize()
            assert int(state.workspace[2].abs().sum()) == 0, f"n={n}: a counter was left non-zero"
            torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
            if first is None:
                first = out.clone()
            assert torch.equal(out, first), f"n={n}: a replay changed the result"
