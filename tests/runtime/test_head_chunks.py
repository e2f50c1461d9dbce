"""Split-KV with the head dim cut in two power-of-two chunks (``common.head_dim_split``: D=80 and D=96 as 64 + 32,
the columns past D masked) against the float64 reference and against the padded path, in the interpreter (and
compiled on CUDA)."""
from __future__ import annotations

import pytest
import torch

from attnopt.runtime.reference import sdpa_float64

triton = pytest.importorskip("triton")

from attnopt.runtime.kernels import interpreting  # noqa: E402
from attnopt.runtime.kernels.common import head_dim_split, kv_descriptors  # noqa: E402
from attnopt.runtime.kernels.split_kv import split_kv_decode, split_kv_workspace  # noqa: E402
from attnopt.runtime.kernels.stream_k import stream_k_decode, stream_k_workspace  # noqa: E402



@pytest.fixture(autouse=True)
def _tma_in_eager(monkeypatch):
    """Eager CUDA launches take pointer tiles by default (``tma_now``); these tests run the TMA kernels too."""
    monkeypatch.setenv("ATTNOPT_TMA_EAGER", "1")


def test_where_the_head_dim_is_cut(monkeypatch):
    cuts = {d: head_dim_split(d, d) for d in (16, 48, 64, 72, 80, 96, 112, 128, 160, 192, 256)}
    assert cuts == {16: (0, 0), 48: (0, 0), 64: (0, 0), 72: (64, 32), 80: (64, 32), 96: (64, 32), 112: (0, 0),
                    128: (0, 0), 160: (128, 32), 192: (128, 64), 256: (0, 0)}, "cut only where it pads less"
    assert head_dim_split(80, 64) == (0, 0), "Q.K and P.V chunks are cut alike: D == Dv only"
    from attnopt.cost.traffic import padded_head_dim

    assert [padded_head_dim(d) for d in (16, 64, 80, 96, 112, 160, 256)] == [16, 64, 96, 96, 128, 160, 256]
    monkeypatch.setenv("ATTNOPT_HEAD_CHUNKS", "0")
    assert head_dim_split(80, 80) == (0, 0)


def test_chunk_descriptors_cover_both_chunks():
    if not interpreting():
        pytest.skip("CPU descriptors need the Triton interpreter")
    k = torch.randn(2, 3, 40, 80, dtype=torch.float16)
    v = torch.randn(2, 40, 3, 80, dtype=torch.float16).transpose(1, 2)
    descs = kv_descriptors(k, v, 16, (64, 32))
    assert [list(d.block_shape) for d in descs] == [[1, 1, 16, 64]] * 2 + [[1, 1, 16, 32]] * 2
    assert descs[2].base.data_ptr() == k.data_ptr() + 64 * 2 and descs[3].base.data_ptr() == v.data_ptr() + 64 * 2
    assert kv_descriptors(k, v, 16) is not None and len(kv_descriptors(k, v, 16)) == 2


@pytest.mark.parametrize("D,G,L", [(80, 1, 1), (96, 3, 2), (72, 4, 1)])
def test_chunked_split_kv_matches_reference_and_padded(kernel_device, D, G, L):
    """Every split-KV form (one split, a merge launch, the fused merge; TMA tiles and pointers) with a valid length
    that ends inside a tile (the TMA path's pointer tail) and NaN past it, ALiBi and a softcap, against the float64
    reference; and the chunked output against the padded one."""
    dev = kernel_device
    dtype = torch.float16
    B, Hkv, BN = 2, 2, 16 if dev.type == "cpu" else 64
    N = 3 * BN + 5
    Hq = Hkv * G
    q = torch.randn(B, Hq, L, D, dtype=dtype, device=dev)
    k = torch.randn(B, Hkv, N, D, dtype=dtype, device=dev)
    v = torch.randn(B, Hkv, N, D, dtype=dtype, device=dev)
    valid = torch.tensor([N - 3, BN + 7], dtype=torch.int32, device=dev)
    slopes = torch.rand(Hq, device=dev)
    for kw in ({}, {"alibi_slopes": slopes, "softcap": 20.0}):
        ref = sdpa_float64(q, k, v, valid_len=valid, **kw)
        k2, v2 = k.clone(), v.clone()
        for b, n in enumerate(valid.tolist()):
            k2[b, :, n:] = float("nan")
            v2[b, :, n:] = float("nan")
        for splits, fused, tma in ((1, False, False), (1, False, True), (3, False, True), (3, True, False),
                                   (3, True, True)):
            outs = []
            for chunks in (True, False):
                out = torch.full((B, Hq, L, D), float("nan"), dtype=dtype, device=dev)
                lse = torch.full((B, Hq, L), float("nan"), dtype=torch.float32, device=dev)
                ws = split_kv_workspace(splits, q, k2, v2)
                split_kv_decode(q, k2, v2, out, lse, workspace=ws, valid_len=valid, num_splits=splits, block_n=BN,
                                fused_merge=fused, tma=tma, head_chunks=chunks, **kw)
                what = f"D{D} G{G} L{L} S{splits} fused={fused} tma={tma} chunks={chunks} {sorted(kw)}"
                assert not torch.isnan(out).any(), what
                err = (out.double() - ref).abs()
                assert bool((err <= 3e-3 + 3e-3 * ref.abs()).all()), f"{what}: max error {err.max().item():.2e}"
                outs.append(out)
            assert (outs[0].double() - outs[1].double()).abs().max().item() < 4e-3


def test_chunked_two_plane_lse_and_unequal_head_dims(kernel_device):
    """The two-plane state (row max and log l apart, a distributed decode's local part) comes out of the chunked
    path equal to the padded path's; D != Dv is never cut and still matches the reference."""
    dev = kernel_device
    B, Hkv, G, L, N, D = 1, 2, 2, 1, 37, 80
    q = torch.randn(B, Hkv * G, L, D, dtype=torch.float16, device=dev)
    k = torch.randn(B, Hkv, N, D, dtype=torch.float16, device=dev)
    v = torch.randn(B, Hkv, N, D, dtype=torch.float16, device=dev)
    planes = []
    for chunks in (True, False):
        out = torch.empty(B, Hkv * G, L, D, dtype=torch.float16, device=dev)
        lse = torch.empty(2, B, Hkv * G, L, dtype=torch.float32, device=dev)
        split_kv_decode(q, k, v, out, lse, num_splits=1, block_n=16, head_chunks=chunks)
        planes.append((out, lse))
    assert torch.allclose(planes[0][1], planes[1][1], atol=1e-3, rtol=0)
    assert torch.allclose(planes[0][0].float(), planes[1][0].float(), atol=2e-3, rtol=0)
    v64 = torch.randn(B, Hkv, N, 64, dtype=torch.float16, device=dev)
    out = torch.full((B, Hkv * G, L, 64), float("nan"), dtype=torch.float16, device=dev)
    split_kv_decode(q, k, v64, out, num_splits=2, block_n=16)
    ref = sdpa_float64(q, k, v64)
    assert (out.double() - ref).abs().max().item() < 3e-3


@pytest.mark.parametrize("mask_kind", ["prefix_row", "arbitrary"])
def test_chunked_mask_tiles_match_reference(kernel_device, mask_kind):
    """The mask-tile path (a static cache through its mask) in head chunks: a bool prefix mask of one row per batch
    row with NaN in the hidden slots (the copy-engine loop over whole tiles, the pointer tail), and an arbitrary
    (B, Hq, L, N) bool mask, TMA tiles and pointers, one split and several, against the reference and the padded
    path."""
    dev = kernel_device
    B, Hkv, G, L, D, BN = 2, 2, 3, 1 if mask_kind == "prefix_row" else 2, 96, 16 if dev.type == "cpu" else 64
    N = 6 * BN
    q = torch.randn(B, Hkv * G, L, D, dtype=torch.float16, device=dev)
    k = torch.randn(B, Hkv, N, D, dtype=torch.float16, device=dev)
    v = torch.randn(B, Hkv, N, D, dtype=torch.float16, device=dev)
    if mask_kind == "prefix_row":
        valid = torch.tensor([2 * BN + 5, 4 * BN], device=dev)
        mask = (torch.arange(N, device=dev)[None, :] < valid[:, None])[:, None, None, :]
        for b, n in enumerate(valid.tolist()):
            k[b, :, n:] = float("nan")
            v[b, :, n:] = float("nan")
        ref = sdpa_float64(q, k.nan_to_num(), v.nan_to_num(), attn_mask=mask)
    else:
        mask = torch.rand(B, Hkv * G, L, N, device=dev) > 0.6
        mask[..., 0] = True
        ref = sdpa_float64(q, k, v, attn_mask=mask)
    for splits, tma in ((1, True), (3, True), (3, False)):
        outs = []
        for chunks in (True, False):
            out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=dev)
            split_kv_decode(q, k, v, out, attn_mask=mask, num_splits=splits, block_n=BN, tma=tma, head_chunks=chunks)
            what = f"{mask_kind} S{splits} tma={tma} chunks={chunks}"
            assert not torch.isnan(out).any(), what
            err = (out.double() - ref).abs()
            assert bool((err <= 3e-3 + 3e-3 * ref.abs()).all()), f"{what}: max error {err.max().item():.2e}"
            outs.append(out)
        assert (outs[0].double() - outs[1].double()).abs().max().item() < 4e-3


@pytest.mark.parametrize("D,G,L", [(80, 1, 1), (96, 3, 2)])
def test_chunked_stream_k_matches_reference_and_padded(kernel_device, D, G, L):
    """Stream-K in head chunks: tiles written whole, tiles split between programs (partials in the workspace, merged
    by the last to arrive), the two-plane LSE; NaN past each row's valid length; TMA tiles and pointers."""
    dev = kernel_device
    B, Hkv, BN = 2, 2, 16 if dev.type == "cpu" else 64
    N = 5 * BN + 3
    Hq = Hkv * G
    q = torch.randn(B, Hq, L, D, dtype=torch.float16, device=dev)
    k = torch.randn(B, Hkv, N, D, dtype=torch.float16, device=dev)
    v = torch.randn(B, Hkv, N, D, dtype=torch.float16, device=dev)
    valid = torch.tensor([N - 2, 2 * BN + 9], dtype=torch.int32, device=dev)
    ref = sdpa_float64(q, k, v, valid_len=valid)
    for b, n in enumerate(valid.tolist()):
        k[b, :, n:] = float("nan")
        v[b, :, n:] = float("nan")
    for grid, tma, planes in ((3, True, False), (7, False, False), (7, True, True)):
        outs = []
        for chunks in (True, False):
            out = torch.full((B, Hq, L, D), float("nan"), dtype=torch.float16, device=dev)
            lse = torch.full(((2,) if planes else ()) + (B, Hq, L), float("nan"), dtype=torch.float32, device=dev)
            ws = stream_k_workspace(grid, q, k, v)
            stream_k_decode(q, k, v, out, lse, workspace=ws, valid_len=valid, grid=grid, block_n=BN, tma=tma,
                            head_chunks=chunks)
            what = f"D{D} G{G} L{L} grid={grid} tma={tma} planes={planes} chunks={chunks}"
            assert int(ws[2].abs().sum()) == 0, what
            assert not torch.isnan(out).any() and not torch.isnan(lse).any(), what
            err = (out.double() - ref).abs()
            assert bool((err <= 3e-3 + 3e-3 * ref.abs()).all()), f"{what}: max error {err.max().item():.2e}"
            outs.append((out, lse))
        assert (outs[0][0].double() - outs[1][0].double()).abs().max().item() < 4e-3
        assert torch.allclose(outs[0][1], outs[1][1], atol=1e-3, rtol=0)


def test_chunked_plans_are_candidates_that_only_measurement_picks():
    """Where the kernels cut the head dim (D=80), split-KV's candidates include head-chunked twins of the configs
    with tiles >= CHUNK_MIN_BLOCK_N, sized by their own shared memory; each is estimated behind its padded twin, so
    the model's pick stays padded, and the tuner times the best chunked one early. None at D=128."""
    import dataclasses

    from attnopt.hardware import builtin_profile
    from attnopt.plan import SplitKVPlan, plan_from_json
    from attnopt.runtime.strategies.base import PlanContext, get_strategy
    from attnopt.runtime.strategies.split_kv import CHUNK_MIN_BLOCK_N, smem_bytes
    from attnopt.site import AttentionSite
    from attnopt.tuning_candidates import to_time

    hw, ctx = builtin_profile("h100-sxm"), PlanContext(device_type="cuda", triton_available=True)
    strategy = get_strategy("split_kv")
    for head_dim, twins in ((80, True), (96, True), (128, False)):
        site = AttentionSite.canonical(dtype="bfloat16", batch=8, q_heads=4, kv_heads=2, head_dim=head_dim,
                                       kv_len=2048)
        plans = sorted((dataclasses.replace(p, est_us=strategy.estimate_us(p, site, hw, ctx))
                        for p in strategy.candidates(site, hw, ctx)), key=lambda p: p.est_us)
        chunked = [p for p in plans if p.head_chunks]
        assert bool(chunked) == twins, head_dim
        assert not plans[0].head_chunks, "the untuned pick is never head-chunked"
        assert all(p.block_n >= CHUNK_MIN_BLOCK_N for p in chunked)
        configs = {(p.block_n, p.num_warps, p.num_stages) for p in plans}
        assert (128, 4, 3) in configs, "128-key tiles, 4 warps, 3 stages: a candidate (at D=80/96 measured fastest)"
        if twins:
            assert smem_bytes(site, 128, 3, True) < smem_bytes(site, 128, 3)
            assert any(p.head_chunks for p in to_time(plans, 4)), "the tuner times a chunked plan"
            padded = dataclasses.replace(chunked[0], head_chunks=False)
            assert chunked[0].est_us > strategy.estimate_us(padded, site, hw, ctx)
    plan = SplitKVPlan(num_splits=4, block_n=128, head_chunks=True)
    assert plan_from_json(plan.to_json()) == plan
    assert plan.runtime_key() != SplitKVPlan(num_splits=4, block_n=128).runtime_key()
