"""The SAAP attention launch's key loops: read K/V rows at gathered positions, fold them into a query tile's
online-softmax state, and walk the chosen clusters' keys in BLOCK_N-key tiles (``_cluster_tile``: a tile finds
its keys' clusters in the selection's compact work list, then their positions in the cluster-sorted ``perm``).
The kernel itself and its launcher are in ``saap``.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .common import _softmax_update


@triton.jit
def _load_kv(pos, key_ok, k_base, v_base, offs_d, offs_dv, stride_kn, stride_kd, stride_vn, stride_vd, D, DV):
    """The K (BLOCK_N, BLOCK_D) and V (BLOCK_N, BLOCK_DV) rows at positions ``pos`` (read where ``key_ok``)."""
    pos64 = pos.to(tl.int64)
    k = tl.load(k_base + pos64[:, None] * stride_kn + offs_d.to(tl.int64)[None, :] * stride_kd,
                mask=key_ok[:, None] & (offs_d[None, :] < D), other=0.0)
    v = tl.load(v_base + pos64[:, None] * stride_vn + offs_dv.to(tl.int64)[None, :] * stride_vd,
                mask=key_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
    return k, v


@triton.jit
def _fold_keys(q, acc, m_i, l_i, k, v, pos, key_ok, row_ok, row_pos, sm_scale, UPCAST: tl.constexpr,
               PRECISION: tl.constexpr, CAUSAL: tl.constexpr = True):
    """Fold loaded keys ``k``/``v`` at positions ``pos`` (BLOCK_N,) (real where ``key_ok``) into the tile's state;
    without CAUSAL every query row sees every real key (``pos`` is not read)."""
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * sm_scale
    visible = key_ok[None, :] & row_ok[:, None]
    if CAUSAL:
        visible = visible & (pos[None, :] <= row_pos[:, None])
    return _softmax_update(acc, m_i, l_i, s, visible, v, UPCAST, PRECISION)


@triton.jit
def _attend_keys(q, acc, m_i, l_i, pos, key_ok, k_base, v_base, row_ok, row_pos, offs_d, offs_dv,
                 stride_kn, stride_kd, stride_vn, stride_vd, sm_scale, D, DV, UPCAST: tl.constexpr,
                 PRECISION: tl.constexpr):
    """Fold the keys at positions ``pos`` (BLOCK_N,) (read where ``key_ok``) into the query tile's state."""
    k, v = _load_kv(pos, key_ok, k_base, v_base, offs_d, offs_dv, stride_kn, stride_kd, stride_vn, stride_vd, D, DV)
    return _fold_keys(q, acc, m_i, l_i, k, v, pos, key_ok, row_ok, row_pos, sm_scale, UPCAST, PRECISION)


@triton.jit
def _prefetch_l2(ptrs, ok):
    """Ask L2 for the lines at ``ptrs`` where ``ok``: a hint that nothing waits for (compiled code only: the
    interpreter runs no PTX)."""
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }", "=r,l,r",
        [ptrs, ok.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_perm(lo, hi, first, incl_base, shift_base, p_base, stride_pn, BLOCK_N: tl.constexpr,
                   BLOCK_C: tl.constexpr, LINES: tl.constexpr):
    """Ask L2 for the ``perm`` entries of the chosen clusters' keys [lo, hi) (virtual indices; key lo in list entry
    ``first``) that lie in the BLOCK_N list entries from ``first`` on: entry e holds the keys [incl_(e-1), incl_e), at
    perm index shift_e + key; up to LINES 128-byte lines of each."""
    entry = first + tl.arange(0, BLOCK_N)
    in_list = entry < BLOCK_C
    incl = tl.load(incl_base + entry, mask=in_list, other=2147483647)
    prev = tl.load(incl_base + entry - 1, mask=in_list & (entry > 0), other=0)
    shifts = tl.load(shift_base + entry, mask=in_list, other=0)
    hit = (prev < hi) & (incl > lo)
    start = shifts + tl.maximum(lo, prev)
    stop = shifts + tl.minimum(hi, incl)
    for j in tl.static_range(LINES):
        idx = start + 32 * j
        _prefetch_l2(p_base + idx.to(tl.int64) * stride_pn, hit & (idx < stop))


@triton.jit
def _prefetch_rows(pos, ok, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd, D, DV,
                   LINES: tl.constexpr, LINE_ELEMS: tl.constexpr):
    """Ask L2 for the K and V rows at positions ``pos`` (BLOCK_N,) where ``ok``: LINES lines of LINE_ELEMS elements
    (128 bytes) each, those that start inside the row."""
    line = tl.arange(0, LINES) * LINE_ELEMS
    pos64 = pos.to(tl.int64)[:, None]
    line64 = line.to(tl.int64)[None, :]
    _prefetch_l2(k_base + pos64 * stride_kn + line64 * stride_kd, ok[:, None] & (line < D)[None, :])
    _prefetch_l2(v_base + pos64 * stride_vn + line64 * stride_vd, ok[:, None] & (line < DV)[None, :])


@triton.jit
def _cluster_tile(start_u, hi, first, kv_len, incl_base, shift_base, p_base, stride_pn, BLOCK_N: tl.constexpr,
                  BLOCK_C: tl.constexpr, CLIP: tl.constexpr, NO_LOOKUP: tl.constexpr = False):
    """The key positions of the chosen clusters' keys [start_u, start_u + BLOCK_N) (virtual indices below ``hi``),
    whose first key lies in list entry ``first``. Returns (positions, real-key mask, the next tile's first entry).

    Two dependent loads: the BLOCK_N list entries from ``first`` on (their prefixes and shifts together: any BLOCK_N
    consecutive keys span at most BLOCK_N non-empty clusters), then ``perm``. Without CLIP every cluster key is
    known to lie below ``kv_len``: the mask is then the index range alone. NO_LOOKUP (an ablation of the piece
    microbenchmark, never a plan's: a wrong answer): scattered positions hashed from the keys' indices, no loads."""
    offs_n = tl.arange(0, BLOCK_N)
    u = start_u + offs_n
    u_ok = u < hi
    if NO_LOOKUP:
        pos = ((u.to(tl.int64) * 2654435761) % tl.maximum(kv_len, 1)).to(tl.int32)
        nxt = first
    else:
        entry = first + offs_n
        in_list = (entry < BLOCK_C) & (start_u < hi)
        window = tl.load(incl_base + entry, mask=in_list, other=2147483647)
        shifts = tl.load(shift_base + entry, mask=in_list, other=0)
        rel = tl.sum((window[None, :] <= u[:, None]).to(tl.int32), axis=1)  # each key's entry, counted from first
        shift = tl.sum(tl.where(rel[:, None] == offs_n[None, :], shifts[None, :], 0), axis=1)
        pos = tl.load(p_base + (shift + u).to(tl.int64) * stride_pn, mask=u_ok, other=0)
        nxt = first + tl.sum((window <= start_u + BLOCK_N).to(tl.int32), axis=0)
    if CLIP:  # a cluster key past the valid length (a shrunk cache) is never read
        u_ok = u_ok & (pos < kv_len)
    return pos, u_ok, nxt


@triton.jit
def _attend_clusters(q, acc, m_i, l_i, lo, hi, first, kv_len, incl_base, shift_base, p_base, stride_pn, k_base, v_base,
                     row_ok, row_pos, offs_d, offs_dv, stride_kn, stride_kd, stride_vn, stride_vd, sm_scale, D, DV,
                     BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                     CLIP: tl.constexpr, PREFETCH_LINES: tl.constexpr = 0, NO_LOOKUP: tl.constexpr = False,
                     KV_LINES: tl.constexpr = 0, KV_LINE_ELEMS: tl.constexpr = 64):
    """Fold the chosen clusters' keys [lo, hi) (virtual indices; key lo in list entry ``first``) into the state.

    Software-pipelined: each step issues its K/V loads, then the next tile's list and perm lookups, then the math,
    so the lookups' latency hides under the K/V reads instead of adding to them. Two tiles ahead took 145 registers a
    thread (3 programs an SM) and 23.9 µs a launch on the H100 (fd1e61d, llama3-8b 128k 5 %; 20.75 capped at 128
    registers) against 19.56. CLIP: some cluster key may lie at or past a query row (a valid length at or below the
    indexed end); without it the masks read no position, so the compiler does not load ``perm`` again in the math's
    layout. KV_LINES > 0 (compiled code only): the next tile's K/V rows are prefetched into L2 as soon as their
    positions are known, so that two tiles' reads are in flight without a second tile's registers."""
    first_entry = first
    pos, key_ok, first = _cluster_tile(lo, hi, first, kv_len, incl_base, shift_base, p_base, stride_pn, BLOCK_N,
                                       BLOCK_C, CLIP, NO_LOOKUP)
    if PREFETCH_LINES > 0:  # after the first tile's lookups, beside them: its own list reads are L2 hits
        _prefetch_perm(lo, hi, first_entry, incl_base, shift_base, p_base, stride_pn, BLOCK_N, BLOCK_C,
                       PREFETCH_LINES)
    for start_u in range(lo, hi, BLOCK_N):
        k, v = _load_kv(pos, key_ok, k_base, v_base, offs_d, offs_dv, stride_kn, stride_kd, stride_vn, stride_vd, D,
                        DV)
        pos_next, ok_next, first = _cluster_tile(start_u + BLOCK_N, hi, first, kv_len, incl_base, shift_base, p_base,
                                                 stride_pn, BLOCK_N, BLOCK_C, CLIP, NO_LOOKUP)
        if KV_LINES > 0:  # the next tile's rows start for L2 now, while this tile's are folded: two tiles in flight
            _prefetch_rows(pos_next, ok_next, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd, D, DV,
                           KV_LINES, KV_LINE_ELEMS)
        acc, m_i, l_i = _fold_keys(q, acc, m_i, l_i, k, v, pos, key_ok, row_ok, row_pos, sm_scale, UPCAST, PRECISION,
                                   CLIP)
        pos = pos_next
        key_ok = ok_next
    return acc, m_i, l_i
