"""The one-launch ``valid_len_from_mask`` kernel against the reference, for every mask shape SDPA broadcasts, bool
and additive masks, fully hidden rows and batch rows, and strided (expanded, sliced) masks."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnopt.runtime.kernels import interpreting
from attnopt.runtime.kernels.valid_len import key_range_from_mask as range_kernel
from attnopt.runtime.kernels.valid_len import key_start_from_mask as start_kernel
from attnopt.runtime.kernels.valid_len import valid_len_from_mask as kernel
from attnopt.runtime.reference import key_range_from_mask as range_reference
from attnopt.runtime.reference import key_start_from_mask as start_reference
from attnopt.runtime.reference import valid_len_from_mask as reference

DEVICES = [pytest.param("cpu", id="interp"), pytest.param("cuda", id="cuda", marks=pytest.mark.cuda)]


def _dev(device: str) -> str:
    if device == "cpu" and not interpreting():
        pytest.skip("CPU kernel tests need the Triton interpreter (TRITON_INTERPRET=1)")
    return device


def _mask(shape, dtype, p_visible, seed, device):
    g = torch.Generator().manual_seed(seed)
    visible = torch.rand(shape, generator=g) < p_visible
    if dtype == torch.bool:
        m = visible
    else:
        low = torch.finfo(dtype).min if seed % 2 else float("-inf")  # finfo.min counts as visible
        m = torch.where(visible, torch.rand(shape, generator=g) * -3, torch.tensor(low)).to(dtype)
        if seed % 2:
            m = torch.where(torch.rand(shape, generator=g) < 0.3, torch.tensor(float("-inf"), dtype=dtype), m)
    return m.to(device)


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_kernel_matches_reference_for_broadcast_shapes(device, data):
    device = _dev(device)
    B = data.draw(st.integers(1, 3), label="B")
    H = data.draw(st.sampled_from([1, 3]), label="H")
    L = data.draw(st.sampled_from([1, 2]), label="L")
    N = data.draw(st.integers(2, 300), label="N")
    rank = data.draw(st.integers(1, 4), label="rank")
    full = [data.draw(st.sampled_from([1, B]), label="b"), data.draw(st.sampled_from([1, H]), label="h"),
            data.draw(st.sampled_from([1, L]), label="l"), N]
    shape = full[4 - rank:]
    dtype = data.draw(st.sampled_from([torch.bool, torch.float32, torch.float16]), label="dtype")
    p = data.draw(st.sampled_from([0.0, 0.05, 0.5, 1.0]), label="p")
    m = _mask(shape, dtype, p, data.draw(st.integers(0, 99), label="seed"), device)
    batch = B if shape and len(shape) == 4 and shape[0] == B else data.draw(st.sampled_from([1, B]), label="batch")
    got = kernel(m, batch)
    assert got.dtype == torch.int32 and got.shape == (batch,)
    assert torch.equal(got.cpu(), reference(m, batch).cpu())
    assert torch.equal(start_kernel(m, batch).cpu(), start_reference(m, batch).cpu())  # the key start (FIRST)
    rng = range_kernel(m, batch)  # both ends in one scan (RANGE)
    assert rng.dtype == torch.int32 and rng.shape == (2, batch)
    assert torch.equal(rng.cpu(), range_reference(m, batch).cpu())


@pytest.mark.parametrize("device", DEVICES)
def test_kernel_reads_strided_and_expanded_masks(device):
    device = _dev(device)
    base = torch.zeros(2, 1, 1, 700, dtype=torch.bool, device=device)
    base[0, ..., :513] = True
    base[1, ..., 40] = True
    expanded = base.expand(2, 4, 3, 700)  # stride 0 on heads and rows
    sliced = torch.zeros(2, 4, 3, 1400, dtype=torch.bool, device=device)[..., ::2]  # stride 2 on keys
    sliced[1, 2, 1, 699] = True
    for m in (base, expanded, sliced, base[..., :600]):
        assert torch.equal(kernel(m, 2).cpu(), reference(m, 2).cpu())
        assert torch.equal(start_kernel(m, 2).cpu(), start_reference(m, 2).cpu())
        assert torch.equal(range_kernel(m, 2).cpu(), range_reference(m, 2).cpu())
    assert kernel(base, 2).tolist() == [513, 41] and start_kernel(base, 2).tolist() == [0, 40]
    assert range_kernel(base, 2).tolist() == [[0, 40], [513, 41]]


def test_kernel_refuses_what_it_cannot_read():
    _dev("cpu")
    with pytest.raises(ValueError, match="neither 1 nor"):
        kernel(torch.ones(3, 1, 1, 8, dtype=torch.bool), 2)
    with pytest.raises(ValueError, match="broadcast along the keys"):
        kernel(torch.ones(1, 1, 1, 1, dtype=torch.bool), 2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bool, torch.float32])
@pytest.mark.parametrize("fold", ["arrive", "atomic"])
def test_long_masks_fold_column_chunks_with_atomics(device, dtype, fold, monkeypatch):
    """Rows longer than ATOMIC_CHUNK_N: programs over column chunks, folded by the last program to arrive at each
    batch row (one launch; the arrival counters are zero again after it) or, without counters (first use inside a
    graph capture), with atomics into a filled output; rows visible only in one chunk, in the last partial chunk,
    everywhere, or nowhere."""
    from attnopt.runtime.kernels import valid_len
    from attnopt.runtime.kernels.valid_len import ATOMIC_CHUNK_N, key_start_from_mask
    from attnopt.runtime.reference import key_start_from_mask as key_start_reference

    device = _dev(device)
    if fold == "atomic":
        monkeypatch.setattr(valid_len, "arrival_counters", lambda device, batch: None)
    n = 2 * ATOMIC_CHUNK_N + 777
    visible = torch.zeros(4, 2, 1, n, dtype=torch.bool)
    visible[0, 1, 0, ATOMIC_CHUNK_N + 5: ATOMIC_CHUNK_N + 9] = True  # inside the middle chunk, one head only
    visible[1, 0, 0, n - 3] = True  # in the partial last chunk
    visible[1, 1, 0, 2] = True
    visible[2] = True  # everywhere
    # batch row 3: nothing visible (valid length 0, key start 0)
    m = visible if dtype == torch.bool else torch.where(visible, torch.finfo(dtype).min, float("-inf")).to(dtype)
    m = m.to(device)
    assert kernel(m, 4).tolist() == reference(m, 4).tolist() == [ATOMIC_CHUNK_N + 9, n - 2, n, 0]
    assert key_start_from_mask(m, 4).tolist() == key_start_reference(m, 4).tolist() == [ATOMIC_CHUNK_N + 5, 2, 0, 0]
    # both ends in one scan: the start of a row without a visible key is the empty range's 2**31 - 1
    assert range_kernel(m, 4).tolist() == range_reference(m, 4).tolist() == [
        [ATOMIC_CHUNK_N + 5, 2, 0, 2**31 - 1], [ATOMIC_CHUNK_N + 9, n - 2, n, 0]]
    assert range_kernel(m[:1], 3).tolist() == [[ATOMIC_CHUNK_N + 5] * 3, [ATOMIC_CHUNK_N + 9] * 3]
    if fold == "arrive":
        assert not valid_len.arrival_counters(m.device, 4).any()  # every launch leaves them zero
    broadcast = m[:1]  # one mask row for every batch row
    assert kernel(broadcast, 3).tolist() == [ATOMIC_CHUNK_N + 9] * 3


@pytest.mark.cuda
def test_long_mask_scan_replays_in_a_cuda_graph():
    """The one-launch scan of a long mask (the last program to arrive folds the chunks) captured in a CUDA graph:
    each replay, after the mask's band moves in place, gives the reference's key range, and leaves the arrival
    counters zero."""
    from attnopt.runtime.kernels import valid_len

    B, N, W = 3, 5 * 8192 + 123, 1000
    mask = torch.zeros(B, 1, 1, N, dtype=torch.bool, device="cuda")

    def place(ends):
        mask.zero_()
        for b, end in enumerate(ends):
            mask[b, ..., max(0, end - W):end] = True

    place([N, 9000, 0])
    range_kernel(mask, B)  # counters made outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = range_kernel(mask, B)
    for ends in ([N, 9000, 0], [500, 8192 * 2 + 1, N - 7], [0, 0, 0], [N, N, N]):
        place(ends)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), range_reference(mask, B).cpu()), ends
        assert not valid_len.arrival_counters(mask.device, B).any()
