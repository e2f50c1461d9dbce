"""Split-KV's key shares (``split_kv_decode(key_shares=True)``: ``attend._key_share`` and ``_attend_chunks``'
END_BACK): the shares themselves, and the kernel against the float64 reference and the tile-share kernel, in the
interpreter (fp16/fp32) and compiled on CUDA (bf16)."""
from __future__ import annotations

import os
import sys

import pytest
import torch

from attnopt.runtime.reference import sdpa_float64

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from attnopt.runtime.kernels.attend import _key_share  # noqa: E402
from attnopt.runtime.kernels.split_kv import split_kv_decode  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# the same inputs (NaN past a valid length) and checks; _tma_in_eager: autouse, the TMA kernels in eager CUDA launches
from test_tile_ops import _close, _inputs, _run, _tma_in_eager, _variant_matches  # noqa: E402,F401


@triton.jit
def _shares_kernel(out_ptr, n, num_splits, BLOCK_N: tl.constexpr):
    split = tl.program_id(0)
    lo, hi = _key_share(split, n, num_splits, BLOCK_N)
    tl.store(out_ptr + 2 * split, lo)
    tl.store(out_ptr + 2 * split + 1, hi)


def _shares(dev, n, splits, block_n):
    out = torch.full((splits, 2), -1, dtype=torch.int32, device=dev)
    _shares_kernel[(splits,)](out, n, splits, BLOCK_N=block_n)
    return [tuple(r) for r in out.tolist()]


@pytest.mark.parametrize("n,splits,block_n", [(524288, 66, 128), (524288, 66, 256), (200, 5, 32), (30464, 7, 128),
                                              (4096, 64, 64), (1000, 66, 128), (700, 3, 256), (17, 1, 64)])
def test_key_shares_cover_the_keys_once_and_hold_whole_tiles(kernel_device, n, splits, block_n):
    """The shares are [0, n) in order, no gap and no overlap; where every share holds a whole tile they are 16-key
    units that differ by at most 16 keys (plus the last split's n % 16); else the tile shares (whole tiles, the last
    one cut at n)."""
    shares = _shares(kernel_device, n, splits, block_n)
    assert shares[0][0] == 0 and shares[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(shares, shares[1:]))
    sizes = [hi - lo for lo, hi in shares]
    if n // 16 // splits * 16 >= block_n:
        assert all(lo % 16 == 0 for lo, _ in shares) and min(sizes) >= block_n
        assert max(sizes[:-1]) - min(sizes) <= 16 and sizes[-1] - min(sizes) <= 16 + n % 16
    else:
        assert all(lo % block_n == 0 for lo, _ in shares)
        assert max(sizes) - min(sizes) <= block_n


def test_key_shares_balance_the_long_corner(kernel_device):
    """B1 14/2 D80 512k at 66 splits of 128-key tiles: the tile shares give 4 splits 63 tiles and 62 splits 62; the
    key shares give every split 7936-7952 keys (62.0-62.1 tiles)."""
    shares = _shares(kernel_device, 524288, 66, 128)
    sizes = sorted(hi - lo for lo, hi in shares)
    assert sizes[0] >= 7936 and sizes[-1] <= 7952


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("D,G,L", [(80, 7, 1), (64, 1, 1), (96, 2, 2)])
def test_key_shares_match_reference_and_tile_shares(kernel_device, dtype, D, G, L):
    """Key shares at 1, 3 and 5 splits (shares of 16-key units that are no multiple of the tile, a last tile moved
    back over keys already attended), copy-engine tiles and pointers, head chunks and padded, the fused merge, no
    valid length (the copy engine's zero-fill past N) and valid lengths ending inside a tile with NaN past them (one
    short enough for the tile shares): the reference's result, and the tile-share kernel's within rounding."""
    dev = kernel_device
    if dev.type == "cuda" and dtype == torch.float32:
        dtype = torch.bfloat16
    B, Hkv, BN = 2, 2, 16 if dev.type == "cpu" else 64
    N = 12 * BN + 8
    Hq = Hkv * G
    for valid in (None, torch.tensor([N - 3, 2 * BN + 7], dtype=torch.int32, device=dev)):
        q, k, v, rk, rv = _inputs(dev, dtype, B, Hq, Hkv, L, N, D, valid)
        ref = sdpa_float64(q, rk, rv, valid_len=valid)
        for splits, tma, chunks, fused in ((1, True, True, False), (3, True, False, False), (5, False, True, False),
                                           (3, False, False, True), (5, True, True, True)):
            base = dict(valid_len=valid, tma=tma, head_chunks=chunks, fused_merge=fused)
            what = f"{dtype} D{D} G{G} L{L} S{splits} tma={tma} chunks={chunks} fused={fused} valid={valid}"
            _variant_matches(q, k, v, ref, splits, BN, base, {"key_shares": True}, what)


def test_key_shares_with_a_window_a_mask_causal_rows_and_alibi(kernel_device):
    """The moved-back tile hides the keys below its loop step together with a window's first key, a bool mask read
    per tile (``mask_tiles=False``), top-left causal rows over a cache shorter than a share, and ALiBi with a
    softcap."""
    dev = kernel_device
    dtype = torch.float16 if dev.type == "cpu" else torch.bfloat16
    B, Hkv, G, L, D, BN = 2, 2, 3, 2, 64, 16 if dev.type == "cpu" else 64
    N = 9 * BN + 24
    q, k, v, rk, rv = _inputs(dev, dtype, B, Hkv * G, Hkv, L, N, D)
    start = torch.tensor([BN + 5, 3 * BN + 1], dtype=torch.int32, device=dev)
    mask = torch.rand(B, 1, L, N, device=dev) > 0.3
    mask[..., 0] = True
    slopes = torch.rand(Hkv * G, device=dev)
    cases = (({"key_start": start}, {"key_start": start}),
             ({"attn_mask": mask, "mask_tiles": False}, {"attn_mask": mask}),
             ({"alibi_slopes": slopes, "softcap": 20.0}, {"alibi_slopes": slopes, "softcap": 20.0}))
    for kw, ref_kw in cases:
        ref = sdpa_float64(q, rk, rv, **ref_kw)
        for splits, tma in ((3, True), (4, False)):
            out, _ = _run(q, k, v, splits, BN, tma=tma, key_shares=True, **kw)
            _close(out, ref, dtype, f"{sorted(kw)} S{splits} tma={tma}")
    qc = q[:, :, :L]
    out, _ = _run(qc, k[:, :, :L + 1], v[:, :, :L + 1], 2, BN, is_causal=True, key_shares=True)
    _close(out, sdpa_float64(qc, rk[:, :, :L + 1], rv[:, :, :L + 1], is_causal=True), dtype, "causal")


def test_the_plan_field_round_trips_and_reaches_the_kernel(monkeypatch):
    """``SplitKVPlan.key_shares`` round-trips through JSON (older plans load with it off), is part of the runtime
    key, and runs through the op (the Triton interpreter on CPU, fp32): the reference's result."""
    import math

    from attnopt.plan import SplitKVPlan, plan_from_dict, plan_from_json
    from attnopt.runtime import ops
    from attnopt.runtime.kernels import interpreting

    plan = SplitKVPlan(num_splits=3, block_n=16, tma=True, key_shares=True, merge_dv_split=0)
    assert plan_from_json(plan.to_json()) == plan and '"key_shares": true' in plan.runtime_key()
    old = plan.to_dict()
    del old["data"]["key_shares"]
    assert plan_from_dict(old).key_shares is False
    if not interpreting():
        pytest.skip("the Triton interpreter is not on")
    monkeypatch.setenv("ATTNOPT_CPU_KERNELS", "interpret")
    ops.reset_runtime_state()
    seen = []
    original = split_kv_decode.__globals__["_SPLIT_KV_LAUNCH"]
    monkeypatch.setitem(split_kv_decode.__globals__, "_SPLIT_KV_LAUNCH",
                        lambda *a, **kw: (seen.append(kw["KEY_SHARES"]), original(*a, **kw)))
    B, Hkv, G, L, N, D = 2, 2, 3, 1, 150, 64
    q, k, v = torch.randn(B, Hkv * G, L, D), torch.randn(B, Hkv, N, D), torch.randn(B, Hkv, N, D)
    valid = torch.tensor([150, 101], dtype=torch.int32)
    out = torch.ops.attnopt.decode_attention(q, k, v, None, valid, 1.0 / math.sqrt(D), False, plan.runtime_key(),
                                             "test:site")
    torch.testing.assert_close(out.double(), sdpa_float64(q, k, v, valid_len=valid), atol=2e-5, rtol=2e-5)
    assert seen == [True]
    ops.reset_runtime_state()
