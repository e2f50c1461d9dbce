"""Split-KV launch variants for long contexts: the merge's programs per row (``merge_dv_split``, ``dv_split="auto"``)
and ``chain`` (stage 1 launched as a programmatic dependent of the kernel before it, the merge letting the next one
launch early), against the float64 reference.

In the interpreter ``chain`` has no grid-dependency instructions to run (``pdl_supported`` is False) and must leave
the result as it is; on CUDA (``cuda`` marker) it runs captured in a CUDA graph, back-to-back calls replayed, each
output checked.
"""
from __future__ import annotations

import math

import pytest
import torch

from attnopt.runtime.reference import merge_states as ref_merge_states, sdpa_float64

triton = pytest.importorskip("triton")

from attnopt.runtime.kernels import interpreting  # noqa: E402
from attnopt.runtime.kernels.merge import FEW_ROWS, STEP_ELEMENTS, auto_dv_split, merge_states  # noqa: E402
from attnopt.runtime.kernels.split_kv import split_kv_decode, split_kv_workspace  # noqa: E402

TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def _check(out, ref, dtype, what):
    assert not torch.isnan(out).any(), f"{what}: NaN in the output"
    err = (out.double() - ref).abs()
    tol = TOL[dtype]
    assert bool((err <= tol + tol * ref.abs()).all()), f"{what}: max abs error {err.max().item():.3e}"


@pytest.mark.parametrize("rows, parts, block_dv, expected", [
    (14, 66, 128, 2),  # B1 14 heads, 66 splits, D=80 padded to 128: two programs of 64 columns take all 128 slots
    (14, 200, 128, 4),  # 256 partition slots: 32-column shares
    (14, 2000, 128, 8),  # capped at 16 columns a program
    (32, 33, 128, 2),  # few rows: at least two per row
    (FEW_ROWS, 33, 128, 1),  # enough rows: one program each, 64 x 128 in one step
    (FEW_ROWS, 100, 128, 2),
    (8, 40, 16, 1),  # a 16-wide Dv cannot be cut
])
def test_auto_dv_split(rows, parts, block_dv, expected):
    split = auto_dv_split(rows, parts, block_dv)
    assert split == expected
    if split < block_dv // 16:  # one step holds every partition
        assert triton.next_power_of_2(parts) * block_dv // split <= STEP_ELEMENTS


@pytest.mark.parametrize("P", [3, 70, 200])
def test_merge_auto_dv_split_matches_reference(P):
    if not interpreting():
        pytest.skip("CPU kernel tests need the Triton interpreter (TRITON_INTERPRET=1)")
    R, Dv = 5, 80
    o = torch.randn(P, R, Dv)
    lse = torch.randn(P, R) * 4
    lse[1, :] = float("-inf")  # an empty partition
    o[1] = 0.0
    lse[:, 2] = float("-inf")  # a row empty everywhere
    o[:, 2] = 0.0
    ro, rl = ref_merge_states(o, lse)
    out = torch.full((R, Dv), float("nan"))
    lout = torch.full((R,), float("nan"))
    merge_states(o, lse, out, lout, dv_split="auto", max_parts=P + 7)
    torch.testing.assert_close(out, ro, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lout, rl, atol=1e-5, rtol=1e-5)
    assert bool((out[2] == 0).all()) and torch.isneginf(lout[2])
    with pytest.raises(ValueError, match="power of two >= 1 or 'auto'"):
        merge_states(o, lse, dv_split="half")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("D, chunks", [(80, True), (64, False)])
def test_split_kv_variants_match_reference(dtype, D, chunks):
    """G=7 packed into 16 rows (the 512k corner's group), many splits of 16-key tiles, a tail tile: each way of
    launching the merge and ``chain`` give the reference's output and LSE."""
    if not interpreting():
        pytest.skip("CPU kernel tests need the Triton interpreter (TRITON_INTERPRET=1)")
    B, Hkv, G, N = 1, 2, 7, 16 * 9 + 5
    q = torch.randn(B, Hkv * G, 1, D, dtype=dtype)
    k = torch.randn(B, Hkv, N, D, dtype=dtype)
    v = torch.randn(B, Hkv, N, D, dtype=dtype)
    ref = sdpa_float64(q, k, v)
    splits = 7
    ws = split_kv_workspace(2 * splits, q, k, v)  # a grid that follows the length: more rows than splits
    for chain, dv in ((False, "auto"), (True, 1), (True, "auto"), (False, 4)):
        out = torch.full_like(q, float("nan"))
        split_kv_decode(q, k, v, out, workspace=ws, num_splits=splits, block_n=16, tma=True, head_chunks=chunks,
                        chain=chain, merge_dv_split=dv)
        _check(out, ref, dtype, f"chain={chain} merge_dv_split={dv}")


def test_plan_fields_round_trip_and_reach_the_candidates(monkeypatch):
    from attnopt.hardware import builtin_profile
    from attnopt.plan import SplitKVPlan, plan_from_json
    from attnopt.runtime.strategies import PlanContext, get_strategy
    from attnopt.runtime.strategies import split_kv as skv
    from attnopt.site import AttentionSite

    plan = SplitKVPlan(num_splits=66, block_n=256, chain=True, merge_dv_split=0)
    assert plan_from_json(plan.to_json()) == plan
    assert plan_from_json(SplitKVPlan().to_json()).merge_dv_split == 1  # the default: one program per row
    for bad in (-1, 3, 6):
        with pytest.raises(ValueError, match="merge_dv_split must be 0 \\(auto\\) or a power of two"):
            SplitKVPlan(merge_dv_split=bad)
    site = AttentionSite.canonical(kv_len=524288, q_heads=14, kv_heads=2, head_dim=80)
    ctx = PlanContext(device_type="cuda", triton_available=True)
    monkeypatch.setattr(skv, "LAUNCH", {"chain": True, "merge_dv_split": 0})
    plans = list(get_strategy("split_kv").candidates(site, builtin_profile("h100-sxm"), ctx))
    assert plans and all(p.chain and p.merge_dv_split == 0 for p in plans)


@pytest.mark.cuda
def test_chain_back_to_back_in_a_cuda_graph(monkeypatch):
    """Stage 1 launched as a programmatic dependent of the previous call's merge (and the merge launching the next
    stage 1 early): three calls on different inputs captured back to back, replayed twice; every output is the
    reference's. Compiled (bf16, TMA tiles, the D=80 head chunks), where the grid dependencies are real."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    monkeypatch.setenv("ATTNOPT_TMA_EAGER", "1")
    dev = torch.device("cuda")
    B, Hkv, G, N, D = 1, 2, 7, 40000, 80
    sets = [(torch.randn(B, Hkv * G, 1, D, device=dev, dtype=torch.bfloat16),
             torch.randn(B, Hkv, N, D, device=dev, dtype=torch.bfloat16),
             torch.randn(B, Hkv, N, D, device=dev, dtype=torch.bfloat16)) for _ in range(3)]
    ws = split_kv_workspace(66, *sets[0])
    outs = [torch.empty_like(s[0]) for s in sets]

    def calls():
        for (q, k, v), o in zip(sets, outs):
            split_kv_decode(q, k, v, o, workspace=ws, num_splits=66, block_n=128, num_warps=4, num_stages=3,
                            tma=True, head_chunks=True, chain=True, merge_dv_split="auto",
                            scale=1.0 / math.sqrt(D))

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        calls()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        calls()
    for _ in range(2):
        for o in outs:
            o.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        for (q, k, v), o in zip(sets, outs):
            _check(o, sdpa_float64(q, k, v), torch.bfloat16, "chained split-KV, graph replay")


def _bench_module():
    import importlib.util
    import sys
    from pathlib import Path

    folder = Path(__file__).parents[2] / "benchmarks"
    sys.path.insert(0, str(folder))  # the script imports static_mask from its own folder
    try:
        spec = importlib.util.spec_from_file_location("split_kv_long", folder / "split_kv_long.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(folder))
    return mod


def test_long_context_diagnostic_configs_and_fit():
    """benchmarks/split_kv_long.py's pure parts: the configs beside each pick fit Hopper's shared memory, include
    the pick's split count and (512k) a count dividing the KV tiles evenly, never the pick itself; the fit of two
    lengths recovers a line's fixed µs and rate."""
    from attnopt.bench.planner_grid import case_of
    from attnopt.runtime.strategies.split_kv import SMEM_BUDGET, smem_bytes
    from attnopt.site import AttentionSite

    bench = _bench_module()
    for name, base in bench.CASES.items():
        case = case_of(name)
        B, Hq, Hkv, D, N, L, _ = case
        site = AttentionSite(node="t", module_path="", pattern="sdpa", batch=B, q_heads=Hq, kv_heads=Hkv,
                             head_dim=D, q_len=L, kv_len=N, dtype="bfloat16")
        configs = bench.other_configs(case, base, 132)
        assert configs and base not in configs and len(set(configs)) == len(configs)
        for s, bn, w, st, chunks in configs:
            assert smem_bytes(site, bn, st, chunks) <= SMEM_BUDGET, (name, s, bn, st, chunks)
        assert any(s == base[0] for s, *_ in configs)
        if name.startswith("corner"):  # 2048 tiles of 256 keys: 64 splits (a count of 132 // 2 heads = 66 less 2)
            assert (64, 256, 4, 3, True) in configs
    full = {"median_us": {"a": 100.0, "b": 50.0}, "kv_bytes": 300e6}
    part = {"median_us": {"a": 55.0}, "kv_bytes": 150e6}
    f = bench.fit(full, part)
    assert set(f) == {"a"}
    assert f["a"]["fixed_us"] == pytest.approx(10.0) and f["a"]["stream_TBps"] == pytest.approx(150e6 / 45 / 1e6)


def test_long_context_diagnostic_verdict():
    """The verdict names a launch variant only where it beat the plain pick in every case, and skips unchecked
    ways (stage 1 alone) as the fastest."""
    bench = _bench_module()
    base = "S66/bn256/w4/st3/chunks"

    def case(name, plain, chain, stage1):
        med = {"sdpa-cudnn": 100.0, f"base {base}": plain, f"base {base} chain+auto": chain,
               f"base {base} stage1": stage1}
        err = {w: (None if w.endswith("stage1") else 1e-3) for w in med}
        return {"case": name, "base": base, "median_us": med, "max_abs_err": err}

    v = bench.verdict([case("a", 104.0, 102.0, 90.0), case("b", 103.0, 102.5, 95.0)])
    assert v["launch_wins_everywhere"] == ["chain+auto"]
    assert v["cases"]["a"]["best"] == f"base {base} chain+auto" and v["cases"]["a"]["merge_us"] == 14.0
    v = bench.verdict([case("a", 104.0, 102.0, 90.0), case("b", 103.0, 103.5, 95.0)])
    assert v["launch_wins_everywhere"] == []


@pytest.mark.parametrize("lse_kind", ["none", "lse", "planes"])
def test_stream_k_merge_launch_matches_reference(lse_kind):
    """Stream-K with its split tiles merged by a second launch (``merge_launch``): output and LSE as the reference's,
    over grids whose shares cut tiles in two or more places, valid lengths that leave a row empty or short, a sliding
    window, causal rows, the D=80 head chunks, and a mask; the counters stay zero (the merge launch takes none)."""
    if not interpreting():
        pytest.skip("CPU kernel tests need the Triton interpreter (TRITON_INTERPRET=1)")
    from attnopt.runtime.kernels.stream_k import stream_k_decode, stream_k_workspace
    from attnopt.runtime.reference import attention_states

    B, Hkv, G, L, N = 3, 2, 3, 2, 75
    for D, chunks, grid, kw in ((64, False, 5, {}), (80, True, 7, {"causal": True}),
                                (64, False, 11, {"window": True}), (64, False, 4, {"mask": True})):
        q = torch.randn(B, Hkv * G, L, D)
        k = torch.randn(B, Hkv, N, D)
        v = torch.randn(B, Hkv, N, D)
        valid = torch.tensor([75, 0, 33], dtype=torch.int32)
        start = torch.tensor([20, 0, 5], dtype=torch.int32) if kw.get("window") else None
        mask = (torch.rand(B, 1, L, N) > 0.3) if kw.get("mask") else None
        causal = kw.get("causal", False)
        ref = sdpa_float64(q, k, v, attn_mask=mask, valid_len=valid, is_causal=causal, key_start=start)
        _, ref_lse = attention_states(q, k, v, attn_mask=mask, valid_len=valid, is_causal=causal, key_start=start,
                                      compute_dtype=torch.float64)
        out = torch.full_like(q, float("nan"))
        lse = {"none": None, "lse": torch.full((B, Hkv * G, L), float("nan")),
               "planes": torch.full((2, B, Hkv * G, L), float("nan"))}[lse_kind]
        ws = stream_k_workspace(grid, q, k, v)
        stream_k_decode(q, k, v, out, lse, workspace=ws, attn_mask=mask, valid_len=valid, is_causal=causal,
                        key_start=start, grid=grid, block_n=16, tma=True, head_chunks=chunks, merge_launch=True)
        what = f"D={D} grid={grid} {kw} lse={lse_kind}"
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5, msg=what)
        assert int(ws[2].abs().sum()) == 0, what
        if lse_kind == "lse":
            torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=2e-5, msg=what)
        elif lse_kind == "planes":
            merged = torch.where(torch.isneginf(lse[0]), lse[0], lse[0] + lse[1])
            torch.testing.assert_close(merged.double(), ref_lse, atol=2e-5, rtol=2e-5, msg=what)


def test_stream_k_plan_merge_launch_through_the_op(monkeypatch):
    """A ``StreamKPlan(merge_launch=True)`` runs the two launches through the op (interpreter) and matches the
    reference; the candidates merge in a second launch from ``MERGE_LAUNCH_FROM`` planned keys; the plan
    round-trips."""
    if not interpreting():
        pytest.skip("CPU kernel tests need the Triton interpreter (TRITON_INTERPRET=1)")
    from attnopt.hardware import builtin_profile
    from attnopt.plan import StreamKPlan, plan_from_json
    from attnopt.runtime import ops
    from attnopt.runtime.strategies import PlanContext, get_strategy
    from attnopt.runtime.strategies import stream_k as sk
    from attnopt.site import AttentionSite

    plan = StreamKPlan(grid=5, block_n=16, merge_launch=True)
    assert plan_from_json(plan.to_json()) == plan
    monkeypatch.setenv("ATTNOPT_CPU_KERNELS", "interpret")
    ops.reset_runtime_state()
    q, k, v = torch.randn(2, 6, 1, 64), torch.randn(2, 2, 50, 64), torch.randn(2, 2, 50, 64)
    valid = torch.tensor([50, 17], dtype=torch.int32)
    out = torch.ops.attnopt.decode_attention(q, k, v, None, valid, 0.125, False, plan.runtime_key(), "test:site")
    torch.testing.assert_close(out.double(), sdpa_float64(q, k, v, valid_len=valid, scale=0.125), atol=2e-5,
                               rtol=2e-5)
    ops.reset_runtime_state()
    ctx = PlanContext(device_type="cuda", triton_available=True)
    for n, expected in ((sk.MERGE_LAUNCH_FROM, True), (98368, True), (sk.MERGE_LAUNCH_FROM - 1, False), (4096, False)):
        site = AttentionSite.canonical(kv_len=n, q_heads=32, kv_heads=8, head_dim=128)
        plans = list(get_strategy("stream_k").candidates(site, builtin_profile("h100-sxm"), ctx))
        assert plans and all(p.merge_launch is expected for p in plans), n


def test_long_context_diagnostic_extra_configs_fit():
    """The ``--extra`` configs of benchmarks/split_kv_long.py fit Hopper's shared memory at their case's shape."""
    from attnopt.bench.planner_grid import case_of
    from attnopt.runtime.strategies.split_kv import SMEM_BUDGET, smem_bytes
    from attnopt.site import AttentionSite

    bench = _bench_module()
    assert set(bench.EXTRA) == set(bench.CASES)
    for name, configs in bench.EXTRA.items():
        B, Hq, Hkv, D, N, L, _ = case_of(name)
        site = AttentionSite(node="t", module_path="", pattern="sdpa", batch=B, q_heads=Hq, kv_heads=Hkv,
                             head_dim=D, q_len=L, kv_len=N, dtype="bfloat16")
        for s, bn, w, st, chunks in configs:
            assert smem_bytes(site, bn, st, chunks) <= SMEM_BUDGET, (name, s, bn, w, st, chunks)
            assert chunks is False or D in (80, 96)
