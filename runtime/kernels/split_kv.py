"""Split-KV decode (FlashDecoding): stage 1 computes one partial softmax state per (KV chunk, query tile);
stage 2 merges them with ``merge_states``.

The grid is fixed by the plan: ``num_splits`` programs per (batch row, KV head, M block). Each split's share
of keys follows the valid length read on device at run time, so a captured CUDA graph replays correctly as
the cache grows. Given a mask (and no window start), each split instead owns every S-th tile and reads the mask
over them, attending only to tiles with a visible key (``mask_tiles.py``): a static cache needs no valid length
computed ahead of the launch. With one split, stage 1 writes the normalised output directly and no merge runs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

try:  # grid dependency control (programmatic dependent launch); absent from older Tritons
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - then pdl_supported() is False and the branch is never compiled
    gdc_launch_dependents = gdc_wait = None

from .attend import _attend_chunks, _load_q, _row_coords, _split_share
from .common import arrival_counters, decode_geometry, decode_inputs, dot_flags, head_dim_split, pdl_supported, \
    prefetch_applies, softmax_scale, tail_in_loop
from .tile_ops import WGMMA_ROWS
from .launch import KernelLauncher
from .mask_tiles import _attend_visible, chunk_tiles, scan_rows
from .merge import merge_states
from .partials import _arrive_and_merge, _finish_parts, _store_rows


# NUM_SPLITS unspecialised: a plan whose grid follows the cache's length (SplitKVPlan.tiles_per_split) changes it
# between steps, and a split count divisible by 16 would otherwise compile another kernel in the middle of a generation
@triton.jit(do_not_specialize=["NUM_SPLITS"])
def _split_kv_kernel(
    q_ptr, k_ptr, v_ptr,  # Q (B, Hq, L, D); K (B, Hkv, N, D); V (B, Hkv, N, Dv): any strides
    k_desc, v_desc,  # USE_TMA: tensor descriptors of K and V (block (1, 1, BLOCK_N, BLOCK_D or D_LO)); else K/V again
    k_hi_desc, v_hi_desc,  # USE_TMA and D_LO > 0: descriptors of K[..., D_LO:] and V[..., D_LO:] (block (1, 1,
    # BLOCK_N, D_HI)); else K/V again
    mask_ptr,  # mask broadcast to (B, Hq, L, N) (uint8 for bool, float for additive), or a dummy
    valid_ptr,  # (B,) int32/int64 valid lengths, or a dummy when HAS_VALID is False
    start_ptr,  # (B,) int32/int64 first keys (a sliding window's start), or a dummy when HAS_START is False
    alibi_ptr,  # (Hq,) float ALiBi slopes (scores + slope[h] * key position), or a dummy when ALIBI is False
    o_ptr,  # output: (S, B, Hq, L, Dv) fp32 partials (S > 1) or the final (B, Hq, L, Dv) output (S == 1)
    lse_ptr,  # S > 1: (2, S, B, Hq, L) fp32 partial row maxima (plane 0) and log l (plane 1); else the final LSE
    out_ptr,  # FUSED: the final (B, Hq, L, Dv) output the last split to arrive merges into (else unused)
    lse_out_ptr,  # FUSED: the final (B, Hq, L) fp32 LSE (written when WRITE_LSE_OUT)
    counter_ptr,  # FUSED: (B * HKV * NUM_M,) int32 arrival counters, zero before and after every launch
    stride_qb, stride_qh, stride_ql, stride_qd,  # Q strides
    stride_kb, stride_kh, stride_kn, stride_kd,  # K strides
    stride_vb, stride_vh, stride_vn, stride_vd,  # V strides
    stride_mb, stride_mh, stride_ml, stride_mn,  # mask strides (0 on broadcast dims)
    stride_os, stride_ob, stride_oh, stride_ol, stride_od,  # output strides (split stride first)
    stride_ls, stride_lb, stride_lh, stride_ll,  # LSE strides (split stride first)
    stride_lpart,  # S > 1: stride between the row-max and log-l planes of the partial LSEs
    stride_fb, stride_fh, stride_fl, stride_fd,  # FUSED: final output strides
    stride_gb, stride_gh, stride_gl,  # FUSED: final LSE strides
    sm_scale,  # softmax scale (natural units)
    softcap,  # SOFTCAP: the cap (scores are softcap * tanh(qk * sm_scale))
    N,  # keys in the K/V tensors (the static cache length)
    L,  # query tokens per head (q_len)
    G,  # query heads per KV head
    HKV,  # KV heads
    NUM_M,  # M blocks per KV head: cdiv(G * L, BLOCK_M)
    D: tl.constexpr,  # head dim of Q/K (constexpr: masks on it keep loads vectorised)
    DV: tl.constexpr,  # head dim of V
    NUM_SPLITS,  # programs per (batch, KV head, M block)
    BLOCK_M: tl.constexpr,  # packed query rows per tile (power of two >= 16)
    BLOCK_N: tl.constexpr,  # keys per KV tile
    BLOCK_D: tl.constexpr,  # padded D
    BLOCK_DV: tl.constexpr,  # padded Dv
    HAS_VALID: tl.constexpr,  # whether valid_ptr holds per-row valid lengths
    MASK_KIND: tl.constexpr,  # 0 none, 1 boolean, 2 additive
    IS_CAUSAL: tl.constexpr,  # top-left causal: query i sees keys j <= i
    WRITE_LSE: tl.constexpr,  # whether to store the LSE
    UPCAST: tl.constexpr,  # compute dots in fp32 (interpreter)
    PRECISION: tl.constexpr,  # tl.dot input precision
    FUSED: tl.constexpr,  # the last split to finish a tile merges the partials (no second launch)
    WRITE_LSE_OUT: tl.constexpr,  # FUSED: whether to store the final LSE
    BLOCK_R: tl.constexpr,  # FUSED: rows merged per tile (next power of two >= min(G * L, BLOCK_M))
    MERGE_P: tl.constexpr,  # FUSED: partials loaded per merge step
    USE_TMA: tl.constexpr,  # K/V tiles through the copy engine (tensor descriptors)
    LSE_PLANES: tl.constexpr,  # the states go out with the row max and log l apart (two planes of lse_ptr): the
    # partials to the workspace (S > 1), or with one split the final state when the caller asked for the planes
    LAUNCH_DEPENDENTS: tl.constexpr,  # let the merge launch (programmatic dependent launch) right away
    HAS_START: tl.constexpr = False,  # whether start_ptr holds per-row first keys (keys before do not exist)
    SOFTCAP: tl.constexpr = False,  # logit softcapping of the scaled scores
    ALIBI: tl.constexpr = False,  # ALiBi: a per-head slope times the key position added to the scores
    MASK_SKIP: tl.constexpr = False,  # the splits own strided tiles and attend only to the tiles the mask shows
    # (mask_tiles.py); no device valid length is needed
    CHUNK_T: tl.constexpr = 1,  # MASK_SKIP: tiles classified at once
    HEAD_BCAST: tl.constexpr = False,  # MASK_SKIP: the mask is broadcast over the heads (scanned per query position)
    N_SCAN: tl.constexpr = 0,  # MASK_SKIP with HEAD_BCAST: query positions to scan (1 when broadcast over them)
    ONE_CHUNK: tl.constexpr = False,  # MASK_SKIP: CHUNK_T covers every split's tiles
    D_LO: tl.constexpr = 0,  # > 0: the head dims (D == DV) run in two power-of-two chunks, [0, D_LO) and D_HI
    D_HI: tl.constexpr = 0,  # columns from D_LO, those past D masked (common.head_dim_split)
    PAST_ZERO: tl.constexpr = False,  # USE_TMA and the keys are the tensors' own N (no valid length, no causal cut):
    # the copy engine zero-fills past them, so the tile crossing N runs in the pipelined loop (attend._attend_chunks)
    WAIT_PRIOR: tl.constexpr = False,  # launched as a programmatic dependent (``chain``): wait for the prior grid first
    SWAP_AB: tl.constexpr = False,  # the products as K @ Q^T and V^T @ P^T, the accumulators transposed (tile_ops)
    PREFETCH: tl.constexpr = 0,  # > 0: K/V rows this many tiles ahead are prefetched into L2 (tile_ops; CUDA only)
    PREFETCH_BULK: tl.constexpr = True,  # PREFETCH: one bulk request per tensor and tile, else one per 128-byte line
):
    if LAUNCH_DEPENDENTS:
        # the merge kernel's programs may become resident now; they wait (griddepcontrol.wait) for this grid to
        # finish and its writes to be visible before they read a partial
        gdc_launch_dependents()
    if WAIT_PRIOR:
        # resident before the kernel ahead of it in the stream has finished (launch and scheduling overlap its
        # tail); nothing is read or written before that grid is complete and its writes are visible
        gdc_wait()
    split = tl.program_id(0)
    tile = tl.program_id(1)  # (b * HKV + kvh) * NUM_M + mb
    mb = tile % NUM_M
    bh = tile // NUM_M
    kvh = bh % HKV
    b = bh // HKV

    kv_len = N
    if HAS_VALID:
        kv_len = tl.minimum(tl.load(valid_ptr + b).to(tl.int32), N)
        kv_len = tl.maximum(kv_len, 0)
    if IS_CAUSAL:
        kv_len = tl.minimum(kv_len, L)  # no query row sees a key at or past L
    # This split's share of the keys that exist for row b: tiles [s * T // S, (s + 1) * T // S). Shares differ by
    # at most one tile. Equal ceil(T / S) shares left the last splits short or empty (33 splits of 256 tiles:
    # 32 splits of 8 tiles and an idle one), so the grid's real size was not the planned one.
    # A window's first key (rounded down to a tile, so that tiles stay aligned for TMA; the keys below it are
    # masked in _attend_tile): the splits then share only [first, kv_len), the last W keys.
    first = kv_len * 0
    if HAS_START:
        first = tl.minimum(tl.maximum(tl.load(start_ptr + b).to(tl.int32), 0), kv_len)
    first_tile = first // BLOCK_N * BLOCK_N
    lo, hi = _split_share(split, kv_len - first_tile, NUM_SPLITS, BLOCK_N)
    lo += first_tile
    hi += first_tile

    rows, g, i, row_ok = _row_coords(mb, L, G, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)  # the padded columns of V (the fused merge's)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if D_LO > 0:  # two chunks of the head dim: [0, D_LO) in q / acc, [D_LO, D_LO + D_HI) in q_hi / acc_hi
        offs_d = tl.arange(0, D_LO)
        offs_o = offs_d
        offs_hi = D_LO + tl.arange(0, D_HI)
        q_hi = _load_q(q_ptr, b, kvh, g, i, row_ok, offs_hi, stride_qb, stride_qh, stride_ql, stride_qd, G, D,
                       UPCAST, SWAP_AB)
        if SWAP_AB:  # q, the scores and the accumulators transposed to the store (tile_ops)
            acc = tl.zeros([D_LO, BLOCK_M], dtype=tl.float32)
            acc_hi = tl.zeros([D_HI, BLOCK_M], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, D_LO], dtype=tl.float32)
            acc_hi = tl.zeros([BLOCK_M, D_HI], dtype=tl.float32)
    else:  # one chunk padded to a power of two; the hi state is a stand-in, never read
        offs_d = tl.arange(0, BLOCK_D)
        offs_o = offs_dv
        offs_hi = offs_d
        if SWAP_AB:
            acc = tl.zeros([BLOCK_DV, BLOCK_M], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    q = _load_q(q_ptr, b, kvh, g, i, row_ok, offs_d, stride_qb, stride_qh, stride_ql, stride_qd, G, D, UPCAST,
                SWAP_AB)
    if D_LO == 0:
        q_hi = q
        acc_hi = acc
    if MASK_SKIP:
        acc, acc_hi, m_i, l_i = _attend_visible(
            q, q_hi, acc, acc_hi, m_i, l_i, split, NUM_SPLITS, kv_len, k_ptr, v_ptr, k_desc, v_desc, k_hi_desc,
            v_hi_desc, mask_ptr, b, kvh, mb, i, row_ok, offs_d, offs_o, offs_hi, stride_kb, stride_kh, stride_kn,
            stride_kd, stride_vb, stride_vh, stride_vn, stride_vd, stride_mb, stride_mh, stride_ml, stride_mn,
            sm_scale, L, G, D, DV, N_SCAN, BLOCK_M, BLOCK_N, CHUNK_T, MASK_KIND, HEAD_BCAST, IS_CAUSAL, UPCAST,
            PRECISION, softcap, SOFTCAP, alibi_ptr, ALIBI, USE_TMA, ONE_CHUNK, D_LO)
    else:
        acc, acc_hi, m_i, l_i = _attend_chunks(
            q, q_hi, acc, acc_hi, m_i, l_i, lo, hi, kv_len, k_ptr, v_ptr, k_desc, v_desc, k_hi_desc, v_hi_desc,
            mask_ptr, b, kvh, g, i, row_ok, offs_d, offs_o, offs_hi, stride_kb, stride_kh, stride_kn, stride_kd,
            stride_vb, stride_vh, stride_vn, stride_vd, stride_mb, stride_mh, stride_ml, stride_mn, sm_scale, G, D,
            DV, BLOCK_N, MASK_KIND, IS_CAUSAL, UPCAST, PRECISION, USE_TMA, first, softcap, HAS_START, SOFTCAP,
            alibi_ptr, ALIBI, D_LO, PAST_ZERO, SWAP_AB, PREFETCH, PREFETCH_BULK)
    if D_LO > 0:
        o_hi, _, _ = _finish_parts(acc_hi, m_i, l_i, SWAP_AB)
        _store_rows(o_hi, m_i, o_ptr + split.to(tl.int64) * stride_os, lse_ptr, b, kvh, g, i, row_ok, offs_hi,
                    stride_ob, stride_oh, stride_ol, stride_od, stride_lb, stride_lh, stride_ll, G, DV, False,
                    SWAP_AB)
    o, m_part, log_l = _finish_parts(acc, m_i, l_i, SWAP_AB)
    if LSE_PLANES:
        lse = m_part  # partial: m and log l kept apart for the merge (see _merge_step)
    else:
        lse = m_part + log_l
    _store_rows(o, lse, o_ptr + split.to(tl.int64) * stride_os, lse_ptr + split.to(tl.int64) * stride_ls,
                b, kvh, g, i, row_ok, offs_o, stride_ob, stride_oh, stride_ol, stride_od,
                stride_lb, stride_lh, stride_ll, G, DV, WRITE_LSE, SWAP_AB)
    if LSE_PLANES:
        ll_ptrs = (lse_ptr + stride_lpart + split.to(tl.int64) * stride_ls + b.to(tl.int64) * stride_lb
                   + (kvh * G + g).to(tl.int64) * stride_lh + i.to(tl.int64) * stride_ll)
        tl.store(ll_ptrs, log_l, mask=row_ok)
    if FUSED:  # the last split to arrive at the tile merges all NUM_SPLITS partials
        _arrive_and_merge(counter_ptr, tile, NUM_SPLITS, o_ptr, lse_ptr, out_ptr, lse_out_ptr, mb, b, kvh, offs_dv,
                          stride_os, stride_ob, stride_oh, stride_ol, stride_od, stride_ls, stride_lb, stride_lh,
                          stride_ll, stride_lpart, stride_fb, stride_fh, stride_fl, stride_fd, stride_gb, stride_gh,
                          stride_gl, NUM_SPLITS, L, G, DV, BLOCK_M, BLOCK_R, MERGE_P, WRITE_LSE_OUT)


_SPLIT_KV_LAUNCH = KernelLauncher(_split_kv_kernel)


def swap_applies(geo, q: torch.Tensor, skip: bool, use_tma: bool, split: tuple[int, int], past_zero: bool) -> bool:
    """Whether a launch asked for swap-AB (``tile_ops``) runs it: a query tile under WGMMA_ROWS rows, no mask tiles
    (``mask_tiles``), 16-bit inputs where compiled (wgmma reads a transposed V from shared memory in 16-bit types
    only; the interpreter takes fp32 too), and not copy-engine tiles in head chunks with the tile that crosses the
    last key run after the loop (a valid length or a causal cut: its V rows zeroed in registers). That combination
    was wrong compiled on the H100 (``benchmarks/trail_variants.py --swap-check`` at b59c3ce: 4 of 32 combinations,
    exactly those, errors 0.2-0.35; every other one equal to the plain kernel); it runs unswapped."""
    if geo.block_m >= WGMMA_ROWS or skip or (q.element_size() != 2 and q.device.type == "cuda"):
        return False
    return not (use_tma and split[0] > 0 and not past_zero)


def split_kv_workspace(num_splits: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """Workspace for ``num_splits`` > 1: partial o (S, B, Hq, L, Dv) fp32, partial (row max, log l) (2, S, B, Hq, L)
    fp32 (natural log; see ``merge.merge_states``), and the arrival counters of the fused merge (B * Hkv * num_m,)
    int32, zeroed (every launch leaves them zero)."""
    geo = decode_geometry(q, k, v)
    return (torch.empty((num_splits, geo.B, geo.Hq, geo.L, geo.Dv), device=q.device, dtype=torch.float32),
            torch.empty((2, num_splits, geo.B, geo.Hq, geo.L), device=q.device, dtype=torch.float32),
            arrival_counters(geo, q.device))


def split_kv_decode(q, k, v, out, lse=None, *, workspace=None, attn_mask=None, valid_len=None, scale=None,
                    is_causal=False, num_splits=8, block_n=64, num_warps=4, num_stages=2, fused_merge=False,
                    tma=False, pdl=None, merge=True, key_start=None, softcap=0.0, alibi_slopes=None, mask_tiles=None,
                    head_chunks=False, chain=False, merge_dv_split=1, swap_ab=False, l2_prefetch=0, prefetch_bulk=True):
    """Launch split-KV decode attention into ``out`` (and ``lse``).

    Parameters
    ----------
    q : (B, Hq, L, D) fp16/bf16/fp32; k : (B, Hkv, N, D); v : (B, Hkv, N, Dv), same dtype, any strides.
    out : (B, Hq, L, Dv) any float dtype, written in full.
    lse : (B, Hq, L) fp32 or None: the natural-log LSE of each row (-inf where no key is visible). A (2, B, Hq, L)
        fp32 tensor instead receives the row max (plane 0) and log l (plane 1) apart, natural log (-inf for a row
        with no visible key), for a later merge that must keep them apart (``merge.merge_states``'s
        ``log_l_parts``); the merge then runs as a second launch (``fused_merge`` is ignored).
    workspace : the triple from ``split_kv_workspace``; needed when S > 1 (allocated here when None). It may hold
        more splits than ``num_splits`` (a grid that follows the cache's length): the first S are used.
    attn_mask : bool (True = attend) or additive, broadcastable to (B, Hq, L, N); valid_len : (B,) int tensor.
    key_start : (B,) int tensor or None: keys before ``key_start[b]`` do not exist for row b (a sliding window);
        the splits share only the keys [key_start, valid_len), read on device, so a captured graph follows it.
    softcap : c != 0 caps the scaled scores to ``c * tanh(s)`` before the mask (Gemma 2); 0 = no cap.
    alibi_slopes : (Hq,) contiguous float tensor or None: ALiBi, scores + ``slope[h] * j`` for key position j
        (after the cap, before the mask).
    fused_merge : with S > 1, the last split to finish each tile merges the partials in the same launch
        (arrival counter per tile) instead of a second ``merge_states`` launch.
    tma : read K/V tiles with the copy engine (Hopper tensor descriptors) when the strides allow it and the launch
        is being captured into a CUDA graph (``tma_now``) and no mask is given; pointer loads otherwise (the result
        is the same).
    pdl : launch the merge with programmatic dependent launch (it becomes resident while stage 1 runs); None =
        wherever the GPU and Triton support it.
    mask_tiles : given a mask and no ``key_start``, the splits own strided tiles and attend only to those with a
        visible key (``mask_tiles.py``): "tma" reads the tiles whose last key is visible by the copy engine (where
        ``tma`` applies), True all by pointer loads; None = "tma" with ``tma``, else True. False takes contiguous
        shares of [0, valid_len) instead, the mask read in every tile (the path before it; for comparisons). Exact
        each way.
    head_chunks : True: where ``common.head_dim_split`` cuts the head dim in two power-of-two chunks (D=80 and 96:
        64 + 32), Q.K and P.V run over the two chunks instead of one padded to a power of two (128); False: one
        padded chunk. Exact either way (a plan's ``head_chunks``, chosen by measurement).
    chain : launch stage 1 itself as a programmatic dependent of the kernel before it in the stream (where ``pdl``
        applies), waiting for that grid before it reads anything, and let the merge launch whatever follows it
        early (``merge_states``' ``launch_next``): back-to-back decode steps overlap each launch with the tail
        of the kernel before. Exact either way.
    merge_dv_split : the merge launch's programs per row (``merge_states``' ``dv_split``: a power of two, or
        "auto").
    swap_ab : run the tile products as ``K @ Q^T`` and ``V^T @ P^T`` (``tile_ops``) where ``swap_applies`` (fewer
        than 64 query rows, G * q_len <= 32; no mask tiles; 16-bit on CUDA; not TMA tiles in head chunks with a valid
        length or a causal cut); ignored elsewhere. Exact either way (a plan's ``swap_ab``, chosen by measurement).
    l2_prefetch : > 0: each program also prefetches the K/V rows this many tiles ahead into L2 (``tile_ops``;
        ``prefetch_bulk``: one bulk request per tensor and tile, else one per 128-byte line), where the kernel is
        compiled for Hopper or newer and the K/V rows are contiguous (``prefetch_applies``); ignored elsewhere.
    merge : with S > 1 and no fused merge, False leaves the partial states in ``workspace`` (views of a larger one
        that a caller merges with other partials: the shared-prefix cascade); ``out`` and ``lse`` are not written.
    """
    if num_splits < 1:
        raise ValueError(f"split_kv_decode: num_splits must be >= 1; got {num_splits}")
    geo = decode_geometry(q, k, v)
    # a mask and no window: the splits read the mask over their own (strided) tiles and attend only to the tiles
    # with a visible key (mask_tiles.py)
    if mask_tiles not in (None, True, False, "tma"):
        raise ValueError(f"split_kv_decode: mask_tiles must be None, True, False or 'tma'; got {mask_tiles!r}")
    skip = attn_mask is not None and key_start is None and mask_tiles is not False
    tma = tma and (not skip or mask_tiles in (None, "tma"))
    split = head_dim_split(geo.D, geo.Dv) if head_chunks else (0, 0)
    pointers, mstr, mask_kind, use_tma = decode_inputs(q, k, v, attn_mask, valid_len, geo, block_n, tma, key_start,
                                                       alibi_slopes, split)
    upcast, precision = dot_flags(q.dtype)
    planes = lse is not None and lse.dim() == 4
    if planes and (lse.shape[0] != 2 or tuple(lse.shape[1:]) != tuple(q.shape[:3])):
        raise ValueError(f"split_kv_decode: lse of shape {tuple(lse.shape)}: expected {tuple(q.shape[:3])} or the "
                         f"two planes {(2,) + tuple(q.shape[:3])}")
    fused = bool(fused_merge) and num_splits > 1 and not planes
    counters = q
    if num_splits > 1:
        if workspace is None:
            workspace = split_kv_workspace(num_splits, q, k, v)
        ws_o, ws_lse, counters = workspace
        rows = ws_o.shape[0]
        if rows < num_splits:
            raise ValueError(f"split_kv_decode: the workspace holds {rows} splits, fewer than num_splits="
                             f"{num_splits}")
        ws_o, ws_lse = ws_o[:num_splits], ws_lse[:, :num_splits]  # views: no allocation, graph-safe
        if fused and ws_o.numel() >= 2**31:
            raise ValueError("fused split-KV merge needs a workspace under 2**31 elements")
        o_t, l_t = ws_o, ws_lse
        ostr, lstr = ws_o.stride(), ws_lse.stride()[1:]
        lpart = ws_lse.stride(0)
        write_lse = True
    else:
        o_t, l_t = out, lse
        ostr = (0,) + tuple(out.stride())
        lstr = (0,) + (tuple(lse.stride()[-3:]) if lse is not None else (0, 0, 0))
        write_lse = lse is not None
        lpart = lse.stride(0) if planes else 0
    fstr = tuple(out.stride())
    gstr = tuple(lse.stride()) if lse is not None and not planes else (0, 0, 0)
    grid = (num_splits, geo.B * geo.Hkv * geo.num_m)
    past_zero = tail_in_loop(use_tma, valid_len, is_causal)
    swap = bool(swap_ab) and swap_applies(geo, q, skip, use_tma, split, past_zero)
    prefetch = int(l2_prefetch) if l2_prefetch and not skip and prefetch_applies(k, v) else 0
    head_bcast, n_scan = scan_rows(mstr, geo.L) if skip else (False, 0)
    chunk, one_chunk = chunk_tiles(geo.N, num_splits, block_n) if skip else (1, False)
    two_launches = num_splits > 1 and not fused and merge
    pdl_ok = pdl_supported(q.device) if pdl is None else bool(pdl) and pdl_supported(q.device)
    chain = bool(chain) and pdl_ok
    pdl = two_launches and pdl_ok
    _SPLIT_KV_LAUNCH(
        grid, *pointers, o_t, l_t if l_t is not None else o_t, out, lse if lse is not None else out, counters,
        *q.stride(), *k.stride(), *v.stride(), *mstr, *ostr, *lstr, lpart, *fstr, *gstr,
        softmax_scale(scale, geo.D), float(softcap), geo.N, geo.L, geo.G, geo.Hkv, geo.num_m, geo.D, geo.Dv,
        num_splits, BLOCK_M=geo.block_m, BLOCK_N=block_n, BLOCK_D=geo.block_d, BLOCK_DV=geo.block_dv,
        HAS_VALID=valid_len is not None, MASK_KIND=mask_kind, IS_CAUSAL=bool(is_causal), WRITE_LSE=write_lse,
        UPCAST=upcast, PRECISION=precision, FUSED=fused, WRITE_LSE_OUT=lse is not None, BLOCK_R=geo.block_r,
        MERGE_P=geo.merge_p, USE_TMA=use_tma, LSE_PLANES=num_splits > 1 or planes, LAUNCH_DEPENDENTS=pdl,
        HAS_START=key_start is not None, SOFTCAP=bool(softcap), ALIBI=alibi_slopes is not None,
        MASK_SKIP=skip, CHUNK_T=chunk, ONE_CHUNK=one_chunk, HEAD_BCAST=head_bcast, N_SCAN=n_scan, D_LO=split[0],
        D_HI=split[1], PAST_ZERO=past_zero, WAIT_PRIOR=chain, SWAP_AB=swap,
        PREFETCH=prefetch, PREFETCH_BULK=bool(prefetch_bulk),
        num_warps=num_warps, num_stages=num_stages, **({"launch_pdl": True} if chain else {}),
    )
    if two_launches:
        merge_states(ws_o, ws_lse[0], out=out, lse_out=lse if lse is not None else False, pdl=pdl,
                     log_l_parts=ws_lse[1], max_parts=rows, dv_split=merge_dv_split, launch_next=chain)
    return out, lse
