"""SAAP scoring and top-l selection on the device, in two or three small launches before the attention launch (one or
two fused: then the last of a head's logit programs to finish, counted by an arrival counter, runs the selection).

1. ``_saap_rows_kernel`` (one launch with centroid scoring, two with the query MLP): per (batch row x KV head,
   chunk of outputs), the group's G x L query rows times a chunk of a weight matrix, to fp32 accuracy. From
   the rotated queries it first removes RoPE itself (the positions come from the valid length on the device). Its
   epilogue is either the MLP's hidden layer (the bias with the BatchNorm folded in, ReLU) or the cluster logits, stored with each
   chunk's row maximum and sum of exponentials so that the selection can normalise every row's softmax.
2. ``saap_topl._saap_select_kernel``, one program per (batch row, KV head): the group's cluster scores, the
   threshold of the top ``probes`` and the work list the attention launch reads (see ``saap_topl``).

The scores match the PyTorch ``SaapIndex.cluster_scores`` to fp32 rounding (the de-roping's cosines go through a
float64 range reduction, so they stay accurate at positions of 500k); the sparse set is then exactly the one the
rule picks from the scores the kernel wrote.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

try:  # grid dependency control (programmatic dependent launch); absent from older Tritons
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - then pdl_supported() is False and the branches are never compiled
    gdc_launch_dependents = gdc_wait = None

from .saap_rule import SELECT_KEY_BITS
from . import interpreting
from .common import cdiv, next_pow2
from .launch import KernelLauncher
from .saap_score_rows import _derope_rows, _load_query_rows, _rows_product
from .saap_tiles import _prefetch_l2
from .saap_topl import _saap_select_kernel, _select_head, block_c_for, radix_bits, select_warps

#: Outputs per scoring program: the hidden layer's units, the clusters' logits (from D- or H-long rows).
BLOCK_HIDDEN = 64
BLOCK_LOGITS_Q = 64
#: Clusters per program of the fused centroid scoring-and-selection launch: wider, so that its programs at the
#: selection's width (16 warps at 2048 clusters) are one an SM in one wave (llama3-8b: 8 heads x 16 chunks on 132 SMs).
BLOCK_LOGITS_Q_FUSED = 128
#: The fused centroid launch takes ``BLOCK_LOGITS_Q_FUSED`` clusters a program from this many warps up (below it,
#: ``BLOCK_LOGITS_Q``: two programs an SM).
FUSED_WIDE_MIN_WARPS = 16
#: 64 for the query MLP's logits (from H-long hidden rows): on the H100 (34a16e2 and c95c447,
#: ``benchmarks/saap_mlp_scoring.py``, llama3-8b 128k, bf16) its two scoring launches took 20.02 / 20.04 µs at 64
#: against 20.39 / 20.41 at 32 (floor 12.2); the whole decode call was timed at 32 only.
BLOCK_LOGITS_H = 64
#: Inner-dim chunk of the hidden-to-logits product.
BLOCK_K_HIDDEN = 128
#: Software-pipeline stages of the hidden-to-logits product's weight chunks (the query MLP's w2: its launch's bytes).
MLP_LOGITS_STAGES = 3
#: Chained by programmatic dependent launch (``pdl``), each program of the query MLP's logits launch asks L2 for its
#: whole w2 rows before it waits for the hidden layer (PTX only: the interpreter runs without it), so that the
#: launch's 33.5 MB (llama3-8b 128k, bf16) would stream while the hidden launch runs. Off: on the H100 (c95c447,
#: ``benchmarks/saap_mlp_scoring.py``, llama3-8b 128k) the two launches took 25.4-25.9 µs chained with it, 21.0-21.8
#: chained without it, 20.0-20.4 apart (floor 12.2 µs for the bf16 weights; float8 w2, half the bytes, 16.4 apart).
MLP_PREFETCH_W2 = False
#: Centroid scoring of at most this many padded query rows a KV head takes the "fma" products (``_rows_product``) on
#: the GPU, more rows three TF32 tensor-core products ("tf32x3"); the query MLP bf16 ones (its rule's, "bf16"). On the H100
#: (d1a0aac, llama3-8b 128k 5 %, 4 rows) the fused scoring-and-selection launch took 17.43 µs with "fma" against 18.65
#: with "tf32x3" (the scoring alone 8.41 against 9.34; Triton's FMA dot, "ieee", 23.9), and it holds 90 registers a
#: thread and 16 KB of shared memory against 128 and 64 KB. Its rows are unrolled, hence the bound.
FMA_MAX_ROWS = 8
#: 128-byte lines of ``perm`` per chosen cluster that the selection asks L2 for once the set is known, before it
#: writes the work list (the attention's first tiles read them next, from HBM otherwise). PTX only (the interpreter
#: runs without it). Off: on the H100 (65ec530, llama3-8b 5 %, with the attention's prefetches and the merge at 2) 4
#: lines took 37.72 µs against 37.92 at 128k (noise-level) but 70.24 against 69.53 at 512k.
SELECT_PREFETCH_LINES = 0
#: The selection's first radix round replaced by one count where it can (``_select_head``'s GUESS_TOP). Off: on the
#: H100 (80da12a, 32-bit keys) 7.68 µs a selection against 7.82, noise-level.
GUESS_TOP = False
#: The selection adds the call's selectivity to the device accumulator with relaxed atomics (Triton's default,
#: acq_rel, puts a GPU-wide fence before each of the two, at the end of the selection's critical path).
RELAXED_STATS = True
#: The centroid scoring launch lets its programmatic dependent (the attention launch, behind the fused selection)
#: start only once each of its programs has stored its logits, not as each starts: the attention's first reads, the
#: sink and window, then share HBM with the selection (latency-bound, one SM a head) rather than with the scoring's
#: own centroid reads (8 MB at llama3-8b 128k, the launch's bytes). On the H100 (8fa8292, llama3-8b 5 %,
#: ``benchmarks/saap_pieces.py``'s ``-late`` rows in one run) 35.92 µs a call at 128k against 36.62 (cuDNN 180.03:
#: 5.01x), 67.84 against 67.98 at 512k.
LATE_DEPENDENTS = True


class SaapScorer(NamedTuple):
    """One layer's scoring weights on the device (contiguous; fp32 but for the centroids).

    centroids : (Hkv, C, D) fp32 or 16-bit float (``saap_rule.scoring_centroids``: read as stored, products in
    fp32). inv_freq : (D / 2,) RoPE inverse frequencies, or None for an index over rotated keys.
    mlp : None (centroid scoring, logits ``scale * q . c``) or the query MLP as the rule scores with it
    (``saap_rule.ScoringMLP``: the BatchNorm folded into w1 (Hkv, H, D) bf16 and b1 (Hkv, H) fp32; w2 (Hkv, C, H)
    bf16, b2 (Hkv, C) fp32).
    """

    centroids: torch.Tensor
    inv_freq: torch.Tensor | None
    mlp: tuple[torch.Tensor, ...] | None

    @property
    def clusters(self) -> int:
        return self.centroids.shape[1]

    @property
    def hidden(self) -> int:
        return 0 if self.mlp is None else self.mlp[0].shape[1]


@triton.jit
def _saap_rows_kernel(
    x_ptr,  # SRC_Q: Q (B, Hq, L, D) rotated queries, any strides; else hidden rows (B, Hkv, M, K) fp32 contiguous
    inv_freq_ptr,  # (D / 2,) fp32 RoPE inverse frequencies (read when DEROPE)
    valid_ptr,  # (B,) int valid lengths (read when HAS_VALID): the queries sit at the last L positions
    w_ptr,  # (Hkv, NOUT, K) contiguous weights: centroids (fp32 or 16-bit: saap_rule.scoring_centroids), or the
    #        MLP's w1 or w2 in bf16 (saap_rule.scoring_mlp)
    bias_ptr,  # (Hkv, NOUT) fp32: b1 with the BatchNorm folded in (HIDDEN) or b2 (HAS_BIAS)
    out_ptr,  # (B, Hkv, M, NOUT) fp32 contiguous: hidden units or logits
    stat_ptr,  # logits: (B, Hkv, M, NCHUNK, 2) fp32 contiguous chunk row max and sum of exp(logit - max)
    counter_ptr,  # SELECT: (B * Hkv,) int32 arrival counters, zero before and after every launch
    offsets_ptr, end_ptr, incl_ptr, shift_ptr, total_ptr, stats_ptr, perm_ptr,  # SELECT: as ``_saap_select_kernel``'s
    stride_qb, stride_qh, stride_ql, stride_qd,  # Q strides (SRC_Q)
    scale,  # logits multiplier (the attention scale for centroid scoring, 1 for the MLP)
    N,  # keys in the cache (the length without a valid length)
    L,  # query tokens
    G,  # query heads per KV head
    HKV,  # KV heads
    K,  # inner dim: D (SRC_Q) or H
    NOUT,  # outputs per row: H (HIDDEN) or C
    NCHUNK,  # output chunks per row (the grid's second axis)
    stride_fb, stride_fh, stride_fc,  # SELECT: offsets strides
    stride_pb, stride_ph, stride_pn,  # SELECT: perm strides (PERM_LINES)
    PROBES, SINK, inv_heads,  # SELECT: as ``_saap_select_kernel``'s
    D: tl.constexpr,  # head dim (SRC_Q)
    BLOCK_R: tl.constexpr,  # padded rows (>= G * L; >= 16 for tl.dot)
    BLOCK_O: tl.constexpr,  # outputs per program
    BLOCK_K: tl.constexpr,  # inner-dim chunk (SRC_Q: >= D, one chunk)
    SRC_Q: tl.constexpr,  # rows are the queries (else the hidden rows)
    DEROPE: tl.constexpr,  # remove RoPE from the queries first
    HIDDEN: tl.constexpr,  # epilogue: bias (BatchNorm folded in), ReLU (else logits with chunk statistics)
    HAS_BIAS: tl.constexpr,  # logits get bias_ptr added
    HAS_VALID: tl.constexpr,  # valid_ptr holds the lengths
    PRECISION: tl.constexpr,  # tl.dot input precision: "tf32x3" (tensor cores, fp32 accuracy) or "ieee"; "fma": no dot;
    #                           "bf16" / "bf16-ieee": the MLP rule's (``_rows_product``), bf16 weights read as stored
    WAIT_PRIOR: tl.constexpr,  # launched as a programmatic dependent: wait for the grid before it first
    LAUNCH_DEPENDENTS: tl.constexpr,  # let the next launch (a programmatic dependent) become resident now
    SELECT: tl.constexpr = False,  # logits: the last chunk of a head to arrive runs the selection (no own launch)
    BLOCK_C: tl.constexpr = 16, BLOCK_CH: tl.constexpr = 2, ROWS: tl.constexpr = 1,  # SELECT: as the selection's
    RADIX_BITS: tl.constexpr = 4, HAS_STATS: tl.constexpr = False,  # SELECT: as the selection's
    GUESS_TOP: tl.constexpr = False,  # SELECT: as the selection's
    PERM_LINES: tl.constexpr = 0,  # SELECT: as the selection's
    KEY_BITS: tl.constexpr = 16,  # SELECT: as the selection's
    RELAXED_STATS: tl.constexpr = True,  # SELECT: as the selection's
    LATE_DEPENDENTS: tl.constexpr = False,  # LAUNCH_DEPENDENTS once this program's logits are stored, not at its start
    PREFETCH_W: tl.constexpr = 0,  # 128-byte lines (a power of two, >= the rows' bytes) of this program's weight rows
    #                                to ask L2 for before WAIT_PRIOR's wait: they do not depend on the launch before
):
    if LAUNCH_DEPENDENTS and not LATE_DEPENDENTS:
        gdc_launch_dependents()
    if PREFETCH_W > 0:  # the rows [first, first + BLOCK_O) of this head's weights: one contiguous range
        first = tl.program_id(1) * BLOCK_O
        nbytes = tl.minimum(NOUT - first, BLOCK_O).to(tl.int64) * K * (w_ptr.dtype.element_ty.primitive_bitwidth // 8)
        start = (w_ptr + ((tl.program_id(0) % HKV).to(tl.int64) * NOUT + first) * K).to(tl.pointer_type(tl.int8))
        lines = tl.arange(0, PREFETCH_W).to(tl.int64) * 128
        _prefetch_l2(start + lines, lines < nbytes)
    if WAIT_PRIOR:
        gdc_wait()
    bh = tl.program_id(0)  # b * HKV + kvh
    chunk = tl.program_id(1)
    b = bh // HKV
    kvh = bh % HKV
    M = G * L
    kv_len = N
    if HAS_VALID:
        kv_len = tl.maximum(tl.minimum(tl.load(valid_ptr + b).to(tl.int32), N), 0)
    offs_r = tl.arange(0, BLOCK_R)
    offs_o = chunk * BLOCK_O + tl.arange(0, BLOCK_O)
    offs_k = tl.arange(0, BLOCK_K)
    o_ok = offs_o < NOUT
    w_base = w_ptr + kvh.to(tl.int64) * NOUT * K + offs_o.to(tl.int64)[:, None] * K
    acc = tl.zeros([BLOCK_R, BLOCK_O], dtype=tl.float32)
    if SRC_Q:
        # every load before any math: the weights' read (the launch's bytes) is then in flight with the queries'
        # (de-roped first, sm_90 issued it only after the de-roping's barriers: two memory latencies in a row)
        x, xp, inv_freq = _load_query_rows(x_ptr, inv_freq_ptr, b, kvh, offs_r, offs_k, stride_qb, stride_qh,
                                           stride_ql, stride_qd, L, G, D, DEROPE)
        w = tl.load(w_base + offs_k[None, :], mask=o_ok[:, None] & (offs_k[None, :] < K), other=0.0)
        x = _derope_rows(x, xp, inv_freq, kv_len, offs_r, offs_k, L, D, DEROPE)
        acc = _rows_product(x, w, acc, PRECISION)
    else:
        x_base = x_ptr + bh.to(tl.int64) * M * K + offs_r.to(tl.int64)[:, None] * K
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + offs_k
            x = tl.load(x_base + kk[None, :], mask=(offs_r[:, None] < M) & (kk[None, :] < K), other=0.0)
            w = tl.load(w_base + kk[None, :], mask=o_ok[:, None] & (kk[None, :] < K), other=0.0)
            acc = _rows_product(x, w, acc, PRECISION)
    vec = kvh.to(tl.int64) * NOUT + offs_o
    out_ptrs = out_ptr + bh.to(tl.int64) * M * NOUT + offs_r.to(tl.int64)[:, None] * NOUT + offs_o[None, :]
    ok = (offs_r[:, None] < M) & o_ok[None, :]
    if HIDDEN:  # the rule's first layer (saap_rule.mlp_logits): the folded bias, then ReLU; the next layer rounds
        h = acc + tl.load(bias_ptr + vec, mask=o_ok, other=0.0)[None, :]
        tl.store(out_ptrs, tl.maximum(h, 0.0), mask=ok)
        if LAUNCH_DEPENDENTS and LATE_DEPENDENTS:
            gdc_launch_dependents()
    else:
        logits = acc * scale
        if HAS_BIAS:
            logits = logits + tl.load(bias_ptr + vec, mask=o_ok, other=0.0)[None, :]
        tl.store(out_ptrs, logits, mask=ok)
        masked = tl.where(o_ok[None, :], logits, float("-inf"))
        row_max = tl.max(masked, axis=1)
        row_sum = tl.sum(tl.exp(masked - row_max[:, None]), axis=1)
        stat = stat_ptr + ((bh.to(tl.int64) * M + offs_r) * NCHUNK + chunk) * 2
        tl.store(stat, row_max, mask=offs_r < M)
        tl.store(stat + 1, row_sum, mask=offs_r < M)
        if LAUNCH_DEPENDENTS and LATE_DEPENDENTS:  # the next launch's programs start once every chunk has its logits
            gdc_launch_dependents()
        if SELECT:  # the last of the head's NCHUNK programs to arrive has every logit: it selects
            tl.debug_barrier()  # every thread's logits are stored before the release below
            arrived = tl.atomic_add(counter_ptr + bh, 1, sem="acq_rel", scope="gpu")
            if arrived == NCHUNK - 1:
                _select_head(bh, out_ptr, stat_ptr, offsets_ptr, end_ptr, valid_ptr, incl_ptr, shift_ptr, total_ptr,
                             stats_ptr, 0, 0, 0, stride_fb, stride_fh, stride_fc, N, HKV, M, NOUT, NCHUNK, PROBES, SINK,
                             inv_heads, BLOCK_C, BLOCK_CH, ROWS, RADIX_BITS, True, HAS_VALID, HAS_STATS, False, 0,
                             GUESS_TOP, perm_ptr, stride_pb, stride_ph, stride_pn, PERM_LINES, KEY_BITS,
                             RELAXED_STATS)
                tl.atomic_xchg(counter_ptr + bh, 0, sem="relaxed", scope="gpu")  # ready for the next launch


_ROWS_LAUNCH = KernelLauncher(_saap_rows_kernel)
_SELECT_LAUNCH = KernelLauncher(_saap_select_kernel)


def fused_select_warps(block_c: int, hidden: int = 0) -> int:
    """Warps of the fused scoring-and-selection launch: its last program per head selects, so as many as the
    selection's own launch takes (``select_warps``). Every chunk program of the scoring has them, so centroid scoring
    takes ``BLOCK_LOGITS_Q_FUSED`` clusters a program (half the programs of its own launch, one an SM); the MLP's
    logits (``BLOCK_LOGITS_H`` a program) at most 8: compiled for sm_90 at 2048 clusters,
    16 warps take 128 registers a thread, the whole register file of an SM. On the H100 (llama3-8b, 5 %) the fused
    centroid launch took 18.6-19.1 µs at 16 warps (cc11447; the two launches apart: 9.3 + 9.1 at 2cefde7) against
    21.3-22.5 at 8 warps and 64 clusters a program."""
    return min(8, select_warps(block_c)) if hidden else select_warps(block_c)


def scoring_precision(rows: int, hidden: int = 0) -> str:
    """The scoring products' precision on the GPU for ``rows`` query rows a KV head (``FMA_MAX_ROWS``)."""
    return "fma" if not hidden and next_pow2(rows) <= FMA_MAX_ROWS else "tf32x3"


def block_rows_for(rows: int, precision: str = "tf32x3") -> int:
    """Padded query rows of the scoring product: a power of two, >= 16 for ``tl.dot`` (not for "fma")."""
    return next_pow2(rows) if precision == "fma" else max(16, next_pow2(rows))


class SelectWorkspace(NamedTuple):
    """Scoring and selection buffers of one (B, Hkv, G * L rows, C clusters, H hidden) shape."""

    logits: torch.Tensor  # (B, Hkv, M, C) fp32
    chunk_stats: torch.Tensor  # (B, Hkv, M, NCHUNK, 2) fp32
    hidden: torch.Tensor | None  # (B, Hkv, M, H) fp32, or None for centroid scoring
    incl: torch.Tensor  # (B * Hkv, BLOCK_C) int32
    shift: torch.Tensor  # (B * Hkv, BLOCK_C) int32
    total: torch.Tensor  # (B * Hkv,) int32
    counters: torch.Tensor  # (B * Hkv,) int32 arrival counters of the fused scoring and selection, zeroed


def _logit_block(hidden: int) -> int:
    return BLOCK_LOGITS_H if hidden else BLOCK_LOGITS_Q


def select_workspace(batch: int, hkv: int, rows: int, clusters: int, hidden: int,
                     device: torch.device | str) -> SelectWorkspace:
    """Allocate a :class:`SelectWorkspace` (``hidden`` = 0 for centroid scoring)."""
    nchunk = cdiv(clusters, _logit_block(hidden))
    f32 = dict(device=device, dtype=torch.float32)
    i32 = dict(device=device, dtype=torch.int32)
    return SelectWorkspace(torch.empty((batch, hkv, rows, clusters), **f32),
                           torch.empty((batch, hkv, rows, nchunk, 2), **f32),
                           torch.empty((batch, hkv, rows, hidden), **f32) if hidden else None,
                           torch.empty((batch * hkv, block_c_for(clusters)), **i32),
                           torch.empty((batch * hkv, block_c_for(clusters)), **i32),
                           torch.empty((batch * hkv,), **i32), torch.zeros((batch * hkv,), **i32))


def saap_select(q, offsets, indexed_end, workspace: SelectWorkspace, *, probes: int, scale: float, n_keys: int,
                sink: int = 0, scorer: SaapScorer | None = None, scores: torch.Tensor | None = None,
                valid_len: torch.Tensor | None = None, stats: torch.Tensor | None = None,
                pdl: bool = False, fused: bool = False, num_warps: int | None = None,
                after_scoring=None, launches: str = "all", precision: str | None = None,
                radix: int | None = None, skip: int = 0, guess_top: bool | None = None,
                perm: torch.Tensor | None = None, key_bits: int | None = None) -> SelectWorkspace:
    """Score (``scorer``) or take ``scores`` and pick each group's clusters into ``workspace``'s work list.

    Parameters
    ----------
    q : (B, Hq, L, D) rotated queries, any float dtype and strides. offsets : (B, Hkv, C + 1) int32 CSR offsets.
    indexed_end : (B,) int32 first key of the recent window. scale : the centroid logits' multiplier.
    n_keys : keys in the cache (N): the length when there is no valid length.
    scorer : the layer's weights (logits computed here), or ``scores`` : (B, Hkv, C) fp32 given scores.
    valid_len : (B,) int or None. stats : (2,) fp64 selectivity accumulator or None.
    pdl : chain the launches by programmatic dependent launch (each next one becomes resident while the one before
        runs, and waits for it before reading); the selection then lets the launch after it do the same. Only where
        ``common.pdl_supported``.
    fused : with a ``scorer``, the logits launch also selects (the last of a head's chunk programs to finish runs
        the selection, counted by ``workspace.counters``): one launch fewer, the same work list.
    num_warps : the selection's warps (None: ``select_warps``, fused ``fused_select_warps``); a fused centroid launch
        below ``FUSED_WIDE_MIN_WARPS`` takes ``BLOCK_LOGITS_Q`` clusters a program (two programs an SM), else
        ``BLOCK_LOGITS_Q_FUSED``.
    after_scoring : called (no arguments) between the scoring launches and the selection launch (fused: before the
        one launch), to put other work there.
    perm : (B, Hkv, NP) int32 cluster-sorted key positions or None: with ``SELECT_PREFETCH_LINES`` > 0 (and compiled
        code), the selection asks L2 for the chosen clusters' first lines of it, which the attention reads next.
    launches, precision, radix, skip, guess_top : for timing the pieces apart (``benchmarks/saap_pieces.py``),
        never a plan's: ``launches`` "all", "scoring" (the scoring launches alone; fused: its geometry without the
        selection) or "selection" (the selection launch alone, over the logits a scoring call left in the
        workspace); the scoring products' precision ("tf32x3", "ieee" or "fma": see ``_rows_product``; None:
        ``scoring_precision``; "ieee" in the interpreter for a tensor-core one); the selection's bits a radix
        round (None: ``radix_bits``; 1, 2, 4 or 8); its ablations (``_select_head``'s SKIP); whether its first
        round's digit comes from one count (``_select_head``'s GUESS_TOP, where a round takes 4 bits; None: the
        module's ``GUESS_TOP``);
        ``key_bits`` the bits of the score keys that rank them (None: the rule's ``saap_rule.SELECT_KEY_BITS``; another
        value picks another set than the reference's).
    """
    if num_warps is not None and num_warps not in (4, 8, 16, 32):
        raise ValueError(f"saap_select: num_warps must be 4, 8, 16 or 32 (or None: the rule); got {num_warps!r}")
    if launches not in ("all", "scoring", "selection") or radix not in (None, 1, 2, 4, 8) or skip not in (0, 1, 2) \
            or precision not in (None, "tf32x3", "ieee", "fma") or key_bits not in (None, 16, 32):
        raise ValueError(f"saap_select: launches must be all, scoring or selection, radix None, 1, 2, 4 or 8, skip "
                         f"0, 1 or 2, precision None, tf32x3, ieee or fma and key_bits None, 16 or 32; got "
                         f"{launches!r}, {radix!r}, {skip!r}, {precision!r}, {key_bits!r}")
    B, Hq, L, D = q.shape
    Hkv = offsets.shape[1]
    C = offsets.shape[-1] - 1
    G = Hq // Hkv
    M = G * L
    N = int(n_keys)
    probes = max(1, min(int(probes), C))
    has_valid = valid_len is not None
    valid = valid_len if has_valid else indexed_end
    ws = workspace
    nchunk = ws.chunk_stats.shape[3]
    has_stats = stats is not None
    block_c = ws.incl.shape[1]
    fused = bool(fused) and scores is None and launches != "selection"
    select_too = launches != "scoring"  # fused, with launches="scoring": the fused geometry without the selection
    fused_warps = (num_warps or fused_select_warps(block_c, scorer.hidden)) if fused and scorer is not None else 0
    # the fused centroid launch at 16 warps or more takes wider chunks (one program an SM): its statistics then fill
    # the workspace's first chunks of a row
    logit_block = BLOCK_LOGITS_Q_FUSED if fused_warps >= FUSED_WIDE_MIN_WARPS and scorer.mlp is None else None
    launch_chunks = cdiv(C, logit_block) if logit_block else nchunk
    # the selection's arguments, and its compile-time choices, for its own launch or the fused logits launch
    perm_lines = SELECT_PREFETCH_LINES if perm is not None and not interpreting() else 0
    select_args = (offsets, indexed_end, ws.incl, ws.shift, ws.total, stats if has_stats else ws.chunk_stats,
                   perm if perm_lines else ws.incl)
    perm_strides = perm.stride() if perm_lines else (0, 0, 0)
    bits = radix or radix_bits(block_c)
    guess_top = (GUESS_TOP if guess_top is None else bool(guess_top)) and bits == 4
    select_consts = dict(BLOCK_C=block_c, BLOCK_CH=max(2, next_pow2(launch_chunks)),
                         ROWS=max(1, min(next_pow2(M), 8192 // block_c)), RADIX_BITS=bits, HAS_STATS=has_stats,
                         GUESS_TOP=guess_top, PERM_LINES=perm_lines, KEY_BITS=key_bits or SELECT_KEY_BITS,
                         RELAXED_STATS=RELAXED_STATS,
                         **({"SKIP": skip} if skip else {}))
    inv_heads = 1.0 / (B * Hkv)
    if scores is not None and tuple(scores.shape) != (B, Hkv, C):
        raise ValueError(f"saap_select: scores must have shape (B, Hkv, C) = {(B, Hkv, C)}; got {tuple(scores.shape)}")
    if scores is None and launches == "selection":  # over the logits of an earlier (unfused) scoring call
        score_src, sstrides = ws.logits, (0, 0, 0)
    elif scores is None:
        if scorer is None:
            raise ValueError("saap_select needs a scorer or scores")
        if ws.logits.shape != (B, Hkv, M, C) or (ws.hidden is None) != (scorer.mlp is None) or (
                ws.hidden is not None and ws.hidden.shape[-1] != scorer.hidden) or nchunk != cdiv(
                C, _logit_block(scorer.hidden)):
            raise ValueError(f"saap_select: the workspace is for logits {tuple(ws.logits.shape)} and a hidden layer of "
                             f"{0 if ws.hidden is None else ws.hidden.shape[-1]}, but this call has {(B, Hkv, M, C)} "
                             f"and {scorer.hidden}: allocate it with select_workspace for this scorer")
        derope = scorer.inv_freq is not None
        inv_freq = scorer.inv_freq if derope else scorer.centroids
        # fp32 products to fp32 accuracy: three TF32 tensor-core products on the GPU (the rows are padded to 16, and
        # FMA products of the padding cost as much as the MLP's 64 MB weight read); plain fp32 in the interpreter
        precision = precision or scoring_precision(M, scorer.hidden)
        if interpreting() and precision != "fma":  # the interpreter: plain fp32 products for the tensor cores'
            precision = "ieee"
        common = dict(D=D, BLOCK_R=block_rows_for(M, precision), HAS_VALID=has_valid, PRECISION=precision,
                      LAUNCH_DEPENDENTS=pdl)
        dependent = dict(WAIT_PRIOR=True, launch_pdl=True) if pdl else dict(WAIT_PRIOR=False)
        # the selection's pointers (after the scoring's) and scalars (after the scoring's), or placeholders
        no_select = ((ws.counters,) * 8, (0, 0, 0, 0, 0, 0, probes, int(sink), inv_heads))
        with_select = ((ws.counters, *select_args), (*offsets.stride(), *perm_strides, probes, int(sink), inv_heads))
        sel_ptrs, sel_scalars = with_select if fused and select_too else no_select
        logits_select = (dict(num_warps=4) if not fused else dict(num_warps=fused_warps) if not select_too
                         else dict(SELECT=True, num_warps=fused_warps, **select_consts))
        if fused and after_scoring is not None:  # no launch between the scoring and the selection: before both
            after_scoring()
        if scorer.mlp is None:
            if LATE_DEPENDENTS and pdl:
                logits_select = dict(logits_select, LATE_DEPENDENTS=True)
            _ROWS_LAUNCH((B * Hkv, launch_chunks), q, inv_freq, valid, scorer.centroids, scorer.centroids,
                         ws.logits, ws.chunk_stats, *sel_ptrs, *q.stride(), float(scale), N, L,
                         G, Hkv, D, C, launch_chunks, *sel_scalars, BLOCK_O=logit_block or BLOCK_LOGITS_Q,
                         BLOCK_K=max(16, next_pow2(D)), SRC_Q=True, DEROPE=derope, HIDDEN=False, HAS_BIAS=False,
                         WAIT_PRIOR=False, **common, **logits_select)
        else:
            w1, b1, w2, b2 = scorer.mlp
            # bf16 (the rule: saap_rule.scoring_mlp); a float8 w2 only for timing what half its bytes would give
            # (benchmarks/saap_mlp_scoring.py: no rule computes it)
            if w1.dtype != torch.bfloat16 or w2.dtype not in (torch.bfloat16, torch.float8_e4m3fn):
                raise ValueError(f"saap_select: the query MLP's weights must be bf16 (saap_rule.scoring_mlp); got "
                                 f"{w1.dtype}, {w2.dtype}")
            H = w1.shape[1]
            # the rule's bf16 products (rows rounded, fp32 sums): tensor cores, or fp32 arithmetic in the interpreter
            mlp = dict(common, PRECISION="bf16-ieee" if interpreting() else "bf16", BLOCK_R=block_rows_for(M, "bf16"))
            _ROWS_LAUNCH((B * Hkv, cdiv(H, BLOCK_HIDDEN)), q, inv_freq, valid, w1, b1, ws.hidden,
                         ws.chunk_stats, *no_select[0], *q.stride(), 1.0, N, L, G, Hkv, D, H, 1,
                         *no_select[1],
                         BLOCK_O=BLOCK_HIDDEN, BLOCK_K=max(16, next_pow2(D)), SRC_Q=True, DEROPE=derope,
                         HIDDEN=True, HAS_BIAS=False, WAIT_PRIOR=False, num_warps=4, **mlp)
            ahead = (dict(PREFETCH_W=next_pow2(cdiv(BLOCK_LOGITS_H * H * w2.element_size(), 128)))
                     if pdl and MLP_PREFETCH_W2 and not interpreting() else {})
            _ROWS_LAUNCH((B * Hkv, nchunk), ws.hidden, inv_freq, valid, w2, b2, ws.logits, ws.chunk_stats,
                         *sel_ptrs, 0, 0, 0, 0, 1.0, N, L, G, Hkv, H, C, nchunk, *sel_scalars,
                         BLOCK_O=BLOCK_LOGITS_H, BLOCK_K=BLOCK_K_HIDDEN, SRC_Q=False, DEROPE=False, HIDDEN=False,
                         HAS_BIAS=True, num_stages=MLP_LOGITS_STAGES, **mlp, **dependent, **logits_select, **ahead)
        if fused or not select_too:
            return ws
        score_src, sstrides = ws.logits, (0, 0, 0)
    else:
        score_src, sstrides = scores, scores.stride()
    if after_scoring is not None:
        after_scoring()
    chained = pdl and scores is None  # given scores: nothing of ours runs before the selection
    _SELECT_LAUNCH((B * Hkv,), score_src, ws.chunk_stats, offsets, indexed_end, valid, *select_args[2:], *sstrides,
                   *offsets.stride(), *perm_strides, N, Hkv, M, C, nchunk, probes, int(sink), inv_heads,
                   FROM_LOGITS=scores is None, HAS_VALID=has_valid, WAIT_PRIOR=chained, LAUNCH_DEPENDENTS=pdl,
                   num_warps=num_warps or select_warps(block_c),
                   **select_consts, **({"launch_pdl": True} if chained else {}))
    return ws
