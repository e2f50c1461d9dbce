"""SAAP top-l selection on the device: from the cluster logits (or given scores) of one (batch row, KV head), the
threshold of the top ``probes`` scores and the work list the attention launch reads.

``_select_head`` runs in its own launch (``_saap_select_kernel``, one program per (batch row, KV head)) or as the
tail of the fused scoring launch (``saap_select._saap_rows_kernel``, its last chunk program per head). It computes
the group-summed cluster distribution (``sum over rows of exp(logit - lse_row)``, the reference's
``softmax(...).sum``), ranks it on the top ``saap_rule.SELECT_KEY_BITS`` bits of each score's order-preserving key,
finds the ``probes``-th largest key by a radix select (rounds of RADIX_BITS bits, each one ``tl.histogram`` of the
next digit: no sort and no compare per candidate digit; it stops once the keys at or above the threshold so far are
exactly ``probes``), and writes the work list: the chosen non-empty clusters in cluster order, compacted, with their
inclusive key prefix (padding: INT32_MAX) and ``perm`` shift, plus the number of keys they hold. It also adds the
call's selectivity to a device-side accumulator.

The pick is exactly ``min(probes, C)`` clusters: every key above the threshold and, of the keys equal to it, the
lowest cluster indices (:func:`runtime.kernels.saap_rule.top_clusters` is the same rule in PyTorch).
"""
from __future__ import annotations

import triton
import triton.language as tl

try:  # grid dependency control (programmatic dependent launch); absent from older Tritons
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - then pdl_supported() is False and the branches are never compiled
    gdc_launch_dependents = gdc_wait = None

from .common import next_pow2
from .saap_tiles import _prefetch_l2


@triton.jit
def _add_pair(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@triton.jit
def _add_quad(a0, a1, a2, a3, b0, b1, b2, b3):
    return a0 + b0, a1 + b1, a2 + b2, a3 + b3


@triton.jit
def _max_quad(a0, a1, a2, a3, b0, b1, b2, b3):
    return tl.maximum(a0, b0), tl.maximum(a1, b1), tl.maximum(a2, b2), tl.maximum(a3, b3)


@triton.jit
def _select_head(bh, score_ptr, stat_ptr, offsets_ptr, end_ptr, valid_ptr, incl_ptr, shift_ptr, total_ptr, stats_ptr,
                 stride_sb, stride_sh, stride_sc, stride_fb, stride_fh, stride_fc, N, HKV, M, C, NCHUNK, PROBES, SINK,
                 inv_heads, BLOCK_C: tl.constexpr, BLOCK_CH: tl.constexpr, ROWS: tl.constexpr,
                 RADIX_BITS: tl.constexpr, FROM_LOGITS: tl.constexpr, HAS_VALID: tl.constexpr,
                 HAS_STATS: tl.constexpr, WAIT_PRIOR: tl.constexpr, SKIP: tl.constexpr = 0,
                 GUESS_TOP: tl.constexpr = False, perm_ptr=None, stride_pb=0, stride_ph=0, stride_pn=0,
                 PERM_LINES: tl.constexpr = 0, KEY_BITS: tl.constexpr = 16, RELAXED_STATS: tl.constexpr = True):
    """The selection of one (batch row, KV head) ``bh``: see ``_saap_select_kernel`` for the arguments. The logits and
    their statistics are read past L1 (``.cg``): in the fused scoring launch another program wrote them in this very
    launch. SKIP (the piece microbenchmark's ablations, never a plan's): 1 leaves out the threshold rounds (every
    non-empty cluster is chosen), 2 also the compaction (only the key total is stored). KEY_BITS: the top bits of
    each score's key that rank it (``saap_rule.SELECT_KEY_BITS``: the rule; another value only to time it).
    RELAXED_STATS: the selectivity sums' atomics without ordering (else acq_rel, each behind a GPU-wide fence).
    GUESS_TOP (RADIX_BITS 4): the first round's digit from one packed count where every score is in [0, 2).
    PERM_LINES > 0 (compiled code only): once the set is known, ask L2 for the first PERM_LINES 128-byte lines of each chosen cluster's keys in
    ``perm`` (int32; strides stride_pb/ph/pn), which the attention's first tiles read next."""
    b = bh // HKV
    kvh = bh % HKV
    b64 = b.to(tl.int64)
    kvh64 = kvh.to(tl.int64)
    offs_c = tl.arange(0, BLOCK_C)
    c_ok = offs_c < C
    # the cluster sizes first: their loads overlap the scores' arithmetic
    f_base = offsets_ptr + b64 * stride_fb + kvh64 * stride_fh
    c_start = tl.load(f_base + offs_c.to(tl.int64) * stride_fc, mask=c_ok, other=0)
    c_end = tl.load(f_base + (offs_c + 1).to(tl.int64) * stride_fc, mask=c_ok, other=0)
    if HAS_STATS:  # the lengths too (inputs, not the scoring's): loaded at the end, they held the program's exit
        kv_len = N
        if HAS_VALID:
            kv_len = tl.maximum(tl.minimum(tl.load(valid_ptr + b).to(tl.int32), N), 0)
        window_keys = tl.maximum(kv_len - tl.load(end_ptr + b), 0)
    if WAIT_PRIOR:
        gdc_wait()  # the offsets come from the prefill; the logits from the scoring launch, complete from here on
    if FROM_LOGITS:
        offs_ch = tl.arange(0, BLOCK_CH)
        score = tl.zeros([BLOCK_C], dtype=tl.float32)
        for m0 in range(0, M, ROWS):  # ROWS rows at a time: their loads are in flight together
            offs_m = m0 + tl.arange(0, ROWS)
            m_ok = offs_m < M
            row = bh.to(tl.int64) * M + offs_m
            stat = stat_ptr + (row[:, None] * NCHUNK + offs_ch[None, :]) * 2
            s_ok = m_ok[:, None] & (offs_ch[None, :] < NCHUNK)
            # the logits load with the statistics, before the normaliser's reductions (their barriers would keep
            # sm_90 from issuing them early: two L2 round trips in a row)
            logit = tl.load(score_ptr + row[:, None] * C + offs_c[None, :], mask=m_ok[:, None] & c_ok[None, :],
                            other=float("-inf"), cache_modifier=".cg")
            cmax = tl.load(stat, mask=s_ok, other=float("-inf"), cache_modifier=".cg")
            csum = tl.load(stat + 1, mask=s_ok, other=0.0, cache_modifier=".cg")
            mx = tl.where(m_ok, tl.max(cmax, axis=1), 0.0)
            lse = mx + tl.log(tl.where(m_ok, tl.sum(csum * tl.exp(cmax - mx[:, None]), axis=1), 1.0))
            score += tl.sum(tl.exp(logit - lse[:, None]), axis=0)
    else:
        score = tl.load(score_ptr + b64 * stride_sb + kvh64 * stride_sh + offs_c.to(tl.int64) * stride_sc,
                        mask=c_ok, other=0.0)
    score = tl.where(score == 0.0, 0.0, score)  # -0.0 and 0.0 tie, as they compare in the reference
    # order-preserving unsigned key of each float (negative floats: magnitude bits flipped; then the sign bit
    # flipped), cut to its top KEY_BITS bits (``saap_rule.selection_keys``); then the largest threshold with at least
    # PROBES keys at or above it, RADIX_BITS per round: one histogram of the keys' next digit (keys whose higher bits
    # already differ from the threshold's go to two extra bins) gives the count at or above every candidate digit at
    # once. Padding is key 0, below every float but NaN (its count is taken off below where the threshold is 0).
    bits = score.to(tl.int32, bitcast=True)
    key = (bits ^ ((bits >> 31) & 0x7FFFFFFF) ^ -2147483648).to(tl.uint32, bitcast=True) >> (32 - KEY_BITS)
    key = tl.where(c_ok, key, 0)
    NB: tl.constexpr = 1 << RADIX_BITS
    bins = tl.arange(0, 2 * NB)
    thr = tl.zeros([1], dtype=tl.uint32).sum(axis=0)
    # keys at or above the threshold so far (all of them at threshold 0)
    n_ge = tl.zeros([1], dtype=tl.int32).sum(axis=0) + BLOCK_C
    n_tie = n_ge * 0  # keys equal to the threshold, once the last round ran (else no tie is left out)
    # Early exit: once the keys at or above the threshold so far number exactly PROBES, the remaining rounds would
    # only raise it to the least of those keys, which selects the same set; a round is a chain of reductions on one
    # SM.
    open_rounds = tl.zeros([1], dtype=tl.int32).sum(axis=0) + 1
    first_round = open_rounds
    if GUESS_TOP:
        # Non-negative scores below 2 (every softmax sum of one row) all have the top digit 0b1011 (the sign bit
        # flipped, the exponent below 128), so the first 4-bit round almost never tells them apart: one packed
        # count of the keys at or above 0b1100 and 0b1011 (then fewer and at least PROBES) picks its digit in its
        # stead, with the same outcome; otherwise the round runs.
        TOP: tl.constexpr = KEY_BITS - 4
        n_high = (key >= (0xC << TOP)).to(tl.int32)
        n_top = (key >= (0xB << TOP)).to(tl.int32)
        counts = tl.sum(n_high * (BLOCK_C + 1) + n_top, axis=0)
        n_high = counts // (BLOCK_C + 1)
        n_top = counts % (BLOCK_C + 1)
        guessed = (n_high < PROBES) & (n_top >= PROBES)
        thr = tl.where(guessed, 0xB << TOP, thr).to(tl.uint32)
        n_ge = tl.where(guessed, n_top, n_ge)
        open_rounds = tl.where(guessed, (n_top != PROBES).to(tl.int32), open_rounds)
        first_round = tl.where(guessed, 0, 1)
    if SKIP > 0:
        open_rounds = open_rounds * 0
        first_round = first_round * 0
    for rnd in tl.static_range(KEY_BITS // RADIX_BITS):
        run = open_rounds
        if rnd == 0:
            run = first_round
        if run != 0:
            shift = KEY_BITS - RADIX_BITS * (rnd + 1)
            # digit d in bin d + 1; keys whose higher bits are above the threshold's so far in bin NB + 1, below in
            # bin 0
            digit = ((key >> shift) & (NB - 1)).to(tl.int32) + 1
            if rnd > 0:
                higher = key >> (shift + RADIX_BITS)
                prefix = thr >> (shift + RADIX_BITS)
                digit = tl.where(higher == prefix, digit, tl.where(higher > prefix, NB + 1, 0))
            hist = tl.histogram(digit, 2 * NB)
            # keys >= thr + ((bin - 1) << shift): two sums and a forward scan; one reverse scan of the histogram
            # counts the same but took 0.5 µs longer a selection on the H100 (54c807b, llama3-8b 128k 5 %: 8.42 µs
            # alone against 7.88), and rounds by comparison (the keys at or above each candidate digit, one
            # reduction of a (2048, 8) table of paired 16-bit counts) 1.3 µs longer (80da12a: 9.16 against 7.82)
            above = tl.sum(tl.where(bins == NB + 1, hist, 0), axis=0)
            same = tl.where((bins >= 1) & (bins <= NB), hist, 0)
            at_least = above + tl.sum(same, axis=0) - tl.cumsum(same, 0) + same
            # the largest digit with at least PROBES keys at or above it, and that count, in one reduction:
            # (count, bin) packed so that the least packed value is the least count at the largest bin
            packed = tl.min(tl.where((bins >= 1) & (bins <= NB) & (at_least >= PROBES),
                                     at_least * (2 * NB) + (2 * NB - 1 - bins), 2147483647), axis=0)
            thr = thr + ((2 * NB - 2 - packed % (2 * NB)).to(tl.uint32) << shift)
            n_ge = packed // (2 * NB)
            open_rounds = (n_ge != PROBES).to(tl.int32)
            if rnd == KEY_BITS // RADIX_BITS - 1:  # the last digit: the keys equal to the threshold
                n_tie = tl.sum(tl.where(bins == 2 * NB - 1 - packed % (2 * NB), same, 0), axis=0)
    # Ties: every key above the threshold is chosen, and of the keys equal to it (after every round, thr is the
    # PROBES-th largest key) the first ``need`` by index, where the keys at or above it are ``excess`` more than PROBES
    # (an early exit leaves none over). The ties' rank then comes from the same forward scan as the list: the sizes,
    # slots and rank of the ties apart from the others', and one reduction for the totals and what the kept ties hold
    # (the first version, a suffix scan of the ties before the list's, took 0.5 µs longer than 32-bit keys without
    # ties on the H100: reverse scans cost more than forward ones in Triton, as in the radix rounds).
    n_ge = n_ge - tl.where(thr == 0, BLOCK_C - C, 0)  # padding is key 0
    excess = tl.maximum(n_ge - PROBES, 0)
    need = n_tie - excess
    if SKIP > 0:  # the ablation chooses every non-empty cluster
        excess = excess * 0
    size = c_end - c_start
    nonempty = c_ok & (size > 0)
    picked = nonempty & (key >= thr)
    if excess > 0:  # more keys tie at the threshold than there are probes left
        above = nonempty & (key > thr)
        tie = c_ok & (key == thr)
        # the list slots of the clusters above and of the non-empty ties, packed (each at most BLOCK_C)
        CT: tl.constexpr = tl.int32 if BLOCK_C <= 16384 else tl.int64
        HALF: tl.constexpr = 16 if BLOCK_C <= 16384 else 32
        slots = above.to(CT) | ((tie & nonempty).to(CT) << HALF)
        a_incl, t_incl, c_incl, rank = tl.associative_scan(
            (tl.where(above, size, 0), tl.where(tie, size, 0), slots, tie.to(tl.int32)), 0, _add_quad)
        kept = rank <= need  # every tie up to here is kept
        # (non-decreasing along the clusters: the maxima are the totals and the kept ties' sums)
        a_total, t_kept, c_total, c_kept = tl.reduce(
            (a_incl, tl.where(kept, t_incl, 0), c_incl, tl.where(kept, c_incl >> HALF, 0)), 0, _max_quad)
        picked = picked & (~tie | kept)
        incl = a_incl + tl.where(kept, t_incl, t_kept)
        count = ((c_incl & ((1 << HALF) - 1)) + tl.where(kept, c_incl >> HALF, c_kept)).to(tl.int32)
        total = a_total + t_kept
        n_picked = ((c_total & ((1 << HALF) - 1)) + c_kept).to(tl.int32)
    else:
        # the key prefix and the list slot in one scan, the key and cluster counts in one reduction (each cross-warp
        # step is a barrier on the head's one SM)
        total, n_picked = tl.reduce((tl.where(picked, size, 0), picked.to(tl.int32)), 0, _add_pair)
        incl, count = tl.associative_scan((tl.where(picked, size, 0), picked.to(tl.int32)), 0, _add_pair)
    if PERM_LINES > 0:  # before the list: the lines are on their way while it is written
        p_base = perm_ptr + b64 * stride_pb + kvh64 * stride_ph
        for j in tl.static_range(PERM_LINES):
            idx = c_start + 32 * j
            _prefetch_l2(p_base + idx.to(tl.int64) * stride_pn, picked & (idx < c_end))
    if SKIP < 2:
        slot = count - 1
        out = bh.to(tl.int64) * BLOCK_C
        tl.store(incl_ptr + out + slot, incl, mask=picked)
        tl.store(shift_ptr + out + slot, c_start - (incl - size), mask=picked)
        tl.store(incl_ptr + out + offs_c, tl.full([BLOCK_C], 2147483647, tl.int32), mask=offs_c >= n_picked)
    tl.store(total_ptr + bh, total)
    if HAS_STATS:
        attended = SINK + total + window_keys
        share = attended.to(tl.float64) / tl.maximum(kv_len, 1).to(tl.float64) * inv_heads
        if RELAXED_STATS:  # no fence before them: nothing reads the sums before the launch ends
            tl.atomic_add(stats_ptr, share, sem="relaxed", scope="gpu")
            tl.atomic_add(stats_ptr + 1, tl.where(bh == 0, 1.0, 0.0).to(tl.float64), sem="relaxed", scope="gpu")
        else:  # Triton's default, acq_rel: a fence (MEMBAR.GPU on sm_90) before each
            tl.atomic_add(stats_ptr, share)
            tl.atomic_add(stats_ptr + 1, tl.where(bh == 0, 1.0, 0.0).to(tl.float64))


@triton.jit
def _saap_select_kernel(
    score_ptr,  # FROM_LOGITS: logits (B, Hkv, M, C) fp32 contiguous; else scores (B, Hkv, C) fp32, any strides
    stat_ptr,  # FROM_LOGITS: (B, Hkv, M, NCHUNK, 2) fp32 chunk statistics of the logits
    offsets_ptr,  # (B, Hkv, C + 1) int32 CSR offsets into perm
    end_ptr,  # (B,) int32 indexed_end (stats)
    valid_ptr,  # (B,) int valid lengths (HAS_VALID)
    incl_ptr,  # out (B * Hkv, BLOCK_C) int32: inclusive key prefix of the chosen non-empty clusters, INT32_MAX after
    shift_ptr,  # out (B * Hkv, BLOCK_C) int32: perm index minus virtual index of each of those clusters
    total_ptr,  # out (B * Hkv,) int32: keys in the chosen clusters
    stats_ptr,  # (2,) fp64 accumulators [sum of mean selectivity, calls] (HAS_STATS)
    perm_ptr,  # PERM_LINES: (B, Hkv, NP) int32 cluster-sorted key positions (else unused)
    stride_sb, stride_sh, stride_sc,  # scores strides (not FROM_LOGITS)
    stride_fb, stride_fh, stride_fc,  # offsets strides
    stride_pb, stride_ph, stride_pn,  # perm strides (PERM_LINES)
    N,  # keys in the cache
    HKV,  # KV heads
    M,  # query rows per KV head (G * L)
    C,  # clusters
    NCHUNK,  # logit chunks per row (FROM_LOGITS)
    PROBES,  # clusters to pick (1 <= PROBES <= C)
    SINK,  # always-attended leading keys (stats)
    inv_heads,  # 1 / (B * Hkv): each program's share of the mean selectivity
    BLOCK_C: tl.constexpr,  # padded C (power of two)
    BLOCK_CH: tl.constexpr,  # padded NCHUNK
    ROWS: tl.constexpr,  # FROM_LOGITS: query rows summed per step
    RADIX_BITS: tl.constexpr,  # threshold bits found per round (1, 2, 4 or 8: a histogram of 2^(bits + 1) bins)
    FROM_LOGITS: tl.constexpr,  # scores are the group sum of the rows' softmax of the logits
    HAS_VALID: tl.constexpr,  # valid_ptr holds the lengths
    HAS_STATS: tl.constexpr,  # accumulate the selectivity
    WAIT_PRIOR: tl.constexpr,  # launched as a programmatic dependent: wait for the scoring grid first
    LAUNCH_DEPENDENTS: tl.constexpr,  # let the attention launch become resident now
    SKIP: tl.constexpr = 0,  # the piece microbenchmark's ablations (``_select_head``); 0 in every plan
    GUESS_TOP: tl.constexpr = False,  # the first round's digit from one count (``_select_head``; RADIX_BITS 4)
    PERM_LINES: tl.constexpr = 0,  # > 0: prefetch the chosen clusters' perm lines into L2 (``_select_head``)
    KEY_BITS: tl.constexpr = 16,  # the score key's bits that rank it (``_select_head``)
    RELAXED_STATS: tl.constexpr = True,  # the selectivity atomics unordered (``_select_head``)
):
    if LAUNCH_DEPENDENTS:
        gdc_launch_dependents()
    _select_head(tl.program_id(0), score_ptr, stat_ptr, offsets_ptr, end_ptr, valid_ptr, incl_ptr, shift_ptr, total_ptr,
                 stats_ptr, stride_sb, stride_sh, stride_sc, stride_fb, stride_fh, stride_fc, N, HKV, M, C, NCHUNK,
                 PROBES, SINK, inv_heads, BLOCK_C, BLOCK_CH, ROWS, RADIX_BITS, FROM_LOGITS, HAS_VALID, HAS_STATS,
                 WAIT_PRIOR, SKIP, GUESS_TOP, perm_ptr, stride_pb, stride_ph, stride_pn, PERM_LINES, KEY_BITS,
                 RELAXED_STATS)


def block_c_for(clusters: int) -> int:
    """The padded cluster count of the selection tables (a power of two >= 16)."""
    return max(16, next_pow2(clusters))


def radix_bits(block_c: int) -> int:
    """Threshold bits the selection finds per round (a histogram of 2^(bits + 1) bins each): narrower past 2048
    clusters, where the wider rounds' registers spill."""
    return 4 if block_c <= 2048 else 2 if block_c <= 8192 else 1


def select_warps(block_c: int) -> int:
    """Warps of the selection's one program per head. Its work (the softmax sums, 32 / RADIX_BITS histogram rounds
    with their reductions, two scans) runs on one SM per head and is latency-bound: compiled for sm_90 at 2048
    clusters, 16 warps run 2.0k instructions each (60 registers) against 3.1k at 8, and hide the reductions' latency
    behind 4 warps per scheduler rather than 2."""
    return max(4, min(16, block_c // 128))
