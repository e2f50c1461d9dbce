"""The decode kernels' variant paths against the float64 reference: a per-row key start (sliding windows, read on
device), logit softcapping and ALiBi slopes, in split-KV and stream-K, including fully masked windows and rows.

On the CPU the kernels run in the Triton interpreter (fp32/fp16); the same tests run compiled on CUDA (``cuda``).
"""
from __future__ import annotations

import math

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnopt.runtime.reference import decode_attention, key_start_from_mask, sdpa_float64, valid_len_from_mask

triton = pytest.importorskip("triton")

from attnopt.runtime.kernels import interpreting  # noqa: E402
from attnopt.runtime.kernels.split_kv import split_kv_decode  # noqa: E402
from attnopt.runtime.kernels.stream_k import stream_k_decode  # noqa: E402

DEVICES = [pytest.param("cpu", id="interp"), pytest.param("cuda", id="cuda", marks=pytest.mark.cuda)]
BN = 16


def _dev(device: str) -> torch.device:
    """The device of a parametrised case: CUDA when present, the CPU under the Triton interpreter; else skip."""
    if not (torch.cuda.is_available() if device == "cuda" else interpreting()):
        pytest.skip("needs CUDA" if device == "cuda" else "needs the Triton interpreter (TRITON_INTERPRET=1)")
    return torch.device(device)


def band_mask(B: int, L: int, N: int, lengths: list[int], window: int, device) -> torch.Tensor:
    """Hugging Face's sliding causal mask for decode (B, 1, L, N) bool: the L queries are the last L positions of
    each row's ``lengths[b]`` keys; query p sees keys j with p - window < j <= p."""
    mask = torch.zeros(B, 1, L, N, dtype=torch.bool, device=device)
    j = torch.arange(N, device=device)
    for b, n in enumerate(lengths):
        for i in range(L):
            p = n - L + i
            mask[b, 0, i] = (j <= p) & (j > p - window)
    return mask


def _run(kernel: str, q, k, v, *, splits_or_grid: int, **kw):
    out = torch.empty(q.shape[:3] + (v.shape[-1],), dtype=q.dtype, device=q.device)
    if kernel == "split_kv":
        split_kv_decode(q, k, v, out, num_splits=splits_or_grid, block_n=BN, **kw)
    else:
        stream_k_decode(q, k, v, out, grid=splits_or_grid, block_n=BN, **kw)
    return out


def _assert_every_split(kernel: str, q, k, v, ref, tol: float, splits: tuple[int, ...] = (1, 3), **kw):
    """``kernel`` at each split count (or stream-K grid) of ``splits`` is within ``tol`` (max abs) of ``ref``."""
    for n in splits:
        err = (_run(kernel, q, k, v, splits_or_grid=n, **kw).double() - ref).abs().max().item()
        assert err < tol, f"{kernel} ({n}): max abs error {err:.3e}"


def _inputs(B, Hkv, G, L, N, D, dtype, device):
    q = torch.randn(B, Hkv * G, L, D, dtype=dtype, device=device)
    k = torch.randn(B, Hkv, N, D, dtype=dtype, device=device)
    v = torch.randn(B, Hkv, N, D, dtype=dtype, device=device)
    return q, k, v


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kernel", ["split_kv", "stream_k"])
def test_window_reads_from_the_key_start(device, kernel):
    """A band mask and the key start derived from it: the result equals the reference over the whole mask, and keys
    before the start are never read (NaN poison there does not reach the output)."""
    dev = _dev(device)
    B, Hkv, G, L, N, D, W = 2, 2, 3, 2, 7 * BN + 3, 64, 2 * BN + 5
    q, k, v = _inputs(B, Hkv, G, L, N, D, torch.float32, dev)
    lengths = [N, 4 * BN + 1]
    mask = band_mask(B, L, N, lengths, W, dev)
    start, valid = key_start_from_mask(mask, B), valid_len_from_mask(mask, B)
    assert start.tolist() == [n - L - W + 1 for n in lengths]
    ref = sdpa_float64(q, k, v, attn_mask=mask)
    for b, s in enumerate(start.tolist()):  # poison every key below the start's tile
        k[b, :, :s // BN * BN] = float("nan")
        v[b, :, :s // BN * BN] = float("nan")
    _assert_every_split(kernel, q, k, v, ref, 2e-5, attn_mask=mask, valid_len=valid, key_start=start)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kernel", ["split_kv", "stream_k"])
def test_key_start_without_mask_hides_earlier_keys(device, kernel):
    """``key_start`` alone is a semantic (keys before it do not exist), also when it is not a tile multiple."""
    dev = _dev(device)
    B, Hkv, G, L, N, D = 3, 1, 4, 1, 5 * BN, 64
    q, k, v = _inputs(B, Hkv, G, L, N, D, torch.float32, dev)
    start = torch.tensor([0, BN + 3, 3 * BN], dtype=torch.int32, device=dev)
    valid = torch.tensor([N, 4 * BN - 1, 3 * BN], dtype=torch.int32, device=dev)  # row 2: empty window
    ref = sdpa_float64(q, k, v, valid_len=valid, key_start=start)
    assert ref[2].abs().max() == 0  # no key: SDPA's 0
    torch.testing.assert_close(ref.float(), decode_attention(q, k, v, valid_len=valid, key_start=start,
                                                             num_partitions=3).float(), atol=1e-6, rtol=1e-6)
    _assert_every_split(kernel, q, k, v, ref, 2e-5, splits=(1, 4), valid_len=valid, key_start=start)


@pytest.mark.parametrize("device", DEVICES)
def test_fully_masked_windows_follow_sdpa(device):
    """A band whose rows are hidden whole by finfo.min (SDPA: the mean of V over the row's keys, so the key start
    must not cut them: finfo.min counts as visible) or by -inf / False (SDPA: 0)."""
    dev = _dev(device)
    B, Hkv, G, L, N, D, W = 2, 1, 2, 2, 4 * BN + 3, 64, BN + 2
    q, k, v = _inputs(B, Hkv, G, L, N, D, torch.float32, dev)
    band = band_mask(B, L, N, [N, N], W, dev)
    low = torch.finfo(torch.float32).min
    additive = torch.zeros(B, 1, L, N, device=dev).masked_fill(~band, float("-inf"))
    additive[0, :, 0] = low  # every key at finfo.min: the mean of V over all of them
    additive[1, :, 1] = float("-inf")  # a row without keys
    boolean = band.clone()
    boolean[1, :, 0] = False
    kr, vr = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    for mask in (additive, boolean):
        # SDPA's math backend: CUDA's fused SDPA kernels give 0 for a row finfo.min hides (H100, fp32: this test
        # failed against them at c902706); the math backend and the eager chain give the mean of V, as attnopt does
        with sdpa_kernel(SDPBackend.MATH):
            ref = torch.nn.functional.scaled_dot_product_attention(q, kr, vr, attn_mask=mask).double()
        start, valid = key_start_from_mask(mask, B), valid_len_from_mask(mask, B)
        for kernel, n in (("split_kv", 1), ("split_kv", 3), ("stream_k", 5)):
            out = _run(kernel, q, k, v, splits_or_grid=n, attn_mask=mask, valid_len=valid, key_start=start)
            err = (out.double() - ref).abs().max().item()
            assert err < 2e-5, f"{kernel} ({n}), {mask.dtype}: max abs error {err:.3e}"


def test_key_start_from_mask_shapes():
    """Broadcast masks: along the keys (start 0), 2-D, per-head rows (the earliest row wins), no visible key."""
    m = torch.ones(1, 1, 1, 1, dtype=torch.bool)
    assert key_start_from_mask(m, 3).tolist() == [0, 0, 0]
    m2 = torch.tensor([[False, False, True, True]])
    assert key_start_from_mask(m2, 2).tolist() == [2, 2]
    m4 = torch.zeros(2, 2, 1, 6, dtype=torch.bool)
    m4[0, 0, 0, 4] = True
    m4[0, 1, 0, 2] = True
    assert key_start_from_mask(m4, 2).tolist() == [2, 0]
    add = torch.full((1, 1, 2, 5), float("-inf"))
    add[0, 0, 1, 3:] = torch.finfo(torch.float32).min
    assert key_start_from_mask(add, 1).tolist() == [3]
    with pytest.raises(ValueError, match="neither 1 nor"):
        key_start_from_mask(torch.ones(3, 1, 1, 4, dtype=torch.bool), 2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kernel", ["split_kv", "stream_k"])
def test_softcap_matches_reference(device, kernel):
    """Gemma 2's cap on the scores (large scores so that tanh saturates), with an additive mask after the cap."""
    dev = _dev(device)
    B, Hkv, G, L, N, D = 2, 2, 2, 2, 3 * BN + 5, 64
    q, k, v = _inputs(B, Hkv, G, L, N, D, torch.float32, dev)
    q = q * 4
    cap, scale = 5.0, 1.0 / (math.sqrt(D) * 5.0)
    mask = torch.where(torch.rand(B, 1, L, N, device=dev) > 0.2, 0.0, float("-inf"))
    ref = sdpa_float64(q, k, v, attn_mask=mask, scale=scale, softcap=cap)
    s = (q.double() @ k.double().repeat_interleave(G, 1).transpose(-1, -2)) * scale
    direct = torch.softmax(torch.tanh(s) * cap + mask.double(), -1) @ v.double().repeat_interleave(G, 1)
    torch.testing.assert_close(ref, direct)  # the oracle's cap is Gemma 2's
    _assert_every_split(kernel, q, k, v, ref, 5e-5, attn_mask=mask, scale=scale, softcap=cap)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kernel", ["split_kv", "stream_k"])
def test_alibi_matches_reference(device, kernel):
    """Bloom's slopes times the key position (large enough at these lengths to move the softmax), with a causal
    additive mask and GQA; the oracle's bias is the explicit ``slope[h] * j`` tensor."""
    dev = _dev(device)
    B, Hkv, G, L, N, D = 2, 2, 3, 2, 3 * BN + 5, 64
    q, k, v = _inputs(B, Hkv, G, L, N, D, torch.float32, dev)
    slopes = torch.tensor([2.0 ** -(i + 1) for i in range(Hkv * G)], device=dev)
    mask = torch.where(torch.rand(B, 1, L, N, device=dev) > 0.2, 0.0, float("-inf"))
    bias = slopes[None, :, None, None] * torch.arange(N, device=dev, dtype=torch.float32)
    ref = sdpa_float64(q, k, v, attn_mask=mask + bias)
    torch.testing.assert_close(ref, sdpa_float64(q, k, v, attn_mask=mask, alibi_slopes=slopes))
    _assert_every_split(kernel, q, k, v, ref, 5e-5, attn_mask=mask, alibi_slopes=slopes)
    with pytest.raises(ValueError, match="alibi_slopes must be"):
        _run(kernel, q, k, v, splits_or_grid=1, alibi_slopes=slopes[:2])


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(B=st.integers(1, 2), Hkv=st.integers(1, 2), G=st.sampled_from([1, 3, 4]), L=st.integers(1, 3),
       N=st.integers(1, 4 * BN + 1), D=st.sampled_from([64, 80]), window=st.integers(1, 3 * BN),
       softcap=st.sampled_from([0.0, 2.0, 30.0]), splits=st.integers(1, 4), kernel=st.sampled_from(["split_kv", "stream_k"]),
       fp16=st.booleans(), alibi=st.booleans(), data=st.data())
def test_fuzz_window_softcap_alibi(B, Hkv, G, L, N, D, window, softcap, splits, kernel, fp16, alibi, data):
    """Random small shapes, windows, caps, ALiBi slopes and lengths: kernel == reference (interpreter)."""
    if not interpreting():
        pytest.skip("needs the Triton interpreter")
    dtype = torch.float16 if fp16 else torch.float32
    lengths = [data.draw(st.integers(min(L, N), N)) for _ in range(B)]
    q, k, v = _inputs(B, Hkv, G, L, N, D, dtype, "cpu")
    mask = band_mask(B, L, N, lengths, window, "cpu")
    start, valid = key_start_from_mask(mask, B), valid_len_from_mask(mask, B)
    slopes = torch.rand(Hkv * G) * 0.5 if alibi else None
    ref = sdpa_float64(q, k, v, attn_mask=mask, softcap=softcap, alibi_slopes=slopes)
    out = _run(kernel, q, k, v, splits_or_grid=splits, attn_mask=mask, valid_len=valid, key_start=start,
               softcap=softcap, alibi_slopes=slopes)
    err = (out.double() - ref).abs().max().item()
    assert err < (4e-3 if fp16 else 5e-5), f"max abs error {err:.3e}"


@pytest.mark.cuda
def test_cuda_graph_replays_as_the_window_slides():
    """The window path under a captured CUDA graph: the key start and valid length are found from the mask on the
    device (one scan for both, as the lowered graph does) and the plans read them there, so one capture serves every position of the window
    (the mask is rewritten in place between replays); each replay equals the reference."""
    import torch.cuda

    from attnopt.plan import SplitKVPlan, StreamKPlan
    from attnopt.runtime.kernels.valid_len import key_range_from_mask as range_kernel
    from attnopt.runtime.strategies import get_strategy

    dev = torch.device("cuda")
    B, Hkv, G, L, N, D, W = 2, 8, 4, 1, 8192, 128, 1024
    q, k, v = _inputs(B, Hkv, G, L, N, D, torch.bfloat16, dev)
    mask = band_mask(B, L, N, [2000, 3000], W, dev)
    slopes = torch.rand(Hkv * G, device=dev) * 0.01
    for plan in (SplitKVPlan(num_splits=16, block_n=64, tma=True), StreamKPlan(grid=132, block_n=64, tma=True)):
        strat = get_strategy(plan.kind)
        state = strat.prepare(plan, q, k, v)

        def step():
            start, valid = range_kernel(mask, B)
            return strat.run(state, plan, q, k, v, mask, valid, D ** -0.5, False, key_start=start, softcap=30.0,
                             alibi_slopes=slopes)

        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            step()  # compile outside the capture
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = step()
        for lengths in ([2000, 3000], [1025, 8192], [5000, 40]):
            mask.copy_(band_mask(B, L, N, lengths, W, dev))
            g.replay()
            torch.cuda.synchronize()
            ref = sdpa_float64(q, k, v, attn_mask=mask, softcap=30.0, alibi_slopes=slopes)
            err = (out.double() - ref).abs().max().item()
            assert err < 2e-2, f"{plan.describe()} replay at {lengths}: max abs error {err:.3e}"
