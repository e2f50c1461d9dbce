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
    part_ptr,  # ARRIVE: (B, CHUNKS, 2) int32 per-chunk (first, end) partials; else unused
    counter_ptr,  # ARRIVE: (>= B,) int32 arrival counters, zero before and after every launch; else unused
    stride_mb, stride_mh, stride_ml, stride_mn,  # mask strides (the batch stride 0 when the mask has one row)
    ROWS,  # H * L mask rows per batch row
    L,  # query rows per head in the mask view
    N,  # key columns
    CHUNK_N,  # ATOMIC / ARRIVE: key columns per program (a multiple of BLOCK_N); else N
    CHUNKS,  # ARRIVE: programs per batch row (axis 1)
    IS_BOOL: tl.constexpr,  # bool mask (True = visible); else additive (visible where > -inf)
    BLOCK_R: tl.constexpr,  # mask rows per step
    BLOCK_N: tl.constexpr,  # key columns per step
    FIRST: tl.constexpr = False,  # store the first visible key instead of one past the last
    ATOMIC: tl.constexpr = False,  # programs over column chunks (axis 1) fold into out with atomic max / min
    RANGE: tl.constexpr = False,  # store both: the first visible key (INT32_MAX where none is) at out[b], one past
    # the last at out[OUT_ROW + b]
    OUT_ROW=0,  # RANGE: the offset of the ends' row in out (B)
    ARRIVE: tl.constexpr = False,  # programs over column chunks store partials; the last to arrive at its batch row
    # (arrival counter) folds them and stores the result: no fill before the launch
    CHUNKS_P2: tl.constexpr = 1,  # ARRIVE: next power of two >= CHUNKS
):
    b = tl.program_id(0).to(tl.int64)
    lo_n = 0
    hi_n = N
    if ATOMIC or ARRIVE:
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
            if FIRST or RANGE or ARRIVE:
                first = tl.minimum(first, tl.min(tl.where(seen, n[None, :], 2147483647), axis=0))
            if not FIRST or RANGE or ARRIVE:
                last = tl.maximum(last, tl.max(tl.where(seen, n[None, :] + 1, 0), axis=0))
    lo = tl.min(first, axis=0)
    hi = tl.max(last, axis=0)
    if ARRIVE:
        part = part_ptr + (b * CHUNKS + tl.program_id(1)) * 2
        tl.store(part, lo)
        tl.store(part + 1, hi)
        tl.debug_barrier()  # the partials are stored before the release below
        arrived = tl.atomic_add(counter_ptr + b, 1, sem="acq_rel", scope="gpu")
        if arrived == CHUNKS - 1:  # the last program of this batch row folds every chunk's partial
            tl.debug_barrier()
            offs_c = tl.arange(0, CHUNKS_P2)
            c_ok = offs_c < CHUNKS
            parts = part_ptr + (b * CHUNKS + offs_c) * 2
            lo = tl.min(tl.load(parts, mask=c_ok, other=2147483647, cache_modifier=".cg"), axis=0)
            hi = tl.max(tl.load(parts + 1, mask=c_ok, other=0, cache_modifier=".cg"), axis=0)
            _store_ends(out_ptr, b, lo, hi, OUT_ROW, FIRST, RANGE)
            tl.atomic_xchg(counter_ptr + b, 0, sem="relaxed", scope="gpu")  # ready for the next launch
    elif ATOMIC:
        if RANGE:
            tl.atomic_min(out_ptr + b, lo, sem="relaxed")
            tl.atomic_max(out_ptr + OUT_ROW + b, hi, sem="relaxed")
        elif FIRST:
            tl.atomic_min(out_ptr + b, lo, sem="relaxed")  # INT32_MAX (none seen) turns into 0 afterwards
        else:
            tl.atomic_max(out_ptr + b, hi, sem="relaxed")
    else:
        _store_ends(out_ptr, b, lo, hi, OUT_ROW, FIRST, RANGE)


@triton.jit
def _store_ends(out_ptr, b, lo, hi, OUT_ROW, FIRST: tl.constexpr, RANGE: tl.constexpr):
    """Store a batch row's result: RANGE both ends (the first key INT32_MAX where none is visible), FIRST the first
    visible key (0 where none is), else one past the last."""
    if RANGE:
        tl.store(out_ptr + b, lo)
        tl.store(out_ptr + OUT_ROW + b, hi)
    elif FIRST:
        tl.store(out_ptr + b, tl.where(lo == 2147483647, 0, lo))
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
    return _scan(attn_mask, batch, "first" if first else "last")


def key_start_from_mask(attn_mask: torch.Tensor, batch: int) -> torch.Tensor:
    """The kernel's ``key_start_from_mask``: (batch,) int32, the first key any query row of a batch row may see
    (0 where none is), equal to ``reference.key_start_from_mask``; same arguments as :func:`valid_len_from_mask`."""
    return _scan(attn_mask, batch, "first")


def key_range_from_mask(attn_mask: torch.Tensor, batch: int) -> torch.Tensor:
    """The kernel's ``key_range_from_mask``: (2, batch) int32, equal to ``reference.key_range_from_mask``: row 0 the
    first key any query row of a batch row may see (INT32_MAX where none is), row 1 one past the last (0 where none
    is), from one scan of the mask in one launch (a window site took a scan for each end, with their fills and the
    key start's fix-up: five launches); same arguments as :func:`valid_len_from_mask`."""
    return _scan(attn_mask, batch, "range")


#: Zeroed arrival counters per device (every launch leaves them zero), grown as batches grow. Buffers are never
#: freed: a captured CUDA graph keeps the address it was captured with. Scans on one stream (a decode step's) run
#: one after another; two scans on concurrent streams of one device would share the counters (not supported).
_COUNTERS: dict[str, torch.Tensor] = {}
_KEPT: list[torch.Tensor] = []


def arrival_counters(device: torch.device, batch: int) -> torch.Tensor | None:
    """At least ``batch`` zeroed int32 arrival counters on ``device``, or None where they would have to be made while
    a CUDA graph is being captured (then the scan takes the filled, atomic path)."""
    key = str(device)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < batch:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        buf = torch.zeros((max(64, batch),), device=device, dtype=torch.int32)
        _COUNTERS[key] = buf
        _KEPT.append(buf)
    return buf


def _scan(attn_mask: torch.Tensor, batch: int, mode: str) -> torch.Tensor:
    """One scan of the mask: ``mode`` "last" (valid lengths), "first" (key starts) or "range" (both, (2, B)).

    Rows up to ``ATOMIC_CHUNK_N`` keys: one program per batch row. Longer rows: a program per chunk of columns (one
    program per batch row walked a 128k-key mask in 32 dependent steps; bench variants at c902706 measured a
    4k-window site over a 128k cache at 61.0 µs on the H100, where its 16.8 MB of window keys take about 6 µs to
    read, its two such scans the likely rest, not profiled). The chunks store partials and the last program to
    arrive at a batch row folds them (``arrival_counters``): one launch. Where no counters can be had (first use
    inside a graph capture) they fold with atomics into an output filled first (a fill per row of it, and for the
    first key a fix-up of the no-key sentinel)."""
    m4, is_bool, stride_b, block_r, block_n = _kernel_view(attn_mask, batch)
    _, h, L, n = m4.shape
    rows = h * L
    device = attn_mask.device
    shape = (2, batch) if mode == "range" else (batch,)
    flags = dict(IS_BOOL=is_bool, BLOCK_R=block_r, BLOCK_N=block_n, FIRST=mode == "first", RANGE=mode == "range",
                 num_warps=4)
    strides = (stride_b, m4.stride(1), m4.stride(2), m4.stride(3))
    chunks = triton.cdiv(n, ATOMIC_CHUNK_N)
    out = torch.empty(shape, device=device, dtype=torch.int32)
    if chunks == 1:
        _VALID_LEN_LAUNCH((batch,), m4, out, out, out, *strides, rows, L, n, n, 1, OUT_ROW=batch, **flags)
        return out
    counters = arrival_counters(device, batch)
    if counters is not None:
        parts = torch.empty((batch, chunks, 2), device=device, dtype=torch.int32)
        _VALID_LEN_LAUNCH((batch, chunks), m4, out, parts, counters, *strides, rows, L, n, ATOMIC_CHUNK_N, chunks,
                          OUT_ROW=batch, ARRIVE=True, CHUNKS_P2=triton.next_power_of_2(chunks), **flags)
        return out
    if mode == "range":
        out[0].fill_(_INT32_MAX)
        out[1].zero_()
    else:
        out.fill_(_INT32_MAX if mode == "first" else 0)
    _VALID_LEN_LAUNCH((batch, chunks), m4, out, out, out, *strides, rows, L, n, ATOMIC_CHUNK_N, chunks,
                      OUT_ROW=batch, ATOMIC=True, **flags)
    if mode == "first":
        out.remainder_(_INT32_MAX)  # no visible key: INT32_MAX -> 0, as the reference; positions are < N
    return out
