"""Triton decode kernels (split-KV, stream-K, merge_states) against the float64 reference.

On the CPU they run in the Triton interpreter (``TRITON_INTERPRET=1``, set by ``tests/conftest.py``) with
fp16/fp32 inputs; the same tests run compiled on CUDA (``cuda`` marker), bf16 included. Shapes are small
and odd on purpose: N = 1, 7, block - 1, block + 1, a few hundred; D in {64, 80, 96, 128, 256}; G in
{1, 3, 4, 5, 8}; q_len in {1, 2, 4}; masks; strided K/V; valid lengths that leave partitions empty.
"""
from __future__ import annotations

import math

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from attnopt.runtime.reference import attention_states, merge_states as ref_merge_states, sdpa_float64

triton = pytest.importorskip("triton")

from attnopt.runtime.kernels import interpreting  # noqa: E402
from attnopt.runtime.kernels.merge import merge_states  # noqa: E402
from attnopt.runtime.kernels.split_kv import split_kv_decode, split_kv_workspace  # noqa: E402
from attnopt.runtime.kernels.stream_k import stream_k_decode, stream_k_workspace  # noqa: E402

DEVICES = [pytest.param("cpu", id="interp"), pytest.param("cuda", id="cuda", marks=pytest.mark.cuda)]
#: KV tile size used on the CPU: small, so that "block - 1 / block + 1" and many-tile shares stay cheap.
BN = 16
TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


@pytest.fixture(autouse=True)
def _tma_in_eager(monkeypatch):
    """Eager CUDA launches take pointer tiles by default (``tma_now``); these tests run the TMA kernels too."""
    monkeypatch.setenv("ATTNOPT_TMA_EAGER", "1")


def _dev(device: str) -> torch.device:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if device == "cpu" and not interpreting():
        pytest.skip("CPU kernel tests need the Triton interpreter (TRITON_INTERPRET=1)")
    return torch.device(device)


def _inputs(B, Hkv, G, L, N, D, dtype, device, *, layout="contiguous"):
    Hq = Hkv * G
    q = torch.randn(B, Hq, L, D, dtype=dtype, device=device)
    if layout == "contiguous":
        k = torch.randn(B, Hkv, N, D, dtype=dtype, device=device)
        v = torch.randn(B, Hkv, N, D, dtype=dtype, device=device)
    elif layout == "cache_slice":  # a view of a longer preallocated cache
        k = torch.randn(B, Hkv, N + 5, D, dtype=dtype, device=device)[:, :, 2:N + 2]
        v = torch.randn(B, Hkv, N + 5, D, dtype=dtype, device=device)[:, :, 3:N + 3]
    elif layout == "bnhd":  # (B, N, Hkv, D) storage seen through a transpose
        k = torch.randn(B, N, Hkv, D, dtype=dtype, device=device).transpose(1, 2)
        v = torch.randn(B, N, Hkv, D, dtype=dtype, device=device).transpose(1, 2)
    else:
        raise ValueError(layout)
    return q, k, v


def _mask(kind, B, Hq, L, N, device):
    if kind is None:
        return None
    if kind == "bool":
        m = torch.rand(B, Hq, L, N, device=device) > 0.3
        m[..., 0] = True
        return m
    if kind == "bool_bcast":  # (B, 1, 1, N): broadcast over heads and queries (0 strides)
        m = torch.rand(B, 1, 1, N, device=device) > 0.4
        m[..., -1] = True
        return m
    if kind == "additive":
        m = torch.rand(B, Hq, L, N, device=device) * -3.0
        m[torch.rand(B, Hq, L, N, device=device) > 0.8] = float("-inf")
        return m
    if kind == "additive_2d":  # (L, N), HF-style finfo.min for masked positions
        m = torch.zeros(L, N, device=device)
        m[torch.rand(L, N, device=device) > 0.7] = torch.finfo(torch.float32).min
        return m
    raise ValueError(kind)


def _check(out, ref, dtype, what):
    assert not torch.isnan(out).any(), f"{what}: NaN in the output (an element was not written, or a NaN leaked)"
    tol = TOL[dtype]
    err = (out.double() - ref).abs()
    bound = tol + tol * ref.abs()
    assert bool((err <= bound).all()), f"{what}: max abs error {err.max().item():.3e} (tol {tol})"


def _run_both(q, k, v, *, splits, grids, block_n, attn_mask=None, valid_len=None, is_causal=False, scale=None):
    """Run split-KV (each split count) and stream-K (each grid) with poisoned outputs; yield (name, o, lse)."""
    B, Hq, L, _ = q.shape
    Dv = v.shape[-1]
    for s in splits:
        # (fused merge, TMA tiles): the TMA path runs on Hopper and in the interpreter (descriptor emulation)
        for fused, tma in (((False, False), (True, False), (False, True)) if s > 1 else ((False, False), (False, True))):
            out = torch.full((B, Hq, L, Dv), float("nan"), dtype=q.dtype, device=q.device)
            lse = torch.full((B, Hq, L), float("nan"), dtype=torch.float32, device=q.device)
            ws = split_kv_workspace(s, q, k, v)
            split_kv_decode(q, k, v, out, lse, workspace=ws, attn_mask=attn_mask, valid_len=valid_len, scale=scale,
                            is_causal=is_causal, num_splits=s, block_n=block_n, fused_merge=fused, tma=tma)
            assert int(ws[2].abs().sum()) == 0, "fused split-KV left a tile counter non-zero"
            yield f"split_kv(S={s}, fused={fused}, tma={tma})", out, lse
    for g, tma in [(g, False) for g in grids] + [(grids[-1], True)]:
        out = torch.full((B, Hq, L, Dv), float("nan"), dtype=q.dtype, device=q.device)
        lse = torch.full((B, Hq, L), float("nan"), dtype=torch.float32, device=q.device)
        ws = stream_k_workspace(g, q, k, v)
        stream_k_decode(q, k, v, out, lse, workspace=ws, attn_mask=attn_mask, valid_len=valid_len, scale=scale,
                        is_causal=is_causal, grid=g, block_n=block_n, tma=tma)
        assert int(ws[2].abs().sum()) == 0, "stream-K left a tile counter non-zero"
        yield f"stream_k(grid={g}, tma={tma})", out, lse


def _expected(q, k, v, **kw):
    ref = sdpa_float64(q, k, v, **kw)
    _, lse = attention_states(q, k, v, compute_dtype=torch.float64, **kw)
    return ref, lse


def _check_lse(lse, ref_lse, what):
    both_inf = torch.isneginf(lse) & torch.isneginf(ref_lse)
    assert bool((torch.isneginf(lse) == torch.isneginf(ref_lse)).all()), f"{what}: -inf LSE rows differ"
    diff = (lse.double() - ref_lse).abs().masked_fill(both_inf, 0.0)
    assert diff.max().item() < 2e-3, f"{what}: LSE error {diff.max().item():.3e}"


# (B, Hkv, G, L, N, D): odd shapes covering N in {1, 7, BN-1, BN+1, ~300}, every D, odd G, several q_len.
SHAPES = [
    (1, 2, 1, 1, 1, 64),
    (1, 1, 3, 1, 7, 80),
    (2, 1, 5, 2, BN - 1, 96),
    (1, 2, 4, 4, BN + 1, 128),
    (1, 1, 8, 2, 300, 64),
    (1, 1, 3, 1, 2 * BN + 1, 256),
    (1, 1, 6, 1, 5 * BN - 3, 64),
    (1, 1, 7, 4, 3 * BN, 64),  # 28 packed rows: BLOCK_M 32
    (1, 1, 5, 16, 2 * BN + 3, 64),  # 80 packed rows: two M blocks of 64, q_len 16
]


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}-Hkv{}-G{}-L{}-N{}-D{}".format(*s))
def test_kernels_match_reference(device, shape):
    dev = _dev(device)
    B, Hkv, G, L, N, D = shape
    dtypes = [torch.float16] if dev.type == "cpu" else [torch.float16, torch.bfloat16, torch.float32]
    block_n = BN if dev.type == "cpu" else 64
    for dtype in dtypes:
        q, k, v = _inputs(B, Hkv, G, L, N, D, dtype, dev)
        ref, ref_lse = _expected(q, k, v)
        for name, out, lse in _run_both(q, k, v, splits=(1, 3), grids=(2, 64), block_n=block_n):
            _check(out, ref, dtype, f"{name} {dtype}")
            _check_lse(lse, ref_lse, f"{name} {dtype}")


@pytest.mark.parametrize("device", DEVICES)
def test_fp32_inputs(device):
    dev = _dev(device)
    q, k, v = _inputs(1, 2, 3, 2, 37, 64, torch.float32, dev)
    ref, ref_lse = _expected(q, k, v, scale=0.3)
    for name, out, lse in _run_both(q, k, v, splits=(4,), grids=(3,), block_n=BN, scale=0.3):
        _check(out, ref, torch.float32, name)
        _check_lse(lse, ref_lse, name)


CASES = [
    # (mask kind, is_causal, valid_len kind, layout)
    ("bool", False, None, "contiguous"),
    ("bool_bcast", False, "short", "cache_slice"),
    ("additive", False, None, "bnhd"),
    ("additive_2d", False, "mixed", "contiguous"),
    (None, True, None, "contiguous"),
    ("bool", True, "mixed", "bnhd"),
    (None, False, "tiny", "cache_slice"),
    (None, False, "zero", "contiguous"),
]


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(x) for x in c))
def test_masks_valid_len_strides(device, case):
    dev = _dev(device)
    mask_kind, causal, vl_kind, layout = case
    B, Hkv, G, L, N, D = 2, 2, 3, 4, 3 * BN + 5, 64
    dtype = torch.float16
    q, k, v = _inputs(B, Hkv, G, L, N, D, dtype, dev, layout=layout)
    mask = _mask(mask_kind, B, Hkv * G, L, N, dev)
    valid = None
    if vl_kind == "short":  # shorter than one tile: most partitions receive no key
        valid = torch.tensor([5, BN - 1], dtype=torch.int32, device=dev)
    elif vl_kind == "mixed":
        valid = torch.tensor([N, BN + 3], dtype=torch.int32, device=dev)
    elif vl_kind == "tiny":
        valid = torch.tensor([1, 2], dtype=torch.int64, device=dev)
    elif vl_kind == "zero":  # a row with no key at all: o = 0, lse = -inf, no NaN
        valid = torch.tensor([0, 9], dtype=torch.int32, device=dev)
    kw = dict(attn_mask=mask, valid_len=valid, is_causal=causal)
    ref, ref_lse = _expected(q, k, v, **kw)
    for name, out, lse in _run_both(q, k, v, splits=(1, 5), grids=(3, 40), block_n=BN, **kw):
        _check(out, ref, dtype, f"{name} {case}")
        _check_lse(lse, ref_lse, f"{name} {case}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("poison", ["nan", "inf"])
def test_nothing_past_the_valid_length_reaches_the_output(device, poison):
    """K/V past each row's valid length hold NaN or Inf (a sharded cache's spare capacity, a static cache's unused
    tail): the output equals attention over the valid prefix. Bulk (TMA) copies read whole tiles, so the kernel
    must keep those rows out of the sums itself (a masked key's zero weight times NaN is NaN)."""
    dev = _dev(device)
    B, Hkv, G, L, N, D = 2, 2, 3, 1, 4 * BN, 64
    q, k, v = _inputs(B, Hkv, G, L, N, D, torch.float16, dev)
    valid = torch.tensor([BN + 3, 3 * BN - 1], dtype=torch.int32, device=dev)
    ref, ref_lse = _expected(q, k, v, valid_len=valid)
    bad = float(poison)
    for b, n in enumerate(valid.tolist()):
        k[b, :, n:] = bad
        v[b, :, n:] = bad
    for name, out, lse in _run_both(q, k, v, splits=(1, 3), grids=(5,), block_n=BN, valid_len=valid):
        _check(out, ref, torch.float16, f"{name} {poison} past the valid length")
        _check_lse(lse, ref_lse, f"{name} {poison} past the valid length")


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_stream_k_replay_and_growing_length(device):
    """The same workspace (as a captured graph would hold it) serves repeated launches while the valid length
    grows; counters return to zero each time, and repeated launches give identical results."""
    dev = _dev(device)
    B, Hkv, G, L, N, D = 2, 2, 4, 1, 6 * BN, 64
    q, k, v = _inputs(B, Hkv, G, L, N, D, torch.float16, dev)
    grid = 7
    ws = stream_k_workspace(grid, q, k, v)
    split_ws = split_kv_workspace(4, q, k, v)
    valid = torch.zeros(B, dtype=torch.int32, device=dev)
    for length in (1, BN + 1, 3 * BN - 1, N):
        valid.copy_(torch.tensor([length, max(1, length // 2)], dtype=torch.int32))
        ref = sdpa_float64(q, k, v, valid_len=valid)
        outs = []
        for _ in range(2):
            out = torch.full((B, Hkv * G, L, D), float("nan"), dtype=q.dtype, device=dev)
            stream_k_decode(q, k, v, out, workspace=ws, valid_len=valid, grid=grid, block_n=BN)
            assert int(ws[2].abs().sum()) == 0
            outs.append(out)
        assert torch.equal(outs[0], outs[1]), "replaying stream-K changed the result"
        _check(outs[0], ref, torch.float16, f"stream_k length {length}")
        for fused in (False, True):
            out = torch.full((B, Hkv * G, L, D), float("nan"), dtype=q.dtype, device=dev)
            split_kv_decode(q, k, v, out, workspace=split_ws, valid_len=valid, num_splits=4, block_n=BN,
                            fused_merge=fused)
            assert int(split_ws[2].abs().sum()) == 0
            _check(out, ref, torch.float16, f"split_kv(fused={fused}) length {length}")


@pytest.mark.parametrize("device", DEVICES)
def test_tma_descriptors_only_where_the_copy_engine_allows(device):
    """TMA tiles need a contiguous last dim and 16-byte aligned base and strides; anything else takes the pointer
    path (kv_descriptors returns None) and still gives the reference answer."""
    from attnopt.runtime.kernels.common import kv_descriptors

    dev = _dev(device)
    if dev.type == "cuda" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs Hopper")
    B, Hkv, G, L, N, D = 1, 2, 3, 1, 2 * BN + 3, 64
    q, k, v = _inputs(B, Hkv, G, L, N, D, torch.float16, dev)
    assert kv_descriptors(k, v, BN) is not None
    odd = torch.randn(B, Hkv, N * D + 1, dtype=torch.float16, device=dev)[..., 1:].reshape(B, Hkv, N, D)
    assert kv_descriptors(odd, v, BN) is None, "a base off 16 bytes cannot be a TMA descriptor"
    d_strided = torch.randn(B, Hkv, N, 2 * D, dtype=torch.float16, device=dev)[..., ::2]
    assert kv_descriptors(k, d_strided, BN) is None, "a strided head dim cannot be a TMA descriptor"
    ref, _ = _expected(q, odd, d_strided)
    out = torch.full((B, Hkv * G, L, D), float("nan"), dtype=q.dtype, device=dev)
    split_kv_decode(q, odd, d_strided, out, num_splits=3, block_n=BN, tma=True)
    _check(out, ref, torch.float16, "split_kv tma=True on unaligned K/V (pointer fallback)")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("D,in_loop", [(64, "1"), (96, "1"), (96, "0")])
def test_tma_tile_crossing_the_keys_inside_the_loop(device, D, in_loop, monkeypatch):
    """Without a valid length the copy engine reads the rows past N as zeros (the descriptor's own bounds), so the
    tile crossing N runs in the pipelined loop (``PAST_ZERO``): the storage past a cache view's N holds NaN, and
    split-KV (one split, several, shares ending mid-tile) and stream-K still match the reference, with and without
    the head chunks (D=96: 64 + 32), and so does the tile after the loop (``ATTNOPT_TAIL_IN_LOOP=0``). With a valid
    length the crossing tile still zeroes V past it."""
    monkeypatch.setenv("ATTNOPT_TAIL_IN_LOOP", in_loop)
    dev = _dev(device)
    if dev.type == "cuda" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs Hopper")
    B, Hkv, G, L, N = 2, 1, 3, 1, 3 * BN + 5
    q = torch.randn(B, Hkv * G, L, D, dtype=torch.float16, device=dev)
    store = torch.randn(2, B, Hkv, N + 2 * BN, D, dtype=torch.float16, device=dev)
    store[:, :, :, N:] = float("nan")
    k, v = store[0, :, :, :N], store[1, :, :, :N]  # views: NaN right past their N
    ref, _ = _expected(q, k, v)
    for chunks in (False, True):
        for s in (1, 3):
            out = torch.full((B, Hkv * G, L, D), float("nan"), dtype=q.dtype, device=dev)
            split_kv_decode(q, k, v, out, num_splits=s, block_n=BN, tma=True, head_chunks=chunks)
            _check(out, ref, torch.float16, f"split_kv S={s} tma chunks={chunks} past N")
        out = torch.full((B, Hkv * G, L, D), float("nan"), dtype=q.dtype, device=dev)
        stream_k_decode(q, k, v, out, workspace=stream_k_workspace(5, q, k, v), grid=5, block_n=BN, tma=True,
                        head_chunks=chunks)
        _check(out, ref, torch.float16, f"stream_k tma chunks={chunks} past N")
    # a valid length inside the tensor: the rows past it are real storage (NaN here) and V's are zeroed
    k2, v2 = store[0], store[1]
    valid = torch.tensor([N, N - 2], device=dev)
    ref2, _ = _expected(q, k2.nan_to_num(), v2.nan_to_num(), valid_len=valid)
    out = torch.full((B, Hkv * G, L, D), float("nan"), dtype=q.dtype, device=dev)
    split_kv_decode(q, k2, v2, out, valid_len=valid, num_splits=3, block_n=BN, tma=True)
    _check(out, ref2, torch.float16, "split_kv tma valid_len past N")


@pytest.mark.cuda
def test_tma_only_while_capturing(monkeypatch):
    """By default an eager launch takes pointer tiles and a captured one TMA tiles; both give the reference."""
    from attnopt.runtime.kernels.common import tma_now

    dev = torch.device("cuda")
    q, k, v = _inputs(1, 2, 4, 1, 300, 128, torch.bfloat16, dev)
    ref, _ = _expected(q, k, v)
    out = torch.full((1, 8, 1, 128), float("nan"), dtype=q.dtype, device=dev)
    ws = split_kv_workspace(4, q, k, v)
    split_kv_decode(q, k, v, out, workspace=ws, num_splits=4, block_n=64, tma=True)  # compile the TMA kernel
    monkeypatch.delenv("ATTNOPT_TMA_EAGER")
    assert not tma_now(dev)
    out.fill_(float("nan"))
    split_kv_decode(q, k, v, out, workspace=ws, num_splits=4, block_n=64, tma=True)
    _check(out, ref, torch.bfloat16, "eager split_kv tma=True (pointer tiles)")
    seen = []
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        seen.append(tma_now(dev))
        split_kv_decode(q, k, v, out, workspace=ws, num_splits=4, block_n=64, tma=True)
    assert seen == [True]
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    _check(out, ref, torch.bfloat16, "captured split_kv tma=True (TMA tiles)")


def test_descriptor_copies_equal_fresh_descriptors():
    """A descriptor built from a template (after the first, validated one) equals one TensorDescriptor builds anew,
    for another tensor of another length and strides (a dynamic cache's next step)."""
    if not interpreting():
        pytest.skip("CPU descriptors need the Triton interpreter")
    from triton.tools.tensor_descriptor import TensorDescriptor

    from attnopt.runtime.kernels.common import kv_descriptors

    k1, v1 = torch.randn(1, 2, 40, 64, dtype=torch.float16), torch.randn(1, 2, 40, 64, dtype=torch.float16)
    kv_descriptors(k1, v1, 16)
    k2 = torch.randn(2, 3, 57, 64, dtype=torch.float16)[:, :, 5:]
    v2 = torch.randn(2, 57, 3, 64, dtype=torch.float16).transpose(1, 2)
    for t, d in zip((k2, v2), kv_descriptors(k2, v2, 16)):
        fresh = TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, 16, 64])
        assert vars(d) == vars(fresh) and d.base is t


@pytest.mark.parametrize("device", DEVICES)
def test_merge_states_kernel(device):
    dev = _dev(device)
    P, R, Dv = 5, 7, 80
    o = torch.randn(P, 3, R, Dv, device=dev)
    lse = torch.randn(P, 3, R, device=dev) * 3
    lse[1] = float("-inf")  # an empty partition everywhere
    lse[:, 0, 2] = float("-inf")  # a row empty in every partition
    o[1] = 0.0
    o[:, 0, 2] = 0.0
    ro, rl = ref_merge_states(o, lse)
    out = torch.full((3, R, Dv), float("nan"), device=dev)
    lout = torch.full((3, R), float("nan"), device=dev)
    mo, ml = merge_states(o, lse, out, lout)
    assert mo is out and ml is lout
    assert not torch.isnan(mo).any() and not torch.isnan(ml).any()
    torch.testing.assert_close(mo, ro, atol=1e-5, rtol=1e-5)
    assert torch.isneginf(ml[0, 2]) and bool((mo[0, 2] == 0).all())
    torch.testing.assert_close(ml, rl, atol=1e-5, rtol=1e-5)
    for split in (2, 4):  # programs per row over shares of the padded Dv (128 here: 80 real, the last share padding)
        out2 = torch.full((3, R, Dv), float("nan"), device=dev)
        lout2 = torch.full((3, R), float("nan"), device=dev)
        merge_states(o, lse, out2, lout2, dv_split=split)
        assert not torch.isnan(out2).any() and not torch.isnan(lout2).any(), split  # every column written
        if device == "cpu":  # the interpreter runs the same float32 operations per element: bit for bit
            assert torch.equal(out2, mo) and torch.equal(lout2, ml), split
        else:  # compiled at another tile width the last bit may differ (H100 at 8e6ae2d: not torch.equal for split 2)
            torch.testing.assert_close(out2, mo, atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(lout2, ml, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="dv_split must be a power of two"):
        merge_states(o, lse, dv_split=3)
    # allocated outputs, P=1, lower-precision output dtype
    mo2, ml2 = merge_states(o[:1], lse[:1], out_dtype=torch.float16)
    assert mo2.dtype == torch.float16
    torch.testing.assert_close(mo2.float(), torch.where(torch.isneginf(lse[0])[..., None], 0.0, o[0]),
                               atol=1e-3, rtol=1e-3)


@pytest.mark.cuda
def test_cuda_graph_replay_growing_valid_len():
    """Capture each strategy in a CUDA graph once; replay as the valid length grows; compare every replay."""
    from attnopt.plan import SplitKVPlan, StreamKPlan
    from attnopt.runtime.strategies import get_strategy

    dev = torch.device("cuda")
    B, Hkv, G, L, N, D = 2, 8, 4, 1, 4096, 128
    q, k, v = _inputs(B, Hkv, G, L, N, D, torch.bfloat16, dev)
    valid = torch.full((B,), 100, dtype=torch.int32, device=dev)
    for plan in (SplitKVPlan(num_splits=16, block_n=64), SplitKVPlan(num_splits=33, block_n=128, num_warps=8,
                                                                      fused_merge=True),
                 SplitKVPlan(num_splits=16, block_n=64, tma=True), SplitKVPlan(num_splits=40, block_n=128, tma=True,
                                                                               num_stages=3),
                 StreamKPlan(grid=132, block_n=64), StreamKPlan(grid=264, block_n=128, num_warps=8),
                 SplitKVPlan(num_splits=40, block_n=128, tma=True, num_stages=3, chain=True, merge_dv_split=0),
                 StreamKPlan(grid=132, block_n=64, tma=True, merge_launch=True)):
        strat = get_strategy(plan.kind)
        state = strat.prepare(plan, q, k, v)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            strat.run(state, plan, q, k, v, None, valid, 1.0 / math.sqrt(D), False)  # compile outside capture
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            static_out = strat.run(state, plan, q, k, v, None, valid, 1.0 / math.sqrt(D), False)
        for length in (100, 1000, 2049, 4096):
            valid.fill_(length)
            valid[1] = length // 3 + 1
            g.replay()
            torch.cuda.synchronize()
            ref = sdpa_float64(q, k, v, valid_len=valid)
            _check(static_out, ref, torch.bfloat16, f"{plan.describe()} graph replay at {length}")


@pytest.mark.cuda
def test_merge_states_op_uses_kernel_on_cuda():
    from attnopt.runtime import ops  # noqa: F401  (registers torch.ops.attnopt)

    o = torch.randn(6, 2, 9, 128, device="cuda")
    lse = torch.randn(6, 2, 9, device="cuda")
    lse[2] = float("-inf")
    mo, ml = torch.ops.attnopt.merge_states(o, lse)
    ro, rl = ref_merge_states(o, lse)
    torch.testing.assert_close(mo, ro, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ml, rl, atol=1e-5, rtol=1e-5)


SPEC_VALUES = [0, 1, 2, 15, 16, 17, 32, -1, -16, -17, 2 ** 31 - 16, 2 ** 31 - 1, 2 ** 31, 2 ** 31 + 16, -(2 ** 31),
               -(2 ** 31) - 16, 2 ** 40, 2 ** 40 + 3, 2 ** 63 - 1, True, False, 0.5, 1.0, -3.25]


def test_launcher_scalar_spec_matches_triton():
    """The direct launcher's level-2 key must separate every pair of scalars that Triton compiles differently:
    its specialisation is compared with Triton's own, value by value and pair by pair."""
    native = pytest.importorskip("triton._C.libtriton").native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend

    from attnopt.runtime.kernels.launch import scalar_spec

    for a in SPEC_VALUES:
        assert scalar_spec(a) is not None, a
        for b in SPEC_VALUES:
            same_triton = native(CUDABackend, a, False, True, True) == native(CUDABackend, b, False, True, True)
            assert (scalar_spec(a) == scalar_spec(b)) == same_triton, (a, b)
    assert scalar_spec("x") is None and scalar_spec(None) is None


def test_launcher_pointer_keys():
    """Pointer keys: dtype and 16-byte alignment (what Triton specialises a pointer on); descriptors by block."""
    from attnopt.runtime.kernels.launch import _ptr_key

    a = torch.zeros(64, dtype=torch.float16)
    assert _ptr_key(a) == _ptr_key(torch.zeros(64, dtype=torch.float16))
    assert _ptr_key(a) != _ptr_key(a.view(torch.int16))
    assert _ptr_key(a) != _ptr_key(a[1:])  # 2 bytes off: not 16-byte aligned
    assert _ptr_key(a) == _ptr_key(a[8:])  # 16 bytes off: aligned again
    from triton.tools.tensor_descriptor import TensorDescriptor

    k = torch.zeros(1, 2, 32, 64, dtype=torch.float16)
    d1 = TensorDescriptor(k, list(k.shape), list(k.stride()), [1, 1, 16, 64])
    d2 = TensorDescriptor(k, list(k.shape), list(k.stride()), [1, 1, 32, 64])
    assert _ptr_key(d1) != _ptr_key(d2)
    with pytest.raises(TypeError):
        _ptr_key(object())


def test_launcher_keys_positional_constexprs_by_value():
    """A ``tl.constexpr`` passed by position (the decode kernels' ``D``, ``DV``) is compiled into the kernel: the
    level-2 key holds its value. Keyed by Triton's specialisation of an int, D=80, 96 and 128 (multiples of 16)
    shared one compiled kernel where the rest of the launch matched (the same padded BLOCK_D): wrong outputs on the
    H100 (main 6c52fb6: planner bench rel err 1.04 at D=96, 0.68 at D=80; every D=128 launch of a sweep after its
    D=80 ones)."""
    import inspect

    from attnopt.runtime.kernels import merge, split_kv, stream_k
    from attnopt.runtime.kernels.launch import KernelLauncher, constexpr_positions

    for launcher in (split_kv._SPLIT_KV_LAUNCH, stream_k._STREAM_K_LAUNCH, merge._MERGE_LAUNCH):
        fn = launcher.fn
        names = list(inspect.signature(getattr(fn, "fn", fn)).parameters)
        wanted = [i for i, n in enumerate(names) if "constexpr" in str(
            inspect.signature(getattr(fn, "fn", fn)).parameters[n].annotation)]
        assert list(constexpr_positions(fn)) == wanted
    ks = split_kv._SPLIT_KV_LAUNCH
    names = list(inspect.signature(getattr(ks.fn, "fn", ks.fn)).parameters)[ks.n_ptr:]
    d, dv = names.index("D"), names.index("DV")
    assert {d, dv} <= set(ks.constexpr_scalars) and names.index("N") not in ks.constexpr_scalars
    scalars = [7] * len(names)
    keys = set()
    for head_dim in (80, 96, 128):
        scalars[d] = scalars[dv] = head_dim
        keys.add(ks.scalar_key(tuple(scalars)))
    assert len(keys) == 3, "head dims 80/96/128 must not share a compiled kernel"
    scalars[names.index("N")] = 4160  # a runtime int keys by its specialisation only
    same = ks.scalar_key(tuple(scalars))
    scalars[names.index("N")] = 4176
    assert ks.scalar_key(tuple(scalars)) == same
    assert isinstance(KernelLauncher(merge._merge_states_kernel).constexpr_scalars, tuple)


@pytest.mark.cuda
def test_direct_launches_are_exact():
    """The direct path serves repeated launches (level 1), new buffers and new lengths (level 2), and always
    computes this call's result; a changed specialisation (misaligned view) compiles anew."""
    from attnopt.runtime.kernels import merge as merge_mod

    launcher = merge_mod._MERGE_LAUNCH
    o = torch.randn(4, 3, 9, 128, device="cuda")
    lse = torch.randn(4, 3, 9, device="cuda")
    out = torch.empty(3, 9, 128, device="cuda")
    merge_mod.merge_states(o, lse, out=out, lse_out=False)
    d0, j0 = launcher.direct, launcher.jit
    out.zero_()
    merge_mod.merge_states(o, lse, out=out, lse_out=False)
    assert launcher.direct == d0 + 1 and launcher.jit == j0, "an identical launch must take the direct path"
    torch.testing.assert_close(out, ref_merge_states(o, lse)[0], atol=1e-5, rtol=1e-5)
    for rows in (9, 10, 33):  # new buffers, new row counts and strides: the same specialisation or a new one
        o2 = torch.randn(4, 3, rows, 128, device="cuda")
        l2 = torch.randn(4, 3, rows, device="cuda")
        l2[1] = float("-inf")
        out2 = torch.full((3, rows, 128), float("nan"), device="cuda")
        merge_mod.merge_states(o2, l2, out=out2, lse_out=False)
        torch.testing.assert_close(out2, ref_merge_states(o2, l2)[0], atol=1e-5, rtol=1e-5)
    assert launcher.direct >= d0 + 2, "a new buffer of a known specialisation must launch directly"
    # a view 4 bytes off alignment changes the pointer specialisation: Triton's path, then correct
    big = torch.randn(4 * 3 * 9 * 128 + 1, device="cuda")
    o3 = big[1:].view(4, 3, 9, 128)
    j1 = launcher.jit
    merge_mod.merge_states(o3, lse, out=out, lse_out=False)
    assert launcher.jit == j1 + 1
    torch.testing.assert_close(out, ref_merge_states(o3, lse)[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_fully_masked_rows_follow_sdpa(device):
    """Rows hidden whole: by finfo.min (fp32 absorbs the scores: SDPA gives the mean of V over the row's keys, and
    every split's and stream-K partial's state must weigh by its key count, not equally), by -inf and by False
    (SDPA gives 0). Splits of unequal key counts (N = 5 * BN - 3 over 3 splits) make equal weights visible."""
    dev = _dev(device)
    torch.manual_seed(7)
    B, Hkv, G, L, N, D = 2, 1, 3, 2, 5 * BN - 3, 64
    q, k, v = _inputs(B, Hkv, G, L, N, D, torch.float32, dev)
    kr, vr = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    low = torch.finfo(torch.float32).min
    additive = torch.rand(B, 1, L, N, device=dev) * -2.0
    additive[0, :, 0] = low  # batch 0, query 0: every key at finfo.min
    additive[1, :, 1] = float("-inf")  # batch 1, query 1: every key -inf
    additive[1, :, 0, 5:] = low  # partly hidden by finfo.min: an ordinary row
    boolean = torch.rand(B, 1, L, N, device=dev) > 0.3
    boolean[0, :, 1] = False
    for mask in (additive, boolean):
        # SDPA's math backend: on CUDA its fused backends give 0 for a row that finfo.min hides (H100, fp32, the
        # efficient kernel); the math backend and the eager softmax chain give the mean of V, and so does attnopt
        with sdpa_kernel(SDPBackend.MATH):
            ref = torch.nn.functional.scaled_dot_product_attention(q, kr, vr, attn_mask=mask).double()
        for name, out, _ in _run_both(q, k, v, splits=(1, 3), grids=(3, 7), block_n=BN, attn_mask=mask):
            err = (out.double() - ref).abs().max().item()
            assert err < 2e-5, f"{name}, {mask.dtype} mask: max abs error {err:.3e} on fully masked rows"


def test_merge_states_kernel_keeps_log_l_apart():
    """The merge kernel's log_l_parts: partitions whose maxima tie near finfo.min weigh by their key counts."""
    dev = _dev("cpu")
    m = torch.full((3, 4), -1.0e30, device=dev)  # natural-log maxima of partials that a finfo.min row left tied
    log_l = torch.log(torch.tensor([[1.0], [5.0], [10.0]], device=dev)).expand(3, 4).contiguous()
    o = torch.randn(3, 4, 64, device=dev)
    ro, _ = ref_merge_states(o, m, log_l)
    mo, _ = merge_states(o, m, log_l_parts=log_l)
    want = (o * torch.tensor([1.0, 5.0, 10.0], device=dev)[:, None, None]).sum(0) / 16.0
    torch.testing.assert_close(ro, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mo, want, atol=1e-5, rtol=1e-5)
    planes = torch.empty(2, 4, device=dev)  # Dv in four programs a row; the row max and log l planes from one
    mo4, _ = merge_states(o, m, lse_out=planes, log_l_parts=log_l, dv_split=4)
    assert torch.equal(mo4, mo)
    torch.testing.assert_close(planes[0] + planes[1], torch.logsumexp(m + log_l, 0), atol=1e-5, rtol=1e-5)
