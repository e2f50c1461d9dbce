"""``valid_len_from_mask`` in one launch: per batch row, one past the last key any query row may attend to.

The pure-PyTorch version (``reference.valid_len_from_mask``) is seven kernels on a GPU (the visibility test, two
``any`` reductions, a cast, a product with the positions, ``amax``, the expand's copy): about 25 µs of a SmolLM2
decode step on an H100 (benchmarks/results/e2e-nvidia-h100-80gb-hbm3.json, 3eec1a5), for a length the attention
kernels only use to skip tiles. One program per batch row reads its mask rows once and reduces them.

With ``FIRST`` the same kernel finds the other end: the first key any query row may attend to
(``key_start_from_mask``, a sliding window's start; 0 where no key is visible). With ``RANGE`` it finds both in one
pass (``key_range_from_mask``: a window site needs both, and one scan of the mask is one launch instead of two).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import KernelLauncher


@triton.jit
def _valid_len_kernel(
    mask_ptr,  # mask viewed as (Bm, H, L, N): uint8 (bool) or float (additive; -inf hides); any strides
    out_ptr,  # (B,) int32, RANGE: (2, B) (first keys, then ends); ATOMIC: filled beforehand (0 for the last key,
    # INT32_MAX for the first)
    stride_mb, stride_mh, stride_ml, stride_mn,  # mask strides (the batch stride 0 when the mask has one row)
    ROWS,  # H * L mask rows per batch row
    L,  # query rows per head in the mask view
    N,  # key columns
    CHUNK_N,  # ATOMIC: key columns per program (a multiple of BLOCK_N); else N
    IS_BOOL: tl.constexpr,  # bool mask (True = visible); else additive (visible where > -inf)
    BLOCK_R: tl.constexpr,  # mask rows per step
    BLOCK_N: tl.constexpr,  # key columns per step
    FIRST: tl.constexpr = False,  # store the first visible key instead of one past the last
    ATOMIC: tl.constexpr = False,  # programs over column chunks (axis 1) fold into out with atomic max / min
    RANGE: tl.constexpr = False,  # store both: the first visible key (INT32_MAX where none is) at out[b], one past
    # the last at out[OUT_ROW + b]
    OUT_ROW=0,  # RANGE: the offset of the ends' row in out (B)
):
    b = tl.program_id(0).to(tl.int64)
    lo_n = 0
    hi_n = N
    if ATOMIC:
        lo_n = tl.program_id(1) * CHUNK_N
        hi_n = tl.minimum(lo_n + CHUNK_N, N)
    last = tl.zeros([BLOCK_N], dtype=tl.int32)
    first = tl.full([BLOCK_N], 2147483647, dtype=tl.int32)
    offs_r = tl.arange(0, BLOCK_R)
    offs_n = tl.arange(0, BLOCK_N)
    for r0 in range(0, ROWS, BLOCK_R):
        r = r0 + offs_r
        r_ok = r < ROWS
        row_base = b * stride_mb + (r // L).to(tl.int64) * stride_mh + (r % L).to(tl.int64) * stride_ml
        for n0 in range(lo_n, hi_n, BLOCK_N):
            n = n0 + offs_n
            ok = r_ok[:, None] & (n < hi_n)[None, :]
            ptrs = mask_ptr + row_base[:, None] + n.to(tl.int64)[None, :] * stride_mn
            if IS_BOOL:
                seen = tl.load(ptrs, mask=ok, other=0) != 0
            else:
                seen = tl.load(ptrs, mask=ok, other=float("-inf")).to(tl.float32) != float("-inf")
            if FIRST or RANGE:
                first = tl.minimum(first, tl.min(tl.where(seen, n[None, :], 2147483647), axis=0))
            if not FIRST or RANGE:
                last = tl.maximum(last, tl.max(tl.where(seen, n[None, :] + 1, 0), axis=0))
    if RANGE:
        lo = tl.min(first, axis=0)
        hi = tl.max(last, axis=0)
        if ATOMIC:
            tl.atomic_min(out_ptr + b, lo, sem="relaxed")
            tl.atomic_max(out_ptr + OUT_ROW + b, hi, sem="relaxed")
        else:
            tl.store(out_ptr + b, lo)
            tl.store(out_ptr + OUT_ROW + b, hi)
    elif FIRST:
        lo = tl.min(first, axis=0)
        if ATOMIC:
            tl.atomic_min(out_ptr + b, lo, sem="relaxed")  # INT32_MAX (none seen) turns into 0 afterwards
        else:
            tl.store(out_ptr + b, tl.where(lo == 2147483647, 0, lo))
    else:
        hi = tl.max(last, axis=0)
        if ATOMIC:
            tl.atomic_max(out_ptr + b, hi, sem="relaxed")
        else:
            tl.store(out_ptr + b, hi)


_VALID_LEN_LAUNCH = KernelLauncher(_valid_len_kernel)
_INT32_MAX = 2**31 - 1
#: Key columns per program where a mask row is longer than this (a power of two, a multiple of every BLOCK_N).
ATOMIC_CHUNK_N = 8192


def _kernel_view(attn_mask: torch.Tensor, batch: int):
    """(the mask as a rank-4 view (uint8 for bool), whether it is bool, its batch stride (0 when broadcast), rows per
    step, key columns per step), after checking that it broadcasts to (batch, H, L, N > 1)."""
    if attn_mask.dim() > 4 or attn_mask.dim() < 1:
        raise ValueError(f"valid_len_from_mask: a mask of rank {attn_mask.dim()} does not broadcast to (B, Hq, L, N)")
    m4 = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape)) if attn_mask.dim() < 4 else attn_mask
    bm, h, L, n = m4.shape
    if bm not in (1, batch):
        raise ValueError(f"valid_len_from_mask: the mask's batch dim {bm} is neither 1 nor {batch}")
    if n < 2:
        raise ValueError("valid_len_from_mask kernel: a mask broadcast along the keys goes to the reference")
    is_bool = attn_mask.dtype == torch.bool
    if is_bool:
        m4 = m4.view(torch.uint8)
    stride_b = m4.stride(0) if bm == batch and batch > 1 else 0
    block_n = min(4096, max(16, triton.next_power_of_2(n)))
    block_r = max(1, min(triton.next_power_of_2(h * L), 8192 // block_n))
    return m4, is_bool, stride_b, block_r, block_n


def valid_len_from_mask(attn_mask: torch.Tensor, batch: int, first: bool = False) -> torch.Tensor:
    """The kernel's ``valid_len_from_mask``: (batch,) int32, equal to ``reference.valid_len_from_mask``; with
    ``first``, ``reference.key_start_from_mask`` (see :func:`key_start_from_mask`).

    Parameters
    ----------
    attn_mask : bool or additive float mask of rank 1-4 whose shape broadcasts to (batch, Hq, L, N) with N > 1.
    batch : B.
    """
    m4, is_bool, stride_b, block_r, block_n = _kernel_view(attn_mask, batch)
    _, h, L, n = m4.shape
    rows = h * L
    chunks = triton.cdiv(n, ATOMIC_CHUNK_N)
    if chunks == 1:  # one program per batch row, one launch
        out = torch.empty((batch,), device=attn_mask.device, dtype=torch.int32)
        _VALID_LEN_LAUNCH((batch,), m4, out, stride_b, m4.stride(1), m4.stride(2), m4.stride(3), rows, L, n, n,
                          IS_BOOL=is_bool, BLOCK_R=block_r, BLOCK_N=block_n, FIRST=bool(first), ATOMIC=False,
                          num_warps=4)
        return out
    # Longer rows: a program per chunk of columns, folded with atomics into a filled output. One program per
    # batch row walks a 128k-key mask in 32 dependent steps; bench variants at c902706 measured a 4k-window site
    # over a 128k cache at 61.0 µs on the H100 where its 16.8 MB of window keys take about 6 µs to read, and its
    # two such scans (key start, valid length) are the likely rest (not profiled). Chunks take two steps each;
    # the fill, and for the first key the sentinel's fix-up, are one small launch each.
    out = torch.full((batch,), _INT32_MAX if first else 0, device=attn_mask.device, dtype=torch.int32)
    _VALID_LEN_LAUNCH((batch, chunks), m4, out, stride_b, m4.stride(1), m4.stride(2), m4.stride(3), rows, L, n,
                      ATOMIC_CHUNK_N, IS_BOOL=is_bool, BLOCK_R=block_r, BLOCK_N=block_n, FIRST=bool(first),
                      ATOMIC=True, num_warps=4)
    if first:
        out.remainder_(_INT32_MAX)  # no visible key: INT32_MAX -> 0, as the reference; positions are < N
    return out


def key_start_from_mask(attn_mask: torch.Tensor, batch: int) -> torch.Tensor:
    """The kernel's ``key_start_from_mask``: (batch,) int32, the first key any query row of a batch row may see
    (0 where none is), equal to ``reference.key_start_from_mask``; same arguments as :func:`valid_len_from_mask`."""
    return valid_len_from_mask(attn_mask, batch, first=True)


def key_range_from_mask(attn_mask: torch.Tensor, batch: int) -> torch.Tensor:
    """The kernel's ``key_range_from_mask``: (2, batch) int32, equal to ``reference.key_range_from_mask``: row 0 the
    first key any query row of a batch row may see (INT32_MAX where none is), row 1 one past the last (0 where none
    is), from one scan of the mask: one launch, and where rows are longer than ``ATOMIC_CHUNK_N`` the two rows' fills
    before it (a window site took a scan for each end, with its fill and the key start's fix-up: five launches);
    same arguments as :func:`valid_len_from_mask`."""
    m4, is_bool, stride_b, block_r, block_n = _kernel_view(attn_mask, batch)
    rows, L, n = m4.shape[1] * m4.shape[2], m4.shape[2], m4.shape[3]
    chunks = triton.cdiv(n, ATOMIC_CHUNK_N)
    out = torch.empty((2, batch), device=attn_mask.device, dtype=torch.int32)
    if chunks > 1:  # the atomics' neutral values (no visible key: an empty range)
        out[0].fill_(_INT32_MAX)
        out[1].zero_()
    _VALID_LEN_LAUNCH((batch, chunks), m4, out, stride_b, m4.stride(1), m4.stride(2), m4.stride(3), rows, L, n,
                      ATOMIC_CHUNK_N if chunks > 1 else n, IS_BOOL=is_bool, BLOCK_R=block_r, BLOCK_N=block_n,
                      FIRST=False, ATOMIC=chunks > 1, RANGE=True, OUT_ROW=batch, num_warps=4)
    return out
