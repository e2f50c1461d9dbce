"""Stream-K decode (LeanAttention) in one launch.

The iteration space (batch row x KV head x M block x KV tile) is unrolled, batch-major, and cut into equal
contiguous shares, one per program of a persistent grid. A program walks its share tile segment by tile
segment. A segment that covers a whole output tile is written out directly. A partial segment goes to the
program's workspace slot (slot 0: the segment that starts the program's share; slot 1: the one that ends it),
then the program increments the tile's arrival counter; the program that arrives last merges every partial
of the tile and resets the counter to zero, so the next launch (or CUDA-graph replay) starts clean. No
program ever waits on another, so the kernel cannot deadlock under any scheduling (nor in the interpreter,
which runs programs one after the other).

The number of KV tiles per batch row follows the valid length read on device, so the shares stay balanced
as the cache grows while the grid stays fixed.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import interpreting
from .attend import _attend_chunks, _load_q, _row_coords
from .common import arrival_counters, backend_has_option, decode_geometry, decode_inputs, dot_flags, head_dim_split, \
    next_pow2, pdl_supported, softmax_scale, tail_in_loop
from .launch import KernelLauncher
from .partials import _finish, _finish_parts, _merged_rows, _store_lse, _store_rows
from .stream_k_merge import _iteration_space, _merge_tile, stream_k_merge

try:  # grid dependency control (programmatic dependent launch); absent from older Tritons
    from triton.language.extra.cuda import gdc_launch_dependents
except ImportError:  # pragma: no cover - then pdl_supported() is False and the branch is never compiled
    gdc_launch_dependents = None


@triton.jit
def _stream_k_kernel(
    q_ptr, k_ptr, v_ptr,  # Q (B, Hq, L, D); K (B, Hkv, N, D); V (B, Hkv, N, Dv): any strides
    k_desc, v_desc,  # USE_TMA: tensor descriptors of K and V (block (1, 1, BLOCK_N, BLOCK_D or D_LO)); else K/V again
    k_hi_desc, v_hi_desc,  # USE_TMA and D_LO > 0: descriptors of K[..., D_LO:] and V[..., D_LO:] (block (1, 1,
    # BLOCK_N, D_HI)); else K/V again
    mask_ptr,  # mask broadcast to (B, Hq, L, N) (uint8 for bool, float for additive), or a dummy
    valid_ptr,  # (B,) int32/int64 valid lengths, or a dummy when HAS_VALID is False
    start_ptr,  # (B,) int32/int64 first keys (a sliding window's start), or a dummy when HAS_START is False
    alibi_ptr,  # (Hq,) float ALiBi slopes (scores + slope[h] * key position), or a dummy when ALIBI is False
    o_ptr,  # (B, Hq, L, Dv) output, any float dtype
    lse_ptr,  # (B, Hq, L) fp32 LSE output (written when WRITE_LSE); LSE_PLANES: its row max plane
    ws_o_ptr,  # (GRID * 2, BLOCK_M, Dv) fp32 partial outputs, two slots per program
    ws_lse_ptr,  # (2, GRID * 2, BLOCK_M) fp32 partial row maxima (plane 0) and log l (plane 1), natural log
    counter_ptr,  # (B * HKV * NUM_M,) int32 arrival counters, zero before and after every launch
    stride_qb, stride_qh, stride_ql, stride_qd,  # Q strides
    stride_kb, stride_kh, stride_kn, stride_kd,  # K strides
    stride_vb, stride_vh, stride_vn, stride_vd,  # V strides
    stride_mb, stride_mh, stride_ml, stride_mn,  # mask strides (0 on broadcast dims)
    stride_ob, stride_oh, stride_ol, stride_od,  # output strides
    stride_lb, stride_lh, stride_ll,  # LSE output strides
    stride_lplane,  # LSE_PLANES: from the output's row max plane to its log l plane
    stride_ws, stride_wm, stride_wd,  # workspace o strides (slot, row, dim)
    stride_wls, stride_wlm,  # workspace lse strides (slot, row)
    stride_wlpart,  # stride between the row-max and log-l planes of the workspace lse
    sm_scale,  # softmax scale (natural units)
    softcap,  # SOFTCAP: the cap (scores are softcap * tanh(qk * sm_scale))
    B,  # batch rows
    N,  # keys in the K/V tensors (the static cache length)
    L,  # query tokens per head (q_len)
    G,  # query heads per KV head
    HKV,  # KV heads
    NUM_M,  # M blocks per KV head: cdiv(G * L, BLOCK_M)
    D: tl.constexpr,  # head dim of Q/K (constexpr: masks on it keep loads vectorised)
    DV: tl.constexpr,  # head dim of V
    GRID,  # number of programs launched
    BLOCK_B: tl.constexpr,  # next power of two >= B (per-row lengths are held in one vector)
    BLOCK_M: tl.constexpr,  # packed query rows per tile (power of two >= 16)
    BLOCK_N: tl.constexpr,  # keys per KV tile (one stream-K iteration)
    BLOCK_D: tl.constexpr,  # padded D
    BLOCK_DV: tl.constexpr,  # padded Dv
    HAS_VALID: tl.constexpr,  # whether valid_ptr holds per-row valid lengths
    MASK_KIND: tl.constexpr,  # 0 none, 1 boolean, 2 additive
    IS_CAUSAL: tl.constexpr,  # top-left causal: query i sees keys j <= i
    WRITE_LSE: tl.constexpr,  # whether to store the LSE
    UPCAST: tl.constexpr,  # compute dots in fp32 (interpreter)
    PRECISION: tl.constexpr,  # tl.dot input precision
    BLOCK_R: tl.constexpr,  # rows merged per tile (next power of two >= min(G * L, BLOCK_M)): the real ones
    MERGE_P: tl.constexpr,  # partials the merging program loads per step
    USE_TMA: tl.constexpr,  # K/V tiles through the copy engine (tensor descriptors)
    LSE_PLANES: tl.constexpr,  # write the final row max and log l apart (natural log), for a later merge
    HAS_START: tl.constexpr = False,  # whether start_ptr holds per-row first keys (keys before do not exist)
    SOFTCAP: tl.constexpr = False,  # logit softcapping of the scaled scores
    ALIBI: tl.constexpr = False,  # ALiBi: a per-head slope times the key position added to the scores
    D_LO: tl.constexpr = 0,  # > 0: the head dims (D == DV) run in two power-of-two chunks, [0, D_LO) and D_HI
    D_HI: tl.constexpr = 0,  # columns from D_LO, those past D masked (common.head_dim_split)
    PAST_ZERO: tl.constexpr = False,  # USE_TMA and the keys are the tensors' own N (no valid length, no causal cut):
    # the copy engine zero-fills past them, so the tile crossing N runs in the pipelined loop (attend._attend_chunks)
    SEPARATE_MERGE: tl.constexpr = False,  # partials stay in the slots for ``stream_k_merge`` (a second launch)
    LAUNCH_DEPENDENTS: tl.constexpr = False,  # SEPARATE_MERGE: let the merge launch (PDL) right away
):
    if LAUNCH_DEPENDENTS:
        # SEPARATE_MERGE: the merge launch's programs may become resident now; they wait (griddepcontrol.wait) for
        # this grid to finish and its writes to be visible before they read a partial
        gdc_launch_dependents()
    pid = tl.program_id(0)
    # ---- the iteration space, from the valid lengths on device
    tiles_per_b = HKV * NUM_M
    offs_b, lens, starts, nblk, excl, incl, total, share = _iteration_space(
        valid_ptr, start_ptr, B, N, L, tiles_per_b, GRID, BLOCK_B, BLOCK_N, HAS_VALID, IS_CAUSAL, HAS_START)
    range_start = pid * share
    it = range_start
    it_end = tl.minimum(range_start + share, total)

    offs_dv = tl.arange(0, BLOCK_DV)  # the padded columns of V (the merge's)
    if D_LO > 0:  # two chunks of the head dim: [0, D_LO) in q / acc, [D_LO, D_LO + D_HI) in q_hi / acc_hi
        offs_d = tl.arange(0, D_LO)
        offs_o = offs_d
        offs_hi = D_LO + tl.arange(0, D_HI)
    else:  # one chunk padded to a power of two; the hi state is a stand-in, never read
        offs_d = tl.arange(0, BLOCK_D)
        offs_o = offs_dv
        offs_hi = offs_d
    offs_m = tl.arange(0, BLOCK_M)
    # Tiles this program arrived at last (at most two: the partial that starts its share and the one that ends
    # it). They are merged after the loop, so the merge's registers do not weigh on the KV loop.
    merge_a = pid * 0 - 1
    merge_b = pid * 0 - 1
    while it < it_end:
        # ---- locate the segment: batch row, output tile, first and last KV tile
        b = tl.sum((incl <= it).to(tl.int32), axis=0)
        sel = offs_b == b
        base = tl.sum(tl.where(sel, excl, 0), axis=0)
        nb = tl.sum(tl.where(sel, nblk, 0), axis=0)
        kv_len = tl.sum(tl.where(sel, lens, 0), axis=0)
        start = tl.sum(tl.where(sel, starts, 0), axis=0)
        first = start // BLOCK_N * BLOCK_N
        t_in_b = (it - base) // nb
        blk0 = (it - base) - t_in_b * nb
        blk1 = tl.minimum(nb, blk0 + (it_end - it))
        kvh = t_in_b // NUM_M
        mb = t_in_b - kvh * NUM_M
        tile = b * tiles_per_b + t_in_b

        rows, g, i, row_ok = _row_coords(mb, L, G, BLOCK_M)
        q = _load_q(q_ptr, b, kvh, g, i, row_ok, offs_d, stride_qb, stride_qh, stride_ql, stride_qd, G, D, UPCAST)
        if D_LO > 0:
            q_hi = _load_q(q_ptr, b, kvh, g, i, row_ok, offs_hi, stride_qb, stride_qh, stride_ql, stride_qd, G, D,
                           UPCAST)
            acc = tl.zeros([BLOCK_M, D_LO], dtype=tl.float32)
            acc_hi = tl.zeros([BLOCK_M, D_HI], dtype=tl.float32)
        else:
            q_hi = q
            acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
            acc_hi = acc
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc, acc_hi, m_i, l_i = _attend_chunks(
            q, q_hi, acc, acc_hi, m_i, l_i, first + blk0 * BLOCK_N, first + blk1 * BLOCK_N, kv_len, k_ptr, v_ptr,
            k_desc, v_desc, k_hi_desc, v_hi_desc, mask_ptr, b, kvh, g, i, row_ok, offs_d, offs_o, offs_hi,
            stride_kb, stride_kh, stride_kn, stride_kd, stride_vb, stride_vh, stride_vn, stride_vd, stride_mb,
            stride_mh, stride_ml, stride_mn, sm_scale, G, D, DV, BLOCK_N, MASK_KIND, IS_CAUSAL, UPCAST, PRECISION,
            USE_TMA, start, softcap, HAS_START, SOFTCAP, alibi_ptr, ALIBI, D_LO, PAST_ZERO)
        o_hi, _, _ = _finish_parts(acc_hi, m_i, l_i)  # the second chunk's columns (D_LO > 0)
        o, m_part, log_l = _finish_parts(acc, m_i, l_i)
        if (blk0 == 0) & (blk1 == nb):
            # the whole tile is ours: write it out
            lse = m_part if LSE_PLANES else m_part + log_l
            _store_rows(o, lse, o_ptr, lse_ptr, b, kvh, g, i, row_ok, offs_o, stride_ob, stride_oh, stride_ol,
                        stride_od, stride_lb, stride_lh, stride_ll, G, DV, WRITE_LSE)
            if D_LO > 0:
                _store_rows(o_hi, lse, o_ptr, lse_ptr, b, kvh, g, i, row_ok, offs_hi, stride_ob, stride_oh,
                            stride_ol, stride_od, stride_lb, stride_lh, stride_ll, G, DV, False)
            if LSE_PLANES:
                _store_lse(log_l, lse_ptr + stride_lplane, b, kvh, g, i, row_ok, stride_lb, stride_lh, stride_ll, G)
        else:
            # a partial: park it in our slot, then count our arrival at the tile
            # (the workspace is small: int32 offsets keep the register count down)
            slot = pid * 2 + (it != range_start).to(tl.int32)
            tl.store(ws_o_ptr + slot * stride_ws + offs_m[:, None] * stride_wm + offs_o[None, :] * stride_wd, o,
                     mask=row_ok[:, None] & (offs_o[None, :] < DV))
            if D_LO > 0:
                tl.store(ws_o_ptr + slot * stride_ws + offs_m[:, None] * stride_wm + offs_hi[None, :] * stride_wd,
                         o_hi, mask=row_ok[:, None] & (offs_hi[None, :] < DV))
            # m and log l kept apart for the merge (see _merge_step)
            tl.store(ws_lse_ptr + slot * stride_wls + offs_m * stride_wlm, m_part, mask=row_ok)
            tl.store(ws_lse_ptr + stride_wlpart + slot * stride_wls + offs_m * stride_wlm, log_l, mask=row_ok)
            if not SEPARATE_MERGE:  # else the merge launch finds the partials in the slots
                tl.debug_barrier()  # every thread's partial is stored before the release below
                arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
                ts = base + t_in_b * nb  # first iteration of the tile
                first_p = ts // share
                last_p = (ts + nb - 1) // share
                if arrived == last_p - first_p:
                    if it == range_start:
                        merge_a = tile
                    else:
                        merge_b = tile
        it = it + (blk1 - blk0)

    # ---- merge the tiles we arrived at last: every contributor's partial, ours included
    tl.debug_barrier()
    for j in range(0, 2):
        tile = tl.where(j == 0, merge_a, merge_b)
        if tile >= 0:
            b = tile // tiles_per_b
            t_in_b = tile - b * tiles_per_b
            sel = offs_b == b
            nb = tl.sum(tl.where(sel, nblk, 0), axis=0)
            ts = tl.sum(tl.where(sel, excl, 0), axis=0) + t_in_b * nb  # first iteration of the tile
            first_p = ts // share
            last_p = (ts + nb - 1) // share
            kvh = t_in_b // NUM_M
            mb = t_in_b - kvh * NUM_M
            # Only the tile's real rows, many partials per step: over all BLOCK_M rows (16 for G = 4) and 4 partials
            # per step, stream-K took 7 to 21 µs longer than split-KV with as many programs, the excess growing
            # with the partials per tile (2 to 16; 40.6 against 19.1 µs at 32/8 heads, 8k, H100)
            r, g, i, row_ok = _merged_rows(mb, L, G, BLOCK_M, BLOCK_R)
            mm, den, acc2 = _merge_tile(ws_o_ptr, ws_lse_ptr, first_p, last_p, share, ts, r, row_ok, offs_dv,
                                        stride_ws, stride_wm, stride_wd, stride_wls, stride_wlm, stride_wlpart, DV,
                                        BLOCK_R, MERGE_P)
            if LSE_PLANES:
                o2, lse2, log_l2 = _finish_parts(acc2, mm, den)
                _store_lse(log_l2, lse_ptr + stride_lplane, b, kvh, g, i, row_ok, stride_lb, stride_lh, stride_ll,
                           G)
            else:
                o2, lse2 = _finish(acc2, mm, den)
            _store_rows(o2, lse2, o_ptr, lse_ptr, b, kvh, g, i, row_ok, offs_dv, stride_ob, stride_oh,
                        stride_ol, stride_od, stride_lb, stride_lh, stride_ll, G, DV, WRITE_LSE)
            tl.atomic_xchg(counter_ptr + tile, 0, sem="relaxed", scope="gpu")  # ready for the next launch


_STREAM_K_LAUNCH = KernelLauncher(_stream_k_kernel)


def stream_k_workspace(grid: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """(ws_o (grid*2, BLOCK_M, Dv) fp32, ws_lse (2, grid*2, BLOCK_M) fp32 (row max, log l), counters
    (B*Hkv*num_m,) int32 zeros).

    The counters must start at zero; every launch leaves them at zero again.
    """
    geo = decode_geometry(q, k, v)
    return (torch.empty((grid * 2, geo.block_m, geo.Dv), device=q.device, dtype=torch.float32),
            torch.empty((2, grid * 2, geo.block_m), device=q.device, dtype=torch.float32),
            arrival_counters(geo, q.device))


def stream_k_decode(q, k, v, out, lse=None, *, workspace=None, attn_mask=None, valid_len=None, scale=None,
                    is_causal=False, grid=132, block_n=64, num_warps=4, num_stages=2, tma=False, key_start=None,
                    softcap=0.0, alibi_slopes=None, head_chunks=False, merge_launch=False, pdl=None):
    """Launch stream-K decode attention into ``out`` (and ``lse``), in one launch (two with ``merge_launch``).

    Parameters
    ----------
    q : (B, Hq, L, D) fp16/bf16/fp32; k : (B, Hkv, N, D); v : (B, Hkv, N, Dv), same dtype, any strides.
    out : (B, Hq, L, Dv) any float dtype, written in full.
    lse : (B, Hq, L) fp32 or None: the natural-log LSE of each row (-inf where no key is visible). A (2, B, Hq, L)
        fp32 tensor instead receives the row max (plane 0) and log l (plane 1) apart (see ``split_kv_decode``).
    workspace : the triple from ``stream_k_workspace(grid, q, k, v)`` (allocated here when None).
    attn_mask : bool (True = attend) or additive, broadcastable to (B, Hq, L, N); valid_len : (B,) int tensor.
    key_start : (B,) int tensor or None: keys before ``key_start[b]`` do not exist for row b (a sliding window);
        the iteration space covers only [key_start, valid_len) of each row, read on device.
    softcap : c != 0 caps the scaled scores to ``c * tanh(s)`` before the mask (Gemma 2); 0 = no cap.
    alibi_slopes : (Hq,) contiguous float tensor or None: ALiBi, scores + ``slope[h] * j`` for key position j
        (after the cap, before the mask).
    grid : programs in the persistent grid (more programs than iterations just leaves some idle).
    tma : read K/V tiles with the copy engine (Hopper tensor descriptors) when the strides allow it and the launch
        is being captured into a CUDA graph (``tma_now``, as for split-KV); pointer loads otherwise.
    head_chunks : as for ``split_kv_decode``: True cuts the head dim in two power-of-two chunks where
        ``common.head_dim_split`` does; False keeps one padded chunk.
    merge_launch : the tiles split across programs are merged by a second launch (``stream_k_merge``: every tile
        at once, over shares of Dv) instead of by the last program to arrive, after its share. Exact either way.
    pdl : with ``merge_launch``, chain the merge by programmatic dependent launch; None = where supported.
    """
    if grid < 1:
        raise ValueError(f"stream_k_decode: grid must be >= 1; got {grid}")
    geo = decode_geometry(q, k, v)
    if workspace is None:
        workspace = stream_k_workspace(grid, q, k, v)
    ws_o, ws_lse, counters = workspace
    split = head_dim_split(geo.D, geo.Dv) if head_chunks else (0, 0)
    pointers, mstr, mask_kind, use_tma = decode_inputs(q, k, v, attn_mask, valid_len, geo, block_n, tma, key_start,
                                                       alibi_slopes, split)
    upcast, precision = dot_flags(q.dtype)
    planes = lse is not None and lse.dim() == 4
    if planes and (lse.shape[0] != 2 or tuple(lse.shape[1:]) != tuple(q.shape[:3])):
        raise ValueError(f"stream_k_decode: lse of shape {tuple(lse.shape)}: expected {tuple(q.shape[:3])} or the "
                         f"two planes {(2,) + tuple(q.shape[:3])}")
    lstr = tuple(lse.stride()[-3:]) if lse is not None else (0, 0, 0)
    pdl = bool(merge_launch) and (pdl_supported(q.device) if pdl is None else bool(pdl) and pdl_supported(q.device))
    extra = {}
    if num_warps >= 8 and not interpreting() and backend_has_option("maxnreg"):
        # The kernel holds the KV loop, the partial path and the merge: capping registers at 128 (a few spills)
        # lets two programs share an SM instead of one.
        extra["maxnreg"] = 128
    _STREAM_K_LAUNCH(
        (grid,), *pointers, out, lse if lse is not None else out, ws_o, ws_lse, counters,
        *q.stride(), *k.stride(), *v.stride(), *mstr, *out.stride(), *lstr, lse.stride(0) if planes else 0, *ws_o.stride(), *ws_lse.stride()[1:],
        ws_lse.stride(0),
        softmax_scale(scale, geo.D), float(softcap), geo.B, geo.N, geo.L, geo.G, geo.Hkv, geo.num_m, geo.D, geo.Dv,
        grid,
        BLOCK_B=max(2, next_pow2(geo.B)), BLOCK_M=geo.block_m, BLOCK_N=block_n, BLOCK_D=geo.block_d,
        BLOCK_DV=geo.block_dv, HAS_VALID=valid_len is not None, MASK_KIND=mask_kind, IS_CAUSAL=bool(is_causal),
        WRITE_LSE=lse is not None, UPCAST=upcast, PRECISION=precision,
        BLOCK_R=geo.block_r, MERGE_P=geo.merge_p, USE_TMA=use_tma, LSE_PLANES=planes,
        HAS_START=key_start is not None, SOFTCAP=bool(softcap), ALIBI=alibi_slopes is not None, D_LO=split[0],
        D_HI=split[1], PAST_ZERO=tail_in_loop(use_tma, valid_len, is_causal), SEPARATE_MERGE=bool(merge_launch),
        LAUNCH_DEPENDENTS=pdl, num_warps=num_warps,
        num_stages=num_stages, **extra,
    )
    if merge_launch:
        stream_k_merge(geo, grid, block_n, workspace, out, lse, valid_len, key_start, is_causal, pdl)
    return out, lse
