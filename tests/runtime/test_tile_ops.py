"""Split-KV's speed-only tile variants (``runtime/kernels/tile_ops.py``): the swap-AB products and the L2 prefetch of
the tiles ahead, against the float64 reference and against the plain kernel, in the interpreter (fp16/fp32) and
compiled on CUDA (bf16/fp16; there the prefetch instructions run too)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from attnopt.runtime.reference import sdpa_float64

triton = pytest.importorskip("triton")

from attnopt.runtime.kernels.split_kv import split_kv_decode, split_kv_workspace  # noqa: E402
from attnopt.runtime.kernels.common import prefetch_applies  # noqa: E402


@pytest.fixture(autouse=True)
def _tma_in_eager(monkeypatch):
    """Eager CUDA launches take pointer tiles by default (``tma_now``); these tests run the TMA kernels too."""
    monkeypatch.setenv("ATTNOPT_TMA_EAGER", "1")


def _inputs(dev, dtype, B, Hq, Hkv, L, N, D, valid=None):
    q = torch.randn(B, Hq, L, D, dtype=dtype, device=dev)
    k = torch.randn(B, Hkv, N, D, dtype=dtype, device=dev)
    v = torch.randn(B, Hkv, N, D, dtype=dtype, device=dev)
    ref_k, ref_v = k.clone(), v.clone()
    if valid is not None:  # garbage past the valid length: a kernel that reads it as a key is caught
        for b, n in enumerate(valid.tolist()):
            k[b, :, n:] = float("nan")
            v[b, :, n:] = float("nan")
    return q, k, v, ref_k, ref_v


def _run(q, k, v, splits, block_n, **kw):
    out = torch.full(q.shape[:3] + (v.shape[-1],), float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full(q.shape[:3], float("nan"), dtype=torch.float32, device=q.device)
    ws = split_kv_workspace(splits, q, k, v) if splits > 1 else None
    split_kv_decode(q, k, v, out, lse, workspace=ws, num_splits=splits, block_n=block_n, **kw)
    return out, lse


def _close(out, ref, dtype, what):
    assert not torch.isnan(out).any(), what
    tol = 2e-5 if dtype == torch.float32 else 3e-3
    err = (out.double() - ref).abs()
    assert bool((err <= tol + tol * ref.abs()).all()), f"{what}: max error {err.max().item():.2e}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("D,G,L", [(64, 1, 1), (80, 1, 2), (96, 7, 1), (64, 5, 4)])
def test_swap_ab_matches_reference_and_plain(kernel_device, dtype, D, G, L):
    """Swap-AB (K @ Q^T, V^T @ P^T, the accumulators transposed) at G=1, 5 and 7, q_len 1, 2 and 4 (16 and 32 packed
    rows): one split and a merge launch, copy-engine tiles and pointers, head chunks and padded, a valid length
    ending inside a tile with NaN past it, and ALiBi with a softcap: the reference's result, and the plain kernel's
    within rounding."""
    dev = kernel_device
    if dev.type == "cuda" and dtype == torch.float32:
        dtype = torch.bfloat16  # the compiled fp32 path is tf32 either way; bf16 is what the GPU runs
    B, Hkv, BN = 2, 2, 16 if dev.type == "cpu" else 64
    N = 3 * BN + 5
    Hq = Hkv * G
    valid = torch.tensor([N - 3, BN + 7], dtype=torch.int32, device=dev)
    q, k, v, rk, rv = _inputs(dev, dtype, B, Hq, Hkv, L, N, D, valid)
    slopes = torch.rand(Hq, device=dev)
    for kw in ({}, {"alibi_slopes": slopes, "softcap": 20.0}):
        ref = sdpa_float64(q, rk, rv, valid_len=valid, **kw)
        for splits, tma, chunks in ((1, True, True), (3, True, False), (3, False, True)):
            base = dict(valid_len=valid, tma=tma, head_chunks=chunks, **kw)
            plain, plain_lse = _run(q, k, v, splits, BN, **base)
            out, lse = _run(q, k, v, splits, BN, swap_ab=True, **base)
            what = f"{dtype} D{D} G{G} L{L} S{splits} tma={tma} chunks={chunks} {sorted(kw)}"
            _close(out, ref, dtype, what)
            tol = 1e-5 if dtype == torch.float32 else 2e-3
            assert (out.double() - plain.double()).abs().max().item() <= tol, what
            assert torch.allclose(lse, plain_lse, atol=1e-4, rtol=0), what


def test_swap_ab_with_a_mask_and_causal_rows(kernel_device):
    """Swap-AB where a mask is read in every tile (contiguous shares: ``mask_tiles=False``) and with top-left causal
    rows (q_len 3, G=2: 6 packed rows), fp16; with the mask-tile path (which swap-AB does not take) the same result."""
    dev = kernel_device
    dtype = torch.float16
    B, Hkv, G, L, D, BN = 2, 1, 2, 3, 64, 16 if dev.type == "cpu" else 64
    N = 4 * BN - 3
    q, k, v, _, _ = _inputs(dev, dtype, B, Hkv * G, Hkv, L, N, D)
    mask = torch.rand(B, Hkv * G, L, N, device=dev) > 0.5
    mask[..., 0] = True
    ref = sdpa_float64(q, k, v, attn_mask=mask)
    for tiles in (False, None):
        out, _ = _run(q, k, v, 3, BN, attn_mask=mask, mask_tiles=tiles, swap_ab=True, tma=True)
        _close(out, ref, dtype, f"mask mask_tiles={tiles}")
    ref = sdpa_float64(q, k, v, is_causal=True)
    out, _ = _run(q, k, v, 2, BN, is_causal=True, swap_ab=True)
    _close(out, ref, dtype, "causal")


def test_prefetch_applies_only_to_compiled_contiguous_rows(kernel_device):
    """The L2 prefetch is PTX: never in the interpreter; on CUDA only where each head's rows are one contiguous run of
    16-byte-aligned rows (``prefetch_applies``)."""
    dev = kernel_device
    k = torch.randn(1, 2, 64, 80, dtype=torch.float16, device=dev)
    v = torch.randn(1, 2, 64, 80, dtype=torch.float16, device=dev)
    if dev.type == "cpu":
        assert not prefetch_applies(k, v)
        return
    assert prefetch_applies(k, v)
    assert not prefetch_applies(k.transpose(1, 2).contiguous().transpose(1, 2), v), "rows of a head not one run"
    assert not prefetch_applies(k, torch.randn(1, 2, 64, 84, dtype=torch.float16, device=dev)[..., :80])
    assert not prefetch_applies(torch.randn(1, 2, 64, 36, dtype=torch.float16, device=dev), v[..., :36].contiguous())


@pytest.mark.parametrize("bulk", [True, False])
def test_l2_prefetch_leaves_the_result_alone(kernel_device, bulk):
    """With the prefetch of 1-4 tiles ahead (one bulk request per tensor, or line by line; compiled CUDA: the
    instructions run; interpreter: ignored), alone and with swap-AB, for a dynamic cache (keys to the tensors' end,
    the last tile crossing it) and a valid length (NaN past it): the same output as without, and the reference's."""
    dev = kernel_device
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float16
    B, Hkv, G, D, BN = 2, 2, 1, 80, 16 if dev.type == "cpu" else 64
    N = 9 * BN + 11
    valid = torch.tensor([N - 40, 2 * BN + 3], dtype=torch.int32, device=dev)
    q, k, v, rk, rv = _inputs(dev, dtype, B, Hkv * G, Hkv, 1, N, D, valid)
    for lens in (None, valid):
        kk, vv = (rk, rv) if lens is None else (k, v)
        ref = sdpa_float64(q, rk, rv, valid_len=lens)
        for swap in (False, True):
            plain, _ = _run(q, kk, vv, 2, BN, valid_len=lens, tma=True, head_chunks=True, swap_ab=swap)
            _close(plain, ref, dtype, f"valid={lens is not None} swap={swap} no prefetch")
            for ahead in (1, 4):
                out, _ = _run(q, kk, vv, 2, BN, valid_len=lens, tma=True, head_chunks=True, swap_ab=swap,
                              l2_prefetch=ahead, prefetch_bulk=bulk)
                what = f"valid={lens is not None} swap={swap} ahead={ahead} bulk={bulk}"
                _close(out, ref, dtype, what)
                assert torch.equal(out, plain), what


def test_plans_carry_the_variants_to_the_kernel(monkeypatch):
    """``SplitKVPlan.swap_ab`` / ``l2_prefetch`` round-trip through JSON, reject a negative prefetch, and run through
    the op (the Triton interpreter on CPU, fp32): the reference's result."""
    import math

    from attnopt.plan import SplitKVPlan, plan_from_json
    from attnopt.runtime import ops
    from attnopt.runtime.kernels import interpreting

    plan = SplitKVPlan(num_splits=3, block_n=16, tma=True, swap_ab=True, l2_prefetch=2, merge_dv_split=0)
    assert plan_from_json(plan.to_json()) == plan and '"swap_ab": true' in plan.runtime_key()
    with pytest.raises(ValueError, match="l2_prefetch must be >= 0"):
        SplitKVPlan(l2_prefetch=-1)
    if not interpreting():
        pytest.skip("the Triton interpreter is not on")
    monkeypatch.setenv("ATTNOPT_CPU_KERNELS", "interpret")
    ops.reset_runtime_state()
    B, Hkv, G, L, N, D = 2, 2, 1, 1, 45, 80
    q, k, v = torch.randn(B, Hkv * G, L, D), torch.randn(B, Hkv, N, D), torch.randn(B, Hkv, N, D)
    valid = torch.tensor([45, 20], dtype=torch.int32)
    for p in (plan, SplitKVPlan(num_splits=1, block_n=32, swap_ab=True, head_chunks=True)):
        out = torch.ops.attnopt.decode_attention(q, k, v, None, valid, 1.0 / math.sqrt(D), False, p.runtime_key(),
                                                 "test:site")
        torch.testing.assert_close(out.double(), sdpa_float64(q, k, v, valid_len=valid), atol=2e-5, rtol=2e-5)
    ops.reset_runtime_state()


#: Swap-AB kernels compiled for sm_90 without a GPU (Triton 3.7.1 and its ptxas, bf16, 16 query rows, 4 warps unless
#: said; ``metadata.shared``, the bytes a launch asks for) at 027ab0a: (head dim, head chunks, block_n, stages,
#: bytes). The 298,032 of D=80 in chunks at 256-key tiles and 3 stages is over the H100's 232,448.
SWAP_COMPILED = ((64, False, 64, 3, 53272), (64, False, 128, 3, 104472), (64, False, 256, 3, 206872),
                 (64, False, 256, 2, 141392), (80, True, 64, 3, 76848), (80, True, 128, 3, 150576),
                 (80, True, 256, 3, 298032), (96, True, 128, 3, 150576), (96, False, 128, 3, 204824))


@pytest.mark.parametrize("d,chunks,block_n,stages,compiled", SWAP_COMPILED)
def test_swap_estimate_covers_the_compiled_kernels(d, chunks, block_n, stages, compiled):
    from attnopt.runtime.strategies.split_kv import SMEM_BUDGET, smem_bytes
    from attnopt.site import AttentionSite

    site = AttentionSite.canonical(batch=1, q_heads=1, kv_heads=1, head_dim=d, q_len=1, kv_len=4096,
                                   dtype="bfloat16", gqa_source="mha")
    estimate = smem_bytes(site, block_n, stages, chunks, swap_ab=True)
    # in head chunks the compiled kernels staged no weights tile: the estimate counts one anyway (up to 9 KB over)
    assert compiled <= estimate <= compiled + (10 if chunks else 2) * 1024
    assert estimate > smem_bytes(site, block_n, stages, chunks), "one K/V buffer more than mma.sync's layout"
    if compiled > 232448:
        assert estimate > SMEM_BUDGET, "a config over the hardware's limit must not be a candidate"


def test_swap_twins_are_candidates_only_where_the_products_swap(monkeypatch):
    """With ``SWAP_AB_TWINS`` on (the default), swap-AB twins come among the candidates of 16-bit sites under 64 packed
    query rows (G=1 D64, G=7 D80), each within the shared-memory budget with its own layout and estimated just behind
    its twin, and the tuner times the best one early; none for fp32 or 64 rows; with it off, none."""
    from attnopt.hardware import builtin_profile
    from attnopt.runtime.strategies import PlanContext, get_strategy
    from attnopt.runtime.strategies import split_kv as skv
    from attnopt.site import AttentionSite
    from attnopt.tuning_candidates import to_time

    h100, ctx = builtin_profile("h100-sxm"), PlanContext(device_type="cuda", triton_available=True)
    strategy = get_strategy("split_kv")

    def site(g, d, q_len=1, dtype="bfloat16"):
        return AttentionSite.canonical(batch=1, q_heads=2 * g, kv_heads=2, head_dim=d, q_len=q_len, kv_len=65536,
                                       dtype=dtype)

    monkeypatch.setattr(skv, "SWAP_AB_TWINS", False)
    assert not any(p.swap_ab for p in strategy.candidates(site(1, 64), h100, ctx)), "off"
    monkeypatch.setattr(skv, "SWAP_AB_TWINS", True)
    for s in (site(1, 64), site(7, 80)):
        plans = list(strategy.candidates(s, h100, ctx))
        swapped = [p for p in plans if p.swap_ab]
        assert swapped and len(swapped) < len(plans)
        for p in swapped:
            assert skv.smem_bytes(s, p.block_n, p.num_stages, p.head_chunks, swap_ab=True) <= skv.SMEM_BUDGET
            twin = next((q for q in plans if not q.swap_ab and (q.block_n, q.num_warps, q.num_stages, q.head_chunks,
                                                                q.num_splits) == (p.block_n, p.num_warps,
                                                                                  p.num_stages, p.head_chunks,
                                                                                  p.num_splits)), None)
            if twin is not None:
                assert strategy.estimate_us(p, s, h100, ctx) > strategy.estimate_us(twin, s, h100, ctx)
        ranked = sorted((p.with_estimate(strategy.estimate_us(p, s, h100, ctx)) for p in plans),
                        key=lambda p: p.est_us)
        assert any(p.swap_ab for p in to_time(ranked, 2, 0)), "the best swap-AB plan is timed"
    for s in (site(1, 64, dtype="float32"), site(8, 64, q_len=8)):
        assert not any(p.swap_ab for p in strategy.candidates(s, h100, ctx))


def test_prefetch_twins_are_candidates_when_on(monkeypatch):
    """With ``PREFETCH_TWINS`` = T (2 by default) each split-KV candidate comes with a twin prefetching T tiles ahead,
    estimated just behind it, and the tuner times the best-estimated one early, its top k being plain plans; with 0,
    none."""
    from attnopt.hardware import builtin_profile
    from attnopt.runtime.strategies import PlanContext, get_strategy
    from attnopt.runtime.strategies import split_kv as skv
    from attnopt.site import AttentionSite
    from attnopt.tuning_candidates import to_time

    h100, ctx = builtin_profile("h100-sxm"), PlanContext(device_type="cuda", triton_available=True)
    strategy = get_strategy("split_kv")
    site = AttentionSite.canonical(batch=1, q_heads=14, kv_heads=2, head_dim=80, q_len=1, kv_len=524288)
    monkeypatch.setattr(skv, "PREFETCH_TWINS", 0)
    assert not any(p.l2_prefetch for p in strategy.candidates(site, h100, ctx)), "off"
    monkeypatch.setattr(skv, "PREFETCH_TWINS", 2)
    plans = list(strategy.candidates(site, h100, ctx))
    fetching = [p for p in plans if p.l2_prefetch]
    assert fetching and all(p.l2_prefetch == 2 for p in fetching)
    assert len({p.runtime_key() for p in plans}) == len(plans), "duplicate candidates"
    for p in fetching:
        twin = next(q for q in plans if q == dataclasses.replace(p, l2_prefetch=0))
        assert strategy.estimate_us(p, site, h100, ctx) > strategy.estimate_us(twin, site, h100, ctx)
    ranked = sorted((p.with_estimate(strategy.estimate_us(p, site, h100, ctx)) for p in plans), key=lambda p: p.est_us)
    timed = to_time(ranked, 2, 0)
    assert sum(1 for p in timed if p.l2_prefetch) == 1, "the best prefetching plan is timed, and no other twin"
    assert sum(1 for p in timed if p.kind == "split_kv" and not p.l2_prefetch) >= 2, "twins displace no plain plan"


def test_swap_is_refused_where_it_was_wrong_compiled():
    """``swap_applies``: not for TMA tiles in head chunks with the crossing tile after the loop (a valid length or a
    causal cut: the combination the H100 found wrong), nor 64 query rows, mask tiles or fp32 on CUDA; else yes."""
    from attnopt.runtime.kernels.common import decode_geometry
    from attnopt.runtime.kernels.split_kv import swap_applies

    q, k = torch.randn(1, 2, 1, 80, dtype=torch.float16), torch.randn(1, 2, 64, 80, dtype=torch.float16)
    geo = decode_geometry(q, k, k)
    assert swap_applies(geo, q, False, True, (64, 32), True), "TMA chunks, keys to the tensors' end"
    assert not swap_applies(geo, q, False, True, (64, 32), False), "TMA chunks, the crossing tile after the loop"
    assert swap_applies(geo, q, False, True, (0, 0), False) and swap_applies(geo, q, False, False, (64, 32), False)
    assert not swap_applies(geo, q, True, False, (0, 0), True), "mask tiles"
    q64 = torch.randn(1, 128, 1, 80, dtype=torch.float16)
    assert not swap_applies(decode_geometry(q64, k, k), q64, False, False, (0, 0), True), "64 query rows: wgmma"
