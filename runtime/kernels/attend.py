"""The KV-tile loop of the decode kernels: the packed query tile, the online softmax over K/V tiles with masks,
and its head-chunked form for head dims that are not a power of two.

Scores, row maxima and LSEs are in natural-log units, rounded as the original rounds them: the scaled score
``fl(qk * scale)``, plus the bias ``fl(s + bias)``. Only differences from the row max are scaled by log2(e) for
``exp2``. (Base-2 scores, ``qk * scale * log2(e) + bias * log2(e)``, round a large bias differently: a row that a
finite bias such as -1e9 hides whole ties keys the original tells apart, and the output moved by up to 1.8.) Every
difference is taken between rounded values before any scaling: a scaled value minus a rounded maximum is contracted
into one FMA by the compiler, whose residual (up to 1e31 next to finfo.min) gave inf weights and NaN on the H100
while the interpreter was exact. Empty rows (no visible key) give o = 0 and lse = -inf.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .tile_ops import _per_key, _per_row, _pv_update, _prefetch_tile_l2, _qk_dot


@triton.jit
def _row_coords(mb, L, G, BLOCK_M: tl.constexpr):
    """Packed rows of M block ``mb``: (row index within the KV head, g, i, row valid)."""
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)  # packed row r = g * L + i
    g = rows // L  # query head within the group
    i = rows % L  # query position
    return rows, g, i, rows < G * L


@triton.jit
def _load_q(q_ptr, b, kvh, g, i, row_ok, offs_d, stride_qb, stride_qh, stride_ql, stride_qd, G, D,
            UPCAST: tl.constexpr, T: tl.constexpr = False):
    """The packed query tile (BLOCK_M, BLOCK_D) of KV head ``kvh`` in batch row ``b``; T: transposed, (BLOCK_D,
    BLOCK_M) (swap-AB, ``tile_ops``)."""
    h = kvh * G + g
    ptrs = (q_ptr + b.to(tl.int64) * stride_qb + _per_row(h.to(tl.int64), T) * stride_qh
            + _per_row(i.to(tl.int64), T) * stride_ql + _per_key(offs_d.to(tl.int64), T) * stride_qd)
    q = tl.load(ptrs, mask=_per_row(row_ok, T) & _per_key(offs_d < D, T), other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    return q


@triton.jit
def _attend(q, acc, m_i, l_i, lo, hi, kv_len,
            k_ptr, v_ptr, k_desc, v_desc, mask_ptr, b, kvh, g, i, row_ok, offs_d, offs_dv,
            stride_kb, stride_kh, stride_kn, stride_kd,
            stride_vb, stride_vh, stride_vn, stride_vd,
            stride_mb, stride_mh, stride_ml, stride_mn,
            sm_scale, G, D, DV,
            BLOCK_N: tl.constexpr, MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr,
            UPCAST: tl.constexpr, PRECISION: tl.constexpr, USE_TMA: tl.constexpr = False,
            kv_first=0, softcap=0.0, HAS_START: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
            alibi_ptr=0, ALIBI: tl.constexpr = False):
    """Online softmax of the query tile over keys [lo, hi) (hi <= kv_len is not required; keys >= kv_len are
    masked). Updates and returns (acc (BLOCK_M, BLOCK_DV) fp32, m_i (BLOCK_M,) natural-log max, l_i (BLOCK_M,) sum).
    :func:`_attend_chunks` with the head dim in one (padded) chunk; see there for the arguments."""
    acc, _, m_i, l_i = _attend_chunks(
        q, q, acc, acc, m_i, l_i, lo, hi, kv_len, k_ptr, v_ptr, k_desc, v_desc, k_desc, v_desc, mask_ptr, b, kvh, g,
        i, row_ok, offs_d, offs_dv, offs_d, stride_kb, stride_kh, stride_kn, stride_kd, stride_vb, stride_vh,
        stride_vn, stride_vd, stride_mb, stride_mh, stride_ml, stride_mn, sm_scale, G, D, DV, BLOCK_N, MASK_KIND,
        IS_CAUSAL, UPCAST, PRECISION, USE_TMA, kv_first, softcap, HAS_START, SOFTCAP, alibi_ptr, ALIBI, 0)
    return acc, m_i, l_i


@triton.jit
def _attend_chunks(q, q_hi, acc, acc_hi, m_i, l_i, lo, hi, kv_len,
                   k_ptr, v_ptr, k_desc, v_desc, k_hi_desc, v_hi_desc, mask_ptr, b, kvh, g, i, row_ok,
                   offs_d, offs_dv, offs_hi,
                   stride_kb, stride_kh, stride_kn, stride_kd,
                   stride_vb, stride_vh, stride_vn, stride_vd,
                   stride_mb, stride_mh, stride_ml, stride_mn,
                   sm_scale, G, D, DV,
                   BLOCK_N: tl.constexpr, MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr,
                   UPCAST: tl.constexpr, PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
                   kv_first, softcap, HAS_START: tl.constexpr, SOFTCAP: tl.constexpr,
                   alibi_ptr, ALIBI: tl.constexpr, D_LO: tl.constexpr, PAST_ZERO: tl.constexpr = False,
                   SWAP_AB: tl.constexpr = False, PREFETCH: tl.constexpr = 0, PREFETCH_BULK: tl.constexpr = True):
    """Online softmax of the query tile over keys [lo, hi) (hi <= kv_len is not required; keys >= kv_len are
    masked). Returns (acc, acc_hi, m_i (BLOCK_M,) natural-log max, l_i (BLOCK_M,) sum).

    D_LO = 0: the head dims in one chunk each, padded to a power of two: q (BLOCK_M, BLOCK_D) and acc (BLOCK_M,
    BLOCK_DV), columns ``offs_d``/``offs_dv`` (masked past D/DV); ``q_hi``, ``acc_hi``, ``offs_hi`` and the hi
    descriptors are not read (acc_hi comes back as given).
    D_LO > 0 (D == DV, cut by ``common.head_dim_split``): columns [0, D_LO) in q (BLOCK_M, D_LO) and acc (BLOCK_M,
    D_LO) (``offs_d`` = ``offs_dv`` = arange(D_LO)), the next ones in q_hi and acc_hi (BLOCK_M, D_HI) (``offs_hi`` =
    D_LO + arange(D_HI), masked past D); Q.K is the sum of the two chunks' dots and P.V goes to the two
    accumulators, so D=80 runs 96 wide, not 128.

    USE_TMA: K/V tiles come through the tensor descriptors ``k_desc``/``v_desc`` (4-D, block (1, 1, BLOCK_N, the
    chunk's width); the hi chunk's through ``k_hi_desc``/``v_hi_desc``, descriptors of K[..., D_LO:] and V[...,
    D_LO:]) as bulk copies; rows past the tensor and padded dims arrive as zeros. Else through pointers.

    A bulk copy reads a tile's rows past ``kv_len`` from the tensor as they are (a sharded cache's spare capacity,
    a static cache's unused tail: any bits, NaN included), and a hidden key's zero weight times a NaN value is
    NaN. So the one tile that crosses ``kv_len`` (the only one past it with a visible key) has its V rows past it
    zeroed after the copy (its K rows' scores are hidden anyway); the whole tiles below it need no such step. (That
    tile went by masked pointer loads before: their pointer tiles cost registers, ptxas sm_90 bf16 D=80 padded,
    128-key tiles: 1224 bytes of spills, none with the copy.)
    PAST_ZERO (with USE_TMA): ``kv_len`` is the descriptors' own key count (no valid length, no causal cut), so the
    copy engine fills the rows past it with zeros and the crossing tile runs inside the pipelined loop. Run after
    the loop, its copy starts only when the loop ends: one exposed HBM round trip per program, which a growing
    cache pays at almost every length (H100, B=7 4/2 heads D=96, 8 splits of 128-key tiles: 13.29 µs at 4096 keys,
    four whole tiles a split, and 14.03 at 3264, three and the crossing one; A/B at cabea51, CUDA graphs, L2
    rotated: 14.14 µs after the loop, 12.34 in it, cuDNN 13.33-13.40). The step's second copy also held
    registers: ptxas sm_90, bf16, 16 rows, 4 warps, 128-key tiles: D=96 padded 3 stages 255 registers and 4 bytes of
    spills with the tile after the loop, 182 and none in it; D=96 in chunks 236 and 191; D=128 64-key tiles 188 and
    149.

    HAS_START: keys before ``kv_first`` do not exist (a sliding window's first key; ``lo`` may be a tile below
    it). SOFTCAP: the scores are ``softcap * tanh(qk * sm_scale)`` (see :func:`_scores`). ALIBI: the scores get
    ``slope[h] * j`` for key position j, slopes (Hq,) at ``alibi_ptr`` (after the cap, before the mask).

    SWAP_AB: the products run as ``K @ Q^T`` and ``V^T @ P^T``, ``acc``/``acc_hi`` carried transposed, (dv,
    BLOCK_M) (``tile_ops``). PREFETCH > 0: the K/V rows that many tiles ahead are prefetched into L2, in one bulk
    request per tensor (PREFETCH_BULK) or line by line (``tile_ops``; rows contiguous, compiled CUDA only)."""
    k_base = k_ptr + b.to(tl.int64) * stride_kb + kvh.to(tl.int64) * stride_kh
    v_base = v_ptr + b.to(tl.int64) * stride_vb + kvh.to(tl.int64) * stride_vh
    h64 = (kvh * G + g).to(tl.int64)
    i64 = i.to(tl.int64)
    # ALiBi's slope of each query row, loaded once for all tiles (it was loaded again in every tile of the KV loop)
    slope = i.to(tl.float32) * 0.0
    if ALIBI:
        slope = tl.load(alibi_ptr + h64, mask=row_ok, other=0.0).to(tl.float32)
    # TMA reads whole tiles: its loop stops before the tile that crosses kv_len, which runs once after it
    loop_end = hi
    tail = False
    if USE_TMA and not PAST_ZERO:
        end = tl.minimum(hi, kv_len)
        loop_end = lo + tl.maximum(end - lo, 0) // BLOCK_N * BLOCK_N
        tail = loop_end < end
    pf_end = tl.minimum(hi, kv_len)
    if PREFETCH > 0:  # the tiles the pipeline's first copies do not cover yet
        for t in tl.static_range(1, PREFETCH):
            _prefetch_tile_l2(k_base, v_base, lo + t * BLOCK_N, pf_end, stride_kn, stride_vn, BLOCK_N,
                              PREFETCH_BULK)
    for start_n in range(lo, loop_end, BLOCK_N):
        if PREFETCH > 0:
            _prefetch_tile_l2(k_base, v_base, start_n + PREFETCH * BLOCK_N, pf_end, stride_kn, stride_vn, BLOCK_N,
                              PREFETCH_BULK)
        acc, acc_hi, m_i, l_i = _attend_step(
            q, q_hi, acc, acc_hi, m_i, l_i, start_n, kv_len, k_base, v_base, k_desc, v_desc, k_hi_desc,
            v_hi_desc, mask_ptr, b, kvh, h64, i, i64, row_ok, offs_d, offs_dv, offs_hi, stride_kn, stride_kd,
            stride_vn, stride_vd, stride_mb, stride_mh, stride_ml, stride_mn, sm_scale, D, DV, BLOCK_N, MASK_KIND,
            IS_CAUSAL, UPCAST, PRECISION, USE_TMA, kv_first, softcap, HAS_START, SOFTCAP, slope, ALIBI, D_LO,
            SWAP_AB=SWAP_AB)
    if tail:
        # the tile that crosses kv_len (its V rows past kv_len zeroed where they come by the copy engine):
        # straight-line code, so it adds no pipeline buffers (a second pipelined loop doubled the shared memory);
        # tiles wholly past kv_len hold no visible key
        acc, acc_hi, m_i, l_i = _attend_step(
            q, q_hi, acc, acc_hi, m_i, l_i, loop_end, kv_len, k_base, v_base, k_desc, v_desc, k_hi_desc, v_hi_desc,
            mask_ptr, b, kvh, h64, i, i64, row_ok, offs_d, offs_dv, offs_hi, stride_kn, stride_kd, stride_vn,
            stride_vd, stride_mb, stride_mh, stride_ml, stride_mn, sm_scale, D, DV, BLOCK_N, MASK_KIND, IS_CAUSAL,
            UPCAST, PRECISION, USE_TMA, kv_first, softcap, HAS_START, SOFTCAP, slope, ALIBI, D_LO, False, USE_TMA,
            SWAP_AB)
    return acc, acc_hi, m_i, l_i


@triton.jit
def _attend_step(q, q_hi, acc, acc_hi, m_i, l_i, start_n, kv_len,
                 k_base, v_base, k_desc, v_desc, k_hi_desc, v_hi_desc, mask_ptr, b, kvh, h64, i, i64, row_ok,
                 offs_d, offs_dv, offs_hi,
                 stride_kn, stride_kd, stride_vn, stride_vd, stride_mb, stride_mh, stride_ml, stride_mn,
                 sm_scale, D, DV,
                 BLOCK_N: tl.constexpr, MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr,
                 UPCAST: tl.constexpr, PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
                 kv_first, softcap, HAS_START: tl.constexpr, SOFTCAP: tl.constexpr, slope,
                 ALIBI: tl.constexpr, D_LO: tl.constexpr, MASK_ROW: tl.constexpr = False,
                 ZERO_PAST: tl.constexpr = False, SWAP_AB: tl.constexpr = False):
    """One KV tile of :func:`_attend_chunks` (keys from ``start_n`` below ``kv_len``; the arguments of
    :func:`_attend_tile`): returns (acc, acc_hi, m_i, l_i)."""
    if D_LO > 0:
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < kv_len
        n64 = offs_n.to(tl.int64)
        k, v = _kv_tile(k_base, v_base, k_desc, v_desc, b, kvh, start_n, n_ok, n64, offs_d, offs_dv,
                        stride_kn, stride_kd, stride_vn, stride_vd, D, DV, UPCAST, USE_TMA, ZERO_PAST)
        k_hi, v_hi = _kv_tile(k_base, v_base, k_hi_desc, v_hi_desc, b, kvh, start_n, n_ok, n64, offs_hi, offs_hi,
                              stride_kn, stride_kd, stride_vn, stride_vd, D, DV, UPCAST, USE_TMA, ZERO_PAST)
        qk = _qk_dot(q, k, q_hi, k_hi, True, PRECISION, SWAP_AB)
        s, visible = _visible_scores(qk, start_n, kv_len, mask_ptr, b, h64, i, i64, row_ok, stride_mb, stride_mh,
                                     stride_ml, stride_mn, sm_scale, BLOCK_N, MASK_KIND, IS_CAUSAL, kv_first,
                                     softcap, HAS_START, SOFTCAP, slope, ALIBI, MASK_ROW, SWAP_AB)
        p, alpha, m_i, l_i = _online_weights(m_i, l_i, s, visible, SWAP_AB)
        acc = _pv_update(acc, alpha, p, v, UPCAST, PRECISION, SWAP_AB)
        acc_hi = _pv_update(acc_hi, alpha, p, v_hi, UPCAST, PRECISION, SWAP_AB)
    else:
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, start_n, kv_len, k_base, v_base, k_desc, v_desc, mask_ptr, b, kvh, h64, i, i64,
            row_ok, offs_d, offs_dv, stride_kn, stride_kd, stride_vn, stride_vd, stride_mb, stride_mh, stride_ml,
            stride_mn, sm_scale, D, DV, BLOCK_N, MASK_KIND, IS_CAUSAL, UPCAST, PRECISION, USE_TMA,
            kv_first, softcap, HAS_START, SOFTCAP, slope, ALIBI, MASK_ROW, ZERO_PAST, SWAP_AB)
    return acc, acc_hi, m_i, l_i


@triton.jit
def _attend_tile(q, acc, m_i, l_i, start_n, kv_len,
                 k_base, v_base, k_desc, v_desc, mask_ptr, b, kvh, h64, i, i64, row_ok, offs_d, offs_dv,
                 stride_kn, stride_kd, stride_vn, stride_vd, stride_mb, stride_mh, stride_ml, stride_mn,
                 sm_scale, D, DV,
                 BLOCK_N: tl.constexpr, MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr,
                 UPCAST: tl.constexpr, PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
                 kv_first, softcap, HAS_START: tl.constexpr, SOFTCAP: tl.constexpr, slope,
                 ALIBI: tl.constexpr, MASK_ROW: tl.constexpr = False, ZERO_PAST: tl.constexpr = False,
                 SWAP_AB: tl.constexpr = False):
    """One KV tile [start_n, start_n + BLOCK_N) of :func:`_attend` (``k_base``/``v_base``: this (batch row, KV
    head)'s K/V pointers; ``h64``, ``i64``: the query rows' heads and positions as int64; ``slope``: ALiBi's slope
    of each query row (BLOCK_M,) fp32). MASK_ROW: the mask is one row per batch row (broadcast over heads and
    queries): one (BLOCK_N,) load, not a (BLOCK_M, BLOCK_N) tile of pointers (registers)."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k, v = _kv_tile(k_base, v_base, k_desc, v_desc, b, kvh, start_n, offs_n < kv_len, offs_n.to(tl.int64), offs_d,
                    offs_dv, stride_kn, stride_kd, stride_vn, stride_vd, D, DV, UPCAST, USE_TMA, ZERO_PAST)
    s, visible = _visible_scores(_qk_dot(q, k, q, k, False, PRECISION, SWAP_AB), start_n, kv_len, mask_ptr, b,
                                 h64, i, i64, row_ok, stride_mb, stride_mh, stride_ml, stride_mn, sm_scale, BLOCK_N,
                                 MASK_KIND, IS_CAUSAL, kv_first, softcap, HAS_START, SOFTCAP, slope, ALIBI, MASK_ROW,
                                 SWAP_AB)
    return _softmax_update(acc, m_i, l_i, s, visible, v, UPCAST, PRECISION, SWAP_AB)


@triton.jit
def _kv_tile(k_base, v_base, k_desc, v_desc, b, kvh, start_n, n_ok, n64, offs_d, offs_dv,
             stride_kn, stride_kd, stride_vn, stride_vd, D, DV, UPCAST: tl.constexpr, USE_TMA: tl.constexpr,
             ZERO_PAST: tl.constexpr = False):
    """The K (BLOCK_N, len(offs_d)) and V (BLOCK_N, len(offs_dv)) columns ``offs_d``/``offs_dv`` of the KV tile at
    ``start_n`` (keys ``n64``, read where ``n_ok``): by the copy engine (USE_TMA: the descriptors' boxes cover those
    columns; ZERO_PAST: V's rows where not ``n_ok`` are zeroed, whatever the tensor holds there) or by pointer
    loads (zeros where not ``n_ok``)."""
    if USE_TMA:
        k = k_desc.load([b, kvh, start_n, 0]).reshape(n64.shape[0], offs_d.shape[0])
        v = v_desc.load([b, kvh, start_n, 0]).reshape(n64.shape[0], offs_dv.shape[0])
        if ZERO_PAST:
            v = tl.where(n_ok[:, None], v, 0.0)
    else:
        # K/V are read once: evict_first keeps them from pushing the (reused) Q, mask and partials out of L2
        k = tl.load(k_base + n64[:, None] * stride_kn + offs_d.to(tl.int64)[None, :] * stride_kd,
                    mask=n_ok[:, None] & (offs_d[None, :] < D), other=0.0, eviction_policy="evict_first")
        v = tl.load(v_base + n64[:, None] * stride_vn + offs_dv.to(tl.int64)[None, :] * stride_vd,
                    mask=n_ok[:, None] & (offs_dv[None, :] < DV), other=0.0, eviction_policy="evict_first")
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def _visible_scores(qk, start_n, kv_len, mask_ptr, b, h64, i, i64, row_ok, stride_mb, stride_mh, stride_ml,
                    stride_mn, sm_scale, BLOCK_N: tl.constexpr, MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr,
                    kv_first, softcap, HAS_START: tl.constexpr, SOFTCAP: tl.constexpr, slope, ALIBI: tl.constexpr,
                    MASK_ROW: tl.constexpr, T: tl.constexpr = False):
    """The natural-log scores (BLOCK_M, BLOCK_N) of the KV tile at ``start_n`` from its dot products ``qk``, and
    which of them are visible (see :func:`_attend_tile` for the arguments); T: ``qk`` and both results transposed,
    (BLOCK_N, BLOCK_M) (swap-AB)."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    n_ok = offs_n < kv_len
    n64 = offs_n.to(tl.int64)
    s = _scores(qk, sm_scale, softcap, SOFTCAP)
    if ALIBI:  # a per-head slope times the key position, rounded as the original's fp32 ``slopes * arange``
        s = s + _per_row(slope, T) * _per_key(offs_n.to(tl.float32), T)
    if HAS_START:
        n_ok = n_ok & (offs_n >= kv_first)
    visible = _per_key(n_ok, T) & _per_row(row_ok, T)
    if IS_CAUSAL:
        visible = visible & (_per_key(offs_n, T) <= _per_row(i, T))  # top-left: query i sees keys j <= i
    if MASK_KIND == 1 and MASK_ROW:
        mv = tl.load(mask_ptr + b.to(tl.int64) * stride_mb + n64 * stride_mn, mask=n_ok, other=0)
        visible = visible & _per_key(mv != 0, T)
    elif MASK_KIND == 1:
        mv = tl.load(mask_ptr + b.to(tl.int64) * stride_mb + _per_row(h64, T) * stride_mh
                     + _per_row(i64, T) * stride_ml + _per_key(n64, T) * stride_mn, mask=visible, other=0)
        visible = visible & (mv != 0)
    if MASK_KIND == 2 and MASK_ROW:
        s = s + _per_key(tl.load(mask_ptr + b.to(tl.int64) * stride_mb + n64 * stride_mn, mask=n_ok,
                                 other=0.0).to(tl.float32), T)
    elif MASK_KIND == 2:
        mv = tl.load(mask_ptr + b.to(tl.int64) * stride_mb + _per_row(h64, T) * stride_mh
                     + _per_row(i64, T) * stride_ml + _per_key(n64, T) * stride_mn, mask=visible,
                     other=0.0).to(tl.float32)
        # natural units, rounded as the original's ``scores + mask`` (see the module docstring); finfo.min absorbs
        # the scores (a row it hides whole ties every key: the mean of V, as the original)
        s = s + mv
    return s, visible


@triton.jit
def _scores(qk, sm_scale, softcap, SOFTCAP: tl.constexpr):
    """Scores (natural units) of the dot products ``qk``: ``qk * sm_scale``; SOFTCAP: ``softcap * tanh(qk *
    sm_scale)``. tanh is written with exp2, stable for any x (libdevice's tanh does not run in the interpreter):
    tanh(x) = sign(x) (1 - e) / (1 + e), e = exp(-2 |x|)."""
    x = qk * sm_scale
    if SOFTCAP:
        e = tl.exp2(tl.abs(x) * -2.8853900817779268)  # exp(-2 |x|) = 2^(-2 log2(e) |x|)
        t = (1.0 - e) / (1.0 + e)
        x = tl.where(x < 0, -t, t) * softcap
    return x


@triton.jit
def _split_share(split, n, num_splits, BLOCK_N: tl.constexpr):
    """Keys [lo, hi) of split ``split`` of ``n`` keys: tiles [s * T // S, (s + 1) * T // S) of the T tiles. Shares
    differ by at most one tile (equal ceil(T / S) shares left the last splits short or empty)."""
    n_tiles = tl.cdiv(n, BLOCK_N)
    lo = (split.to(tl.int64) * n_tiles // num_splits).to(tl.int32) * BLOCK_N
    hi = tl.minimum(((split.to(tl.int64) + 1) * n_tiles // num_splits).to(tl.int32) * BLOCK_N, n)
    return lo, hi


@triton.jit
def _softmax_update(acc, m_i, l_i, s, visible, v, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                    SWAP_AB: tl.constexpr = False):
    """One online-softmax step: fold the tile's natural-log scores ``s`` (BLOCK_M, BLOCK_N), hidden where ``visible``
    is False, and its values ``v`` (BLOCK_N, BLOCK_DV) into (acc, m_i, l_i). Returns the new (acc, m_i, l_i).
    Differences from the max are taken in natural units, then scaled by log2(e) for ``exp2``. SWAP_AB: acc is
    (BLOCK_DV, BLOCK_M) (``tile_ops._pv_update``)."""
    p, alpha, m_new, l_i = _online_weights(m_i, l_i, s, visible, SWAP_AB)
    return _pv_update(acc, alpha, p, v, UPCAST, PRECISION, SWAP_AB), m_new, l_i


@triton.jit
def _online_weights(m_i, l_i, s, visible, T: tl.constexpr = False):
    """The weights of one online-softmax step: (p (BLOCK_M, BLOCK_N) fp32 weights of the tile's keys, alpha
    (BLOCK_M,) the factor on the state so far, the new row max, the new row sum) (see :func:`_softmax_update`); T:
    ``s``, ``visible`` and ``p`` transposed, (BLOCK_N, BLOCK_M)."""
    s = tl.where(visible, s, float("-inf"))
    if T:
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
    else:
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # empty rows so far: no NaN from -inf - -inf
    alpha = tl.exp2((m_i - m_use) * 1.4426950408889634)
    p = tl.exp2((s - _per_row(m_use, T)) * 1.4426950408889634)
    if T:
        l_new = l_i * alpha + tl.sum(p, axis=0)
    else:
        l_new = l_i * alpha + tl.sum(p, axis=1)
    return p, alpha, m_new, l_new
