"""SAAP sparse decode in one launch (plus the shared ``merge_states``): top-l cluster selection on the device and
attention to the sink, the recent window and the chosen clusters, with the work balanced over a fixed grid.

Each program of (split, batch row x KV head x M block) reads its KV head's cluster scores (C fp32: the query
MLP's or the centroids', group-summed), picks the top ``probes`` clusters itself (a sort in registers; every split
of a head picks the same set), and lays the attended keys out in one virtual sequence: the sink, then the chosen
clusters in cluster order (through the CSR ``offsets`` and the cluster-sorted ``perm``), then the window
[indexed_end, kv_len). Split ``s`` takes an equal share of that sequence's tiles, so a large cluster is cut into
tiles over several programs and small ones are packed into one: the largest cluster no longer sets the time. A
key of the virtual sequence finds its cluster by a binary search over the chosen sizes' prefix sums (kept in a
small per-program table in global memory), so the cost per key grows with log C, not with ``probes``. The
grid is fixed by the plan and every length is read on the device, so a captured CUDA graph replays correctly.

Ties at the l-th score select every tied cluster (a superset of ``torch.topk``'s pick, never fewer keys).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import _finish, _load_q, _row_coords, _softmax_update, _split_share, _store_rows, block_d_for, block_m_for, cdiv, \
    dot_flags, next_pow2, softmax_scale
from .launch import KernelLauncher
from .merge import merge_states


@triton.jit
def _saap_kernel(
    q_ptr, k_ptr, v_ptr,  # Q (B, Hq, L, D); K (B, Hkv, N, D); V (B, Hkv, N, Dv): any strides
    scores_ptr,  # (B, Hkv, C) fp32 group-summed cluster scores
    offsets_ptr,  # (B, Hkv, C + 1) int32 CSR offsets into perm
    perm_ptr,  # (B, Hkv, NP) int32 key positions sorted by cluster
    end_ptr,  # (B,) int32 indexed_end: keys from here on (the window, later tokens) are always attended
    valid_ptr,  # (B,) int32/int64 valid lengths, or a dummy when HAS_VALID is False
    o_ptr,  # (S, B, Hq, L, Dv) fp32 partial outputs
    lse_ptr,  # (S, B, Hq, L) fp32 partial natural-log LSEs
    scratch_ptr,  # (S, B * Hkv * NUM_M, 2, BLOCK_C) int32: each program's cluster prefix and perm shift
    stride_qb, stride_qh, stride_ql, stride_qd,  # Q strides
    stride_kb, stride_kh, stride_kn, stride_kd,  # K strides
    stride_vb, stride_vh, stride_vn, stride_vd,  # V strides
    stride_sb, stride_sh, stride_sc,  # scores strides
    stride_fb, stride_fh, stride_fc,  # offsets strides
    stride_pb, stride_ph, stride_pn,  # perm strides
    stride_os, stride_ob, stride_oh, stride_ol, stride_od,  # partial output strides
    stride_ls, stride_lb, stride_lh, stride_ll,  # partial LSE strides
    sm_scale,  # softmax scale (natural units)
    N,  # keys in the K/V tensors
    L,  # query tokens per head
    G,  # query heads per KV head
    HKV,  # KV heads
    NUM_M,  # M blocks per KV head
    C,  # clusters per KV head
    PROBES,  # clusters attended per KV head (1 <= PROBES <= C)
    SINK,  # keys [0, SINK) are always attended
    NUM_SPLITS,  # programs per (batch row, KV head, M block)
    D: tl.constexpr,  # head dim of Q/K
    DV: tl.constexpr,  # head dim of V
    BLOCK_M: tl.constexpr,  # packed query rows per tile
    BLOCK_N: tl.constexpr,  # attended keys per tile
    BLOCK_D: tl.constexpr,  # padded D
    BLOCK_DV: tl.constexpr,  # padded Dv
    BLOCK_C: tl.constexpr,  # padded C (power of two)
    SEARCH_STEPS: tl.constexpr,  # binary-search steps over the C clusters: log2(BLOCK_C) + 1
    HAS_VALID: tl.constexpr,  # whether valid_ptr holds per-row valid lengths
    UPCAST: tl.constexpr,  # compute dots in fp32 (interpreter)
    PRECISION: tl.constexpr,  # tl.dot input precision
):
    split = tl.program_id(0)
    tile = tl.program_id(1)  # (b * HKV + kvh) * NUM_M + mb
    mb = tile % NUM_M
    bh = tile // NUM_M
    kvh = bh % HKV
    b = bh // HKV
    b64 = b.to(tl.int64)
    kvh64 = kvh.to(tl.int64)

    kv_len = N
    if HAS_VALID:
        kv_len = tl.maximum(tl.minimum(tl.load(valid_ptr + b).to(tl.int32), N), 0)
    indexed_end = tl.minimum(tl.load(end_ptr + b).to(tl.int32), kv_len)
    sink = tl.minimum(SINK, indexed_end)

    # top-PROBES clusters of this KV head: the PROBES-th largest score is the threshold
    offs_c = tl.arange(0, BLOCK_C)
    c_ok = offs_c < C
    sc = tl.load(scores_ptr + b64 * stride_sb + kvh64 * stride_sh + offs_c.to(tl.int64) * stride_sc, mask=c_ok,
                 other=float("-inf"))
    ranked = tl.sort(sc, descending=True)
    thr = tl.max(tl.where(offs_c == PROBES - 1, ranked, float("-inf")), axis=0)
    chosen = c_ok & (sc >= thr)
    f_base = offsets_ptr + b64 * stride_fb + kvh64 * stride_fh
    c_start = tl.load(f_base + offs_c.to(tl.int64) * stride_fc, mask=c_ok, other=0)
    c_end = tl.load(f_base + (offs_c + 1).to(tl.int64) * stride_fc, mask=c_ok, other=0)
    size = tl.where(chosen, c_end - c_start, 0)
    incl = tl.cumsum(size, 0)  # chosen keys up to and including each cluster (non-decreasing)
    total = tl.sum(size, axis=0)  # keys in the chosen clusters
    # this program's copy of the prefix and of (perm index - virtual index) per cluster, for the binary search
    scratch = scratch_ptr + (split.to(tl.int64) * tl.num_programs(1) + tile) * (2 * BLOCK_C)
    tl.store(scratch + offs_c, tl.where(c_ok, incl, 2147483647))
    tl.store(scratch + BLOCK_C + offs_c, c_start - (incl - size))
    tl.debug_barrier()  # the stores are visible to every thread of this program before the searches

    # this split's share of the virtual sequence: sink | chosen clusters | window
    n_win = kv_len - indexed_end
    n_virtual = sink + total + n_win
    lo, hi = _split_share(split, n_virtual, NUM_SPLITS, BLOCK_N)

    rows, g, i, row_ok = _row_coords(mb, L, G, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = _load_q(q_ptr, b, kvh, g, i, row_ok, offs_d, stride_qb, stride_qh, stride_ql, stride_qd, G, D, UPCAST)
    row_pos = kv_len - L + i  # each query token's own position: it sees no later key
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    k_base = k_ptr + b64 * stride_kb + kvh64 * stride_kh
    v_base = v_ptr + b64 * stride_vb + kvh64 * stride_vh
    p_base = perm_ptr + b64 * stride_pb + kvh64 * stride_ph
    for start_t in range(lo, hi, BLOCK_N):
        t = start_t + tl.arange(0, BLOCK_N)
        t_ok = t < hi
        u = t - sink
        in_clusters = (t >= sink) & (u < total)
        # the cluster of virtual key u: the first c with incl[c] > u (always a chosen one: an unchosen cluster
        # repeats the prefix before it)
        c_lo = tl.zeros([BLOCK_N], dtype=tl.int32)
        c_hi = tl.full([BLOCK_N], BLOCK_C, dtype=tl.int32)
        for _ in range(SEARCH_STEPS):
            active = c_lo < c_hi
            mid = (c_lo + c_hi) // 2
            right = tl.load(scratch + mid, mask=active & in_clusters & t_ok, other=0) <= u
            c_lo = tl.where(active & right, mid + 1, c_lo)
            c_hi = tl.where(active & (right == 0), mid, c_hi)
        shift = tl.load(scratch + BLOCK_C + tl.minimum(c_lo, BLOCK_C - 1), mask=in_clusters & t_ok, other=0)
        perm_idx = shift + u
        from_perm = tl.load(p_base + perm_idx.to(tl.int64) * stride_pn, mask=t_ok & in_clusters, other=0)
        pos = tl.where(t < sink, t, tl.where(in_clusters, from_perm, indexed_end + u - total))
        pos64 = pos.to(tl.int64)
        k = tl.load(k_base + pos64[:, None] * stride_kn + offs_d.to(tl.int64)[None, :] * stride_kd,
                    mask=t_ok[:, None] & (offs_d[None, :] < D), other=0.0)
        v = tl.load(v_base + pos64[:, None] * stride_vn + offs_dv.to(tl.int64)[None, :] * stride_vd,
                    mask=t_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * sm_scale
        visible = t_ok[None, :] & row_ok[:, None] & (pos[None, :] <= row_pos[:, None])
        acc, m_i, l_i = _softmax_update(acc, m_i, l_i, s, visible, v, UPCAST, PRECISION)
    o, lse = _finish(acc, m_i, l_i)
    _store_rows(o, lse, o_ptr + split.to(tl.int64) * stride_os, lse_ptr + split.to(tl.int64) * stride_ls,
                b, kvh, g, i, row_ok, offs_dv, stride_ob, stride_oh, stride_ol, stride_od,
                stride_lb, stride_lh, stride_ll, G, DV, True)


_SAAP_LAUNCH = KernelLauncher(_saap_kernel)


def saap_workspace(num_splits: int, q: torch.Tensor, v: torch.Tensor, hkv: int, clusters: int):
    """What ``num_splits`` programs per tile need: partial o (S, B, Hq, L, Dv) fp32, partial lse (S, B, Hq, L) fp32
    and the per-program cluster tables (S, B * Hkv * num_m, 2, BLOCK_C) int32."""
    B, Hq, L, _ = q.shape
    num_m = cdiv((Hq // hkv) * L, block_m_for((Hq // hkv) * L))
    return (torch.empty((num_splits, B, Hq, L, v.shape[-1]), device=q.device, dtype=torch.float32),
            torch.empty((num_splits, B, Hq, L), device=q.device, dtype=torch.float32),
            torch.empty((num_splits, B * hkv * num_m, 2, _block_c(clusters)), device=q.device, dtype=torch.int32))


def _block_c(clusters: int) -> int:
    return max(16, next_pow2(clusters))


def saap_decode_kernel(q, k, v, scores, offsets, perm, indexed_end, out, lse=None, *, probes, sink, scale=None,
                       valid_len=None, num_splits=8, block_n=64, num_warps=4, num_stages=2, workspace=None):
    """Launch SAAP decode into ``out`` (and ``lse``): the kernel, then ``merge_states`` over the splits.

    Parameters
    ----------
    q : (B, Hq, L, D) fp16/bf16/fp32; k : (B, Hkv, N, D); v : (B, Hkv, N, Dv), same dtype, any strides.
    scores : (B, Hkv, C) fp32 cluster scores (summed over the group's heads and the L tokens).
    offsets : (B, Hkv, C + 1) int32 CSR offsets; perm : (B, Hkv, NP) int32 cluster-sorted key positions.
    indexed_end : (B,) int32: keys [indexed_end, kv_len) are attended densely (with the sink [0, sink)).
    out : (B, Hq, L, Dv) any float dtype; lse : (B, Hq, L) fp32 or None.
    valid_len : (B,) int tensor or None (keys from valid_len on do not exist).
    workspace : the triple from ``saap_workspace`` (allocated here when None).
    """
    B, Hq, L, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    Dv = v.shape[-1]
    C = scores.shape[-1]
    G = Hq // Hkv
    BLOCK_M = block_m_for(G * L)
    num_m = cdiv(G * L, BLOCK_M)
    probes = max(1, min(int(probes), C))
    ws_o, ws_lse, scratch = workspace if workspace is not None else saap_workspace(num_splits, q, v, Hkv, C)
    block_c = _block_c(C)
    upcast, precision = dot_flags(q.dtype)
    has_valid = valid_len is not None
    _SAAP_LAUNCH(
        (num_splits, B * Hkv * num_m), q, k, v, scores, offsets, perm, indexed_end,
        valid_len if has_valid else indexed_end, ws_o, ws_lse, scratch,
        *q.stride(), *k.stride(), *v.stride(), *scores.stride(), *offsets.stride(), *perm.stride(),
        *ws_o.stride(), *ws_lse.stride(), softmax_scale(scale, D), N, L, G, Hkv, num_m, C, probes, int(sink),
        num_splits, D=D, DV=Dv, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_D=block_d_for(D), BLOCK_DV=block_d_for(Dv),
        BLOCK_C=block_c, SEARCH_STEPS=block_c.bit_length(), HAS_VALID=has_valid, UPCAST=upcast,
        PRECISION=precision, num_warps=num_warps, num_stages=num_stages,
    )
    merge_states(ws_o, ws_lse, out=out, lse_out=lse if lse is not None else False)
    return out, lse
