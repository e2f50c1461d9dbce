"""The decode kernels' device-side ends of a tile: normalise its online-softmax state (``_finish``; ``_finish_parts``
keeps a partial's row max and ``log l`` apart for a later merge), merge split partials inside the launch
(``_merge_step``, ``_load_partials``, ``_arrive_and_merge``: the last program to arrive at a tile merges it), and
store finished rows and LSE planes (``_store_rows``, ``_store_lse``). Conventions as in ``common``.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .tile_ops import _per_key, _per_row


@triton.jit
def _merged_rows(mb, L, G, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr):
    """The real packed rows of M block ``mb`` for an in-kernel merge, BLOCK_R (>= the real rows) at a time:
    (r (row within the block), g, i, row valid)."""
    r = tl.arange(0, BLOCK_R)
    rows = mb * BLOCK_M + r
    return r, rows // L, rows % L, (r < BLOCK_M) & (rows < G * L)


@triton.jit
def _merged_row_offsets(mb, b, kvh, L, G, stride_ob, stride_oh, stride_ol, stride_lb, stride_lh, stride_ll,
                        BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr):
    """:func:`_merged_rows` of M block ``mb`` of (batch row ``b``, KV head ``kvh``) with each row's offset into the
    (S, B, Hq, L, Dv) partial outputs and the (S, B, Hq, L) partial LSE planes: (g, i, row valid, output row, LSE
    row)."""
    r, gc, ic, ok_c = _merged_rows(mb, L, G, BLOCK_M, BLOCK_R)
    hc = kvh * G + gc
    o_row = b * stride_ob + hc * stride_oh + ic * stride_ol
    return gc, ic, ok_c, o_row, b * stride_lb + hc * stride_lh + ic * stride_ll


@triton.jit
def _merge_step(mm, den, acc, pl, po, pll):
    """Fold MERGE_P partial states into a running merge: ``pl`` (MERGE_P, R) natural-log row maxima (-inf: empty or
    padding), ``pll`` (MERGE_P, R) their natural ``log l`` (lse = pl + pll; pass 0 when ``pl`` holds whole LSEs),
    ``po`` (MERGE_P, R, BLOCK_DV) normalised outputs; (mm, den, acc) as in :func:`_attend`'s state.

    The maximum and ``log l`` stay apart because next to a maximum near -3.4e38 (a row that ``finfo.min`` hides,
    whose keys tie) ``pl + pll`` would round to ``pl``: the partials would then weigh the same instead of by their
    key counts, and the merge would not give the original's mean of V."""
    m_new = tl.maximum(mm, tl.max(pl, axis=0))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2((mm - m_use) * 1.4426950408889634)
    w = tl.exp2(((pl - m_use[None, :]) + pll) * 1.4426950408889634)  # 0 for empty partials and padding
    den = den * alpha + tl.sum(w, axis=0)
    acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * po, axis=0)
    return m_new, den, acc


@triton.jit
def _load_partials(o_ptr, lse_ptr, sp, NUM_PARTS, o_row, l_row, ok_c, offs_dv, stride_os, stride_od, stride_ls,
                   stride_lpart, DV):
    """Partials ``sp`` (MERGE_P,) of a merge, read past L1 (other programs of this launch wrote them): row maxima and
    log l (MERGE_P, BLOCK_R), -inf where absent, and outputs (MERGE_P, BLOCK_R, BLOCK_DV)."""
    ok = (sp < NUM_PARTS)[:, None] & ok_c[None, :]
    pl = tl.load(lse_ptr + sp[:, None] * stride_ls + l_row[None, :], mask=ok, other=float("-inf"), cache_modifier=".cg")
    pll = tl.load(lse_ptr + stride_lpart + sp[:, None] * stride_ls + l_row[None, :], mask=ok, other=float("-inf"),
                  cache_modifier=".cg")
    po = tl.load(o_ptr + sp[:, None, None] * stride_os + o_row[None, :, None] + offs_dv[None, None, :] * stride_od,
                 mask=ok[:, :, None] & (offs_dv[None, None, :] < DV), other=0.0, cache_modifier=".cg")
    return pl, pll, po


@triton.jit
def _arrive_and_merge(counter_ptr, tile, arrivals, o_ptr, lse_ptr, out_ptr, lse_out_ptr, mb, b, kvh, offs_dv,
                      stride_os, stride_ob, stride_oh, stride_ol, stride_od, stride_ls, stride_lb, stride_lh,
                      stride_ll, stride_lpart, stride_fb, stride_fh, stride_fl, stride_fd, stride_gb, stride_gh,
                      stride_gl, NUM_PARTS, L, G, DV, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                      MERGE_P: tl.constexpr, WRITE_LSE_OUT: tl.constexpr):
    """The in-launch merge of a split decode: count this program's arrival at output ``tile`` (its partial is stored);
    the ``arrivals``-th program to arrive merges the tile's NUM_PARTS partials, (S, B, Hq, L, Dv) outputs at ``o_ptr``
    and (row max, log l) planes at ``lse_ptr`` / ``lse_ptr + stride_lpart`` (int32 offsets: the workspace is small),
    over the tile's real rows, into the final (B, Hq, L, Dv) ``out_ptr`` and (B, Hq, L) ``lse_out_ptr``, then resets
    the counter (zero before and after every launch)."""
    tl.debug_barrier()  # every thread's partial is stored before the release below
    arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
    if arrived == arrivals - 1:
        tl.debug_barrier()
        gc, ic, ok_c, o_row, l_row = _merged_row_offsets(mb, b, kvh, L, G, stride_ob, stride_oh, stride_ol, stride_lb,
                                                         stride_lh, stride_ll, BLOCK_M, BLOCK_R)
        offs_p = tl.arange(0, MERGE_P)
        # The common maximum first (the row-max plane only: MERGE_P partials a load, all loads independent), so that
        # each step's weights need nothing from the step before; the steps then run software-pipelined, the next
        # step's partials loaded before this step's sums, and the tail costs about one L2 round trip, not one a step.
        mm = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
        for s0 in range(0, NUM_PARTS, MERGE_P):
            sp = s0 + offs_p
            pl = tl.load(lse_ptr + sp[:, None] * stride_ls + l_row[None, :],
                         mask=(sp < NUM_PARTS)[:, None] & ok_c[None, :], other=float("-inf"), cache_modifier=".cg")
            mm = tl.maximum(mm, tl.max(pl, axis=0))
        m_use = tl.where(mm == float("-inf"), 0.0, mm)  # rows empty in every partial: weights 0, no NaN
        den = tl.zeros([BLOCK_R], dtype=tl.float32)
        acc = tl.zeros([BLOCK_R, offs_dv.shape[0]], dtype=tl.float32)
        pl, pll, po = _load_partials(o_ptr, lse_ptr, offs_p, NUM_PARTS, o_row, l_row, ok_c, offs_dv, stride_os,
                                     stride_od, stride_ls, stride_lpart, DV)
        for s0 in range(0, NUM_PARTS, MERGE_P):
            pl_next, pll_next, po_next = _load_partials(o_ptr, lse_ptr, s0 + MERGE_P + offs_p, NUM_PARTS, o_row, l_row,
                                                        ok_c, offs_dv, stride_os, stride_od, stride_ls, stride_lpart,
                                                        DV)
            w = tl.exp2(((pl - m_use[None, :]) + pll) * 1.4426950408889634)  # 0 for empty partials and padding
            den += tl.sum(w, axis=0)
            acc += tl.sum(w[:, :, None] * po, axis=0)
            pl, pll, po = pl_next, pll_next, po_next
        o2, lse2 = _finish(acc, mm, den)
        _store_rows(o2, lse2, out_ptr, lse_out_ptr, b, kvh, gc, ic, ok_c, offs_dv, stride_fb, stride_fh, stride_fl,
                    stride_fd, stride_gb, stride_gh, stride_gl, G, DV, WRITE_LSE_OUT)
        tl.atomic_xchg(counter_ptr + tile, 0, sem="relaxed", scope="gpu")  # ready for the next launch


@triton.jit
def _finish(acc, m_i, l_i):
    """Normalise a state: (o (BLOCK_M, BLOCK_DV) fp32, lse (BLOCK_M,) natural log); empty rows -> (0, -inf)."""
    empty = l_i == 0.0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
    return o, lse


@triton.jit
def _finish_parts(acc, m_i, l_i, T: tl.constexpr = False):
    """A partial state for a later merge: (o (BLOCK_M, BLOCK_DV) fp32, m, log l (BLOCK_M,) natural log); empty
    rows -> (0, -inf, -inf). See :func:`_merge_step` for why ``m`` and ``log l`` are kept apart. T: ``acc`` and
    ``o`` transposed, (BLOCK_DV, BLOCK_M) (swap-AB)."""
    empty = l_i == 0.0
    o = acc / _per_row(tl.where(empty, 1.0, l_i), T)
    m = tl.where(empty, float("-inf"), m_i)
    log_l = tl.where(empty, float("-inf"), tl.log(tl.where(empty, 1.0, l_i)))
    return o, m, log_l


@triton.jit
def _store_rows(o, lse, o_ptr, lse_ptr, b, kvh, g, i, row_ok, offs_dv,
                stride_ob, stride_oh, stride_ol, stride_od, stride_lb, stride_lh, stride_ll, G, DV,
                WRITE_LSE: tl.constexpr, T: tl.constexpr = False):
    """Store a finished tile into a (B, Hq, L, Dv) output (any strides, any float dtype) and (B, Hq, L) lse; T: ``o``
    transposed, (BLOCK_DV, BLOCK_M) (swap-AB)."""
    h64 = (kvh * G + g).to(tl.int64)
    i64 = i.to(tl.int64)
    b64 = b.to(tl.int64)
    ptrs = (o_ptr + b64 * stride_ob + _per_row(h64, T) * stride_oh + _per_row(i64, T) * stride_ol
            + _per_key(offs_dv.to(tl.int64), T) * stride_od)
    tl.store(ptrs, o.to(o_ptr.dtype.element_ty), mask=_per_row(row_ok, T) & _per_key(offs_dv < DV, T))
    if WRITE_LSE:
        tl.store(lse_ptr + b64 * stride_lb + h64 * stride_lh + i64 * stride_ll, lse, mask=row_ok)


@triton.jit
def _store_lse(lse, lse_ptr, b, kvh, g, i, row_ok, stride_lb, stride_lh, stride_ll, G):
    """Store a (BLOCK_M,) per-row value (an LSE, or the log l plane of a split state) into a (B, Hq, L) plane."""
    h64 = (kvh * G + g).to(tl.int64)
    tl.store(lse_ptr + b.to(tl.int64) * stride_lb + h64 * stride_lh + i.to(tl.int64) * stride_ll, lse, mask=row_ok)
