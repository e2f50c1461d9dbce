"""Split-KV's speed-only tile variants (``runtime/kernels/tile_ops.py``): the swap-AB products and the L2 prefetch of
the tiles ahead, against the float64 reference and against the plain kernel, in the interpreter (fp16/fp32) and
compiled on CUDA (bf16/fp16; there the prefetch instructions run too)."""
from __future__ import annotations

import pytest
import torch

from attnopt.runtime.reference import sdpa_float64

triton = pytest.importorskip("triton")

from attnopt.runtime.kernels.split_kv import split_kv_decode, split_kv_workspace  # noqa: E402
from attnopt.runtime.kernels.tile_ops import prefetch_applies  # noqa: E402


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
@pytest.mark.parametrize("D,G,L", [(64, 1, 1), (80, 1, 2), (96, 7, 1)])
def test_swap_ab_matches_reference_and_plain(kernel_device, dtype, D, G, L):
    """Swap-AB (K @ Q^T, V^T @ P^T, the accumulators transposed) at G=1 and G=7, q_len 1 and 2: one split and a
    merge launch, copy-engine tiles and pointers, head chunks and padded, a valid length ending inside a tile with NaN
    past it, and ALiBi with a softcap: the reference's result, and the plain kernel's within rounding."""
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
            for ahead in (1, 4):
                out, _ = _run(q, kk, vv, 2, BN, valid_len=lens, tma=True, head_chunks=True, swap_ab=swap,
                              l2_prefetch=ahead, prefetch_bulk=bulk)
                what = f"valid={lens is not None} swap={swap} ahead={ahead} bulk={bulk}"
                _close(out, ref, dtype, what)
                assert torch.equal(out, plain), what
