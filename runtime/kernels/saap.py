"""SAAP sparse decode: scoring and top-l selection (``saap_select``: one or two scoring launches and one selection
launch), the attention launch over the sink, the recent window and the chosen clusters, and the shared merge. Fused
(``fused_select``, ``fused_merge``), the same work takes two launches: the scoring launch's last program per head
selects, and the attention launch's last splits merge (two levels of arrival: ``saap_merge``).

The selection leaves a compact work list per (batch row, KV head): the chosen non-empty clusters in cluster order,
their inclusive key prefix and their shift into the cluster-sorted ``perm``. The attention launch's first W splits
share the always-attended keys (the sink, then the window [indexed_end, kv_len)), which need no selection: chained
by programmatic dependent launch they run while the scoring and the selection do. The other splits wait for the
selection and take equal shares of the chosen clusters' keys laid end to end in BLOCK_N-key tiles: a large cluster
is cut over several programs and small ones are packed into one tile, so the largest cluster does not set the
time. W is in proportion to the expected keys of each part. A tile finds its keys' clusters among the BLOCK_N
entries of the list from its first cluster on (any BLOCK_N consecutive keys span at most BLOCK_N non-empty
clusters), by one vector load of their prefixes and shifts and (BLOCK_N, BLOCK_N) comparisons: no sort and no per-key
search in the attention launch. The loop is software-pipelined: a tile's K/V reads are issued before the next
tile's list and ``perm`` lookups, so those two dependent loads hide under the reads (a cluster-ordered copy of K/V
would remove the ``perm`` load too, but costs the indexed cache once more: 64 GiB for llama3-8b at 512k, which an
H100 cannot hold beside the cache itself). The grid is fixed by the plan and every length is read on the device, so
a captured CUDA graph replays correctly.
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

from . import interpreting
from .common import _load_q, _row_coords, _split_share, backend_has_option, decode_geometry, dot_flags, \
    pdl_supported, softmax_scale
from .launch import KernelLauncher
from .merge import merge_states
from .partials import _finish_parts, _store_lse, _store_rows
from .saap_merge import _arrive_and_merge_grouped, merge_counter_count, merge_group_size
from .saap_select import SaapScorer, SelectWorkspace, saap_select, select_workspace
from .saap_tiles import _attend_clusters, _attend_keys


@triton.jit
def _saap_kernel(
    q_ptr, k_ptr, v_ptr,  # Q (B, Hq, L, D); K (B, Hkv, N, D); V (B, Hkv, N, Dv): any strides
    incl_ptr,  # (B * Hkv, BLOCK_C) int32 inclusive key prefix of the chosen non-empty clusters, INT32_MAX after
    shift_ptr,  # (B * Hkv, BLOCK_C) int32 perm index minus virtual index of those clusters
    total_ptr,  # (B * Hkv,) int32 keys in the chosen clusters
    perm_ptr,  # (B, Hkv, NP) int32 key positions sorted by cluster
    end_ptr,  # (B,) int32 indexed_end: keys from here on (the window, later tokens) are always attended
    valid_ptr,  # (B,) int32/int64 valid lengths, or a dummy when HAS_VALID is False
    o_ptr,  # (S, B, Hq, L, Dv) fp32 partial outputs
    lse_ptr,  # (2, S, B, Hq, L) fp32 partial row maxima (plane 0) and log l (plane 1), natural log
    out_ptr,  # FUSED: the final (B, Hq, L, Dv) output the last split to arrive merges into (else unused)
    lse_out_ptr,  # FUSED: the final (B, Hq, L) fp32 LSE (written when WRITE_LSE_OUT)
    counter_ptr,  # FUSED: the two-level merge's int32 arrival counters (saap_merge), zero before and after every launch
    stride_qb, stride_qh, stride_ql, stride_qd,  # Q strides
    stride_kb, stride_kh, stride_kn, stride_kd,  # K strides
    stride_vb, stride_vh, stride_vn, stride_vd,  # V strides
    stride_pb, stride_ph, stride_pn,  # perm strides
    stride_os, stride_ob, stride_oh, stride_ol, stride_od,  # partial output strides
    stride_ls, stride_lb, stride_lh, stride_ll,  # partial LSE strides
    stride_lpart,  # between the row-max and log-l planes of the partial LSEs
    stride_fb, stride_fh, stride_fl, stride_fd,  # FUSED: final output strides
    stride_gb, stride_gh, stride_gl,  # FUSED: final LSE strides
    sm_scale,  # softmax scale (natural units)
    N,  # keys in the K/V tensors
    L,  # query tokens per head
    G,  # query heads per KV head
    HKV,  # KV heads
    NUM_M,  # M blocks per KV head
    SINK,  # keys [0, SINK) are always attended
    NUM_SPLITS,  # programs per (batch row, KV head, M block)
    WINDOW_SPLITS,  # splits [0, W) share the sink and the window, splits [W, S) the clusters (0 <= W < S; W = 0:
    # split 0 takes the sink and the window as well)
    SPLIT_BASE,  # the split of program 0 (a launch may run only some of the splits: the window ones, or the others)
    D: tl.constexpr,  # head dim of Q/K
    DV: tl.constexpr,  # head dim of V
    BLOCK_M: tl.constexpr,  # packed query rows per tile
    BLOCK_N: tl.constexpr,  # attended keys per tile
    BLOCK_D: tl.constexpr,  # padded D
    BLOCK_DV: tl.constexpr,  # padded Dv
    BLOCK_C: tl.constexpr,  # the work list's length (power of two >= the clusters)
    FIRST_CHUNK: tl.constexpr,  # list entries read per step when finding the program's first cluster
    HAS_VALID: tl.constexpr,  # whether valid_ptr holds per-row valid lengths
    UPCAST: tl.constexpr,  # compute dots in fp32 (interpreter)
    PRECISION: tl.constexpr,  # tl.dot input precision
    WAIT_PRIOR: tl.constexpr,  # launched as a programmatic dependent of the selection: wait before reading its list
    LAUNCH_DEPENDENTS: tl.constexpr,  # let the merge launch become resident now
    FUSED: tl.constexpr = False,  # the last split to finish a tile merges the partials (no merge launch)
    WRITE_LSE_OUT: tl.constexpr = False,  # FUSED: whether to store the final LSE
    BLOCK_R: tl.constexpr = 16,  # FUSED: rows merged per tile
    MERGE_GROUP: tl.constexpr = 2,  # FUSED: splits per first-level merge group (saap_merge)
    PREFETCH_LINES: tl.constexpr = 0,  # > 0: a cluster split asks L2 for its keys' perm lines (saap_tiles)
    NO_LOOKUP: tl.constexpr = False,  # the piece microbenchmark's ablation (saap_tiles._cluster_tile); never a plan's
    KV_LINES: tl.constexpr = 0,  # > 0: a cluster split prefetches the next tile's K/V rows, KV_LINES lines a row
    KV_LINE_ELEMS: tl.constexpr = 64,  # elements of K/V in a 128-byte line
    SHARE_ALL: tl.constexpr = False,  # every split takes a share of both parts (WINDOW_SPLITS unread): SHARE_SPLITS
):
    if LAUNCH_DEPENDENTS:
        gdc_launch_dependents()
    # the tile is the grid's first axis, so that blocks start split-major: every tile's window splits (the first W)
    # before any cluster split. Chained by PDL, they then take the SMs that the scoring frees while its last
    # programs select, and the cluster splits, which wait for the selection, come after them.
    tile = tl.program_id(0)  # (b * HKV + kvh) * NUM_M + mb
    split = tl.program_id(1) + SPLIT_BASE
    mb = tile % NUM_M
    bh = tile // NUM_M
    kvh = bh % HKV
    b = bh // HKV
    b64 = b.to(tl.int64)
    kvh64 = kvh.to(tl.int64)

    rows, g, i, row_ok = _row_coords(mb, L, G, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_n = tl.arange(0, BLOCK_N)
    q = _load_q(q_ptr, b, kvh, g, i, row_ok, offs_d, stride_qb, stride_qh, stride_ql, stride_qd, G, D, UPCAST)
    kv_len = N
    if HAS_VALID:
        kv_len = tl.maximum(tl.minimum(tl.load(valid_ptr + b).to(tl.int32), N), 0)
    stored_end = tl.load(end_ptr + b).to(tl.int32)
    indexed_end = tl.minimum(stored_end, kv_len)
    sink = tl.minimum(SINK, indexed_end)
    row_pos = kv_len - L + i  # each query token's own position: it sees no later key
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    k_base = k_ptr + b64 * stride_kb + kvh64 * stride_kh
    v_base = v_ptr + b64 * stride_vb + kvh64 * stride_vh
    incl_base = incl_ptr + bh.to(tl.int64) * BLOCK_C
    offs_c = tl.arange(0, FIRST_CHUNK)
    if not WAIT_PRIOR:
        # unchained, the work list is complete at launch: a cluster split's key count and the list's first prefixes
        # load with the query, not after phase 1's bounds, which wait for the lengths (H100, 0d2d7ed, llama3-8b
        # 128k 5 %: 19.56 µs a launch against 19.82)
        if SHARE_ALL:
            clusters_split = split >= 0
        else:
            clusters_split = split >= WINDOW_SPLITS
        total = tl.load(total_ptr + bh, mask=clusters_split, other=0)
        prefixes = tl.load(incl_base + offs_c, mask=clusters_split & (offs_c < FIRST_CHUNK), other=0)

    # phase 1, without the selection (so, chained, it runs while the scoring and the selection do): this split's
    # share of the always-attended keys, the sink [0, sink) then the window [indexed_end, kv_len)
    n_always = sink + kv_len - indexed_end
    if SHARE_ALL:  # every split: a share of the always-attended keys now, of the clusters' keys after the wait
        # ceil(tiles / S) tiles a split from split 0 on (at most one tile at 128k and 512k): the splits scheduled
        # last (the grid's last split, each head's) get none, so that those that start only when the selection
        # frees its SMs go straight to their cluster share
        per = tl.cdiv(tl.cdiv(n_always, BLOCK_N), NUM_SPLITS) * BLOCK_N
        lo = tl.minimum(split * per, n_always)
        hi = tl.minimum(lo + per, n_always)
        first_cluster_split = 0
    else:
        lo, hi = _split_share(split, n_always, tl.maximum(WINDOW_SPLITS, 1), BLOCK_N)
        if split >= tl.maximum(WINDOW_SPLITS, 1):
            hi = lo
        first_cluster_split = WINDOW_SPLITS
    for start_t in range(lo, hi, BLOCK_N):
        t = start_t + offs_n
        t_ok = t < hi
        pos = tl.where(t < sink, t, indexed_end + t - sink)
        acc, m_i, l_i = _attend_keys(q, acc, m_i, l_i, pos, t_ok, k_base, v_base, row_ok, row_pos, offs_d, offs_dv,
                                     stride_kn, stride_kd, stride_vn, stride_vd, sm_scale, D, DV, UPCAST, PRECISION)

    # phase 2: this split's share of the chosen clusters' keys, after the selection
    if split >= first_cluster_split:
        if WAIT_PRIOR:
            gdc_wait()  # the selection's work list is complete and visible from here on
            # the list's first prefixes load with the key count, before the share that needs it: one round trip
            # (the share's integer divisions would otherwise keep the compiler from issuing them early)
            total = tl.load(total_ptr + bh)
            prefixes = tl.load(incl_base + offs_c)
        shift_base = shift_ptr + bh.to(tl.int64) * BLOCK_C
        p_base = perm_ptr + b64 * stride_pb + kvh64 * stride_ph
        lo, hi = _split_share(split - first_cluster_split, total, NUM_SPLITS - first_cluster_split, BLOCK_N)
        # the list entry of the cluster holding key lo: the count of prefixes at or below it
        first = tl.sum((prefixes <= lo).to(tl.int32), axis=0)
        for c0 in tl.static_range(FIRST_CHUNK, BLOCK_C, FIRST_CHUNK):  # a longer list: the rest, a chunk at a time
            first += tl.sum((tl.load(incl_base + c0 + offs_c) <= lo).to(tl.int32), axis=0)
        # the cluster keys lie below the stored indexed end: past the rows' first position (only under a valid
        # length that cut into the index), the masks must check each key's position
        if stored_end > kv_len - L + 1:
            acc, m_i, l_i = _attend_clusters(q, acc, m_i, l_i, lo, hi, first, kv_len, incl_base, shift_base, p_base,
                                             stride_pn, k_base, v_base, row_ok, row_pos, offs_d, offs_dv, stride_kn,
                                             stride_kd, stride_vn, stride_vd, sm_scale, D, DV, BLOCK_N, BLOCK_C,
                                             UPCAST, PRECISION, True, PREFETCH_LINES, NO_LOOKUP, KV_LINES,
                                             KV_LINE_ELEMS)
        else:
            acc, m_i, l_i = _attend_clusters(q, acc, m_i, l_i, lo, hi, first, kv_len, incl_base, shift_base, p_base,
                                             stride_pn, k_base, v_base, row_ok, row_pos, offs_d, offs_dv, stride_kn,
                                             stride_kd, stride_vn, stride_vd, sm_scale, D, DV, BLOCK_N, BLOCK_C,
                                             UPCAST, PRECISION, False, PREFETCH_LINES, NO_LOOKUP, KV_LINES,
                                             KV_LINE_ELEMS)
    o, m_part, log_l = _finish_parts(acc, m_i, l_i)  # m and log l kept apart for the merge (see _merge_step)
    _store_rows(o, m_part, o_ptr + split.to(tl.int64) * stride_os, lse_ptr + split.to(tl.int64) * stride_ls,
                b, kvh, g, i, row_ok, offs_dv, stride_ob, stride_oh, stride_ol, stride_od,
                stride_lb, stride_lh, stride_ll, G, DV, True)
    _store_lse(log_l, lse_ptr + stride_lpart + split.to(tl.int64) * stride_ls, b, kvh, g, i, row_ok, stride_lb,
               stride_lh, stride_ll, G)
    if FUSED:  # the last split of a group merges the group, the last group the tile (saap_merge)
        _arrive_and_merge_grouped(counter_ptr, tile, tl.num_programs(0), split, o_ptr, lse_ptr, out_ptr, lse_out_ptr,
                                  mb, b, kvh, offs_dv, stride_os, stride_ob, stride_oh, stride_ol, stride_od, stride_ls,
                                  stride_lb, stride_lh, stride_ll, stride_lpart, stride_fb, stride_fh, stride_fl,
                                  stride_fd, stride_gb, stride_gh, stride_gl, NUM_SPLITS, L, G, DV, BLOCK_M, BLOCK_R,
                                  MERGE_GROUP, WRITE_LSE_OUT)


_SAAP_LAUNCH = KernelLauncher(_saap_kernel)
#: List entries a cluster split reads at once to find its first cluster: the whole list up to 2048 clusters (compiled
#: for sm_90 at the bench shape, the same 128 registers as 1024 at a time, and one load and one reduction, not two).
FIRST_CHUNK = 2048
#: Programs per output row of the merge launch, each over a share of Dv (``merge_states``' dv_split): at llama3-8b's
#: 32 rows, 1 leaves most SMs idle while each of 32 reads 64 partials of 128 values. H100 (65ec530, llama3-8b 128k
#: 5 %): the merge alone 2.22 µs at 2 against 3.43 (2.32 at 4, 2.54 at 8 at 80da12a); the whole op 39.57 against
#: 40.02, and 37.92 against 38.34 with both prefetches below.
MERGE_DV_SPLIT = 2
#: 128-byte lines of ``perm`` per list entry that a cluster split asks L2 for after its first tile's lookups (0:
#: none), so that its later tiles' perm reads, a dependent read between the list's and the K/V rows', hit L2. A hint
#: in PTX: compiled code only (the interpreter runs without it). H100 (65ec530, 128k 5 %): with PREFETCH_KV the whole
#: op 38.34 µs at 4 against 38.57 at 0 (alone 40.40 against 40.02: within the noise); the cluster splits alone 16.68
#: against 17.07. The list and perm reads are not what the cluster splits wait for: at hashed scattered positions
#: without them (an ablation) they took 18.13, the K/V gather is.
PREFETCH_LINES = 4
#: A cluster split prefetches into L2 the next tile's K/V rows as soon as their lookups return, before folding this
#: tile, so that two tiles' reads are in flight at the cost of one tile's registers (sm_90: 120 registers with both
#: prefetches, no spill). PTX only, like PREFETCH_LINES. H100 (65ec530, llama3-8b 5 %): the whole op 38.57 µs against
#: 40.02 at 128k (the attention launch 17.55 against 18.75), with the other two settings here 37.92 (4.75x cuDNN's
#: 180.1) and 69.53 at 512k against 70.43 (9.98x cuDNN's 693.7).
PREFETCH_KV = True
#: Every split of the attention launch takes a share of both parts, the always-attended keys (before the wait for the
#: selection, chained: while it runs) and then the chosen clusters' keys, rather than the first W splits the one and
#: the others the other (``window_split_count``). The splits that held the window then share the clusters too: at
#: llama3-8b 128k 5 % (S = 64, W = 16) a split's cluster tiles after the selection drop from 3-4 to 2-3, the part
#: after the selection that sets the time; each split's window share is then at most one tile, read while the
#: selection runs. Not with ``window_stream`` (which needs the window splits apart). Off: on the H100 (llama3-8b
#: 128k 5 %) 39.04 µs a call against 36.25 with the window spread evenly (4d0692d), 37.46 against 36.62 with it on
#: the first splits (8fa8292; 56 and 48 splits 37.59, 37.08 at 4d0692d; the attention alone 17.92 against 17.51).
SHARE_SPLITS = False


def kv_prefetch_lines(head_dim: int, element_size: int) -> int:
    """128-byte lines a K/V row of ``head_dim`` elements spans, up to a power of two (the prefetch's line axis;
    lines past the row are masked off)."""
    return triton.next_power_of_2(max(1, -(-head_dim * element_size // 128)))


def window_split_count(num_splits: int, always_keys: float, cluster_keys: float) -> int:
    """Splits of ``num_splits`` that take the sink and the window (``always_keys``) rather than the chosen clusters
    (``cluster_keys`` expected), in proportion, with at least one for each part (none when there is one split: it
    takes both). The window splits need not wait for the selection."""
    if num_splits < 2 or always_keys <= 0:
        return 0
    share = round(num_splits * always_keys / max(always_keys + cluster_keys, 1e-9))
    return max(1, min(num_splits - 1, share))


class SaapWorkspace(NamedTuple):
    """Everything one call needs besides its inputs: the partial states of the splits, the fused merge's arrival
    counters and the selection's buffers."""

    o: torch.Tensor  # (S, B, Hq, L, Dv) fp32 partial outputs
    lse: torch.Tensor  # (2, S, B, Hq, L) fp32 partial row maxima and log l (natural log)
    select: SelectWorkspace
    counters: torch.Tensor  # int32 arrival counters of the fused merge (``saap_merge.merge_counter_count``), zeroed
    side: torch.cuda.Stream | None = None  # CUDA, made for ``window_stream``: the stream of the window's launch

    @property
    def num_splits(self) -> int:
        return self.o.shape[0]


def saap_workspace(num_splits: int, q: torch.Tensor, v: torch.Tensor, hkv: int, clusters: int,
                   hidden: int = 0, window_stream: bool = False) -> SaapWorkspace:
    """Buffers for ``num_splits`` splits of q (B, Hq, L, D) over v (B, Hkv, N, Dv) with ``clusters`` clusters;
    ``hidden`` is the query MLP's width (0: centroid scoring); ``window_stream``: also a side stream for the
    window's launch (CUDA)."""
    B, Hq, L, _ = q.shape
    f32 = dict(device=q.device, dtype=torch.float32)
    geo = decode_geometry(q, v, v)  # v stands for k: the heads, the length and Dv are all the geometry reads
    return SaapWorkspace(torch.empty((num_splits, B, Hq, L, v.shape[-1]), **f32),
                         torch.empty((2, num_splits, B, Hq, L), **f32),
                         select_workspace(B, hkv, (Hq // hkv) * L, clusters, hidden, q.device),
                         torch.zeros((merge_counter_count(B * hkv * geo.num_m, num_splits),), device=q.device,
                                     dtype=torch.int32),
                         torch.cuda.Stream(q.device) if window_stream and q.is_cuda else None)


def saap_decode_kernel(q, k, v, offsets, perm, indexed_end, out, lse=None, *, probes, sink, scale=None,
                       scorer: SaapScorer | None = None, scores=None, valid_len=None, stats=None, num_splits=8,
                       block_n=64, num_warps=4, num_stages=2, workspace: SaapWorkspace | None = None, pdl=None,
                       window_splits=None, fused_select=False, fused_merge=False, window_stream=False,
                       window_after_scoring=False, select_warps=None, share_splits=None):
    """Launch SAAP decode into ``out`` (and ``lse``): scoring and selection, the attention, the merge.

    Parameters
    ----------
    q : (B, Hq, L, D) fp16/bf16/fp32; k : (B, Hkv, N, D); v : (B, Hkv, N, Dv), same dtype, any strides.
    offsets : (B, Hkv, C + 1) int32 CSR offsets; perm : (B, Hkv, NP) int32 cluster-sorted key positions.
    indexed_end : (B,) int32: keys [indexed_end, kv_len) are attended densely (with the sink [0, sink)).
    out : (B, Hq, L, Dv) any float dtype; lse : (B, Hq, L) fp32 or None.
    scorer : the layer's scoring weights (see ``SaapScorer``), or scores : (B, Hkv, C) fp32 given cluster scores
        (summed over the group's heads and the L tokens).
    valid_len : (B,) int tensor or None (keys from valid_len on do not exist).
    stats : (2,) fp64 selectivity accumulator or None.
    workspace : from ``saap_workspace`` (allocated here when None; its split count wins over ``num_splits``).
    pdl : chain the launches by programmatic dependent launch (see ``saap_select``); None = wherever the GPU and
        Triton support it.
    window_splits : splits that share the sink and the window (the rest share the clusters; see
        ``window_split_count``); None: by the keys the sink and window hold at N keys against ``probes`` clusters of
        average size.
    fused_select : the scoring launch also selects (its last chunk program per head; one launch fewer).
    fused_merge : the attention launch also merges (its last split per tile; one launch fewer). Each counts its
        programs' arrivals in a counter that every launch leaves at zero; both: two launches (three with the MLP).
    window_stream : the window splits are a launch of their own, on ``workspace.side`` beside the scoring and the
        selection (in a captured graph: a parallel branch, joined before the merge), so that they run while the
        selection holds one SM per head; the attention launch after the selection then holds the cluster splits
        alone. Needs a window split (else one launch as without it); the same partials, so the same output.
    select_warps : the selection's warps (its own launch's, or the fused scoring launch's); None: the rule of
        ``saap_select``.
    window_after_scoring : with ``window_stream``, fork after the scoring launch rather than before it, so that the
        window's reads overlap only the selection (latency-bound on one SM a head), not the scoring's own reads.
    share_splits : every split takes a share of the sink and window and then of the clusters (``window_splits`` is
        then not used); None: the module's ``SHARE_SPLITS``, except with ``window_stream``; True with
        ``window_stream`` is refused.
    """
    B, Hq, L, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    geo = decode_geometry(q, k, v)
    C = offsets.shape[-1] - 1
    sm_scale = softmax_scale(scale, D)
    if workspace is None:
        workspace = saap_workspace(num_splits, q, v, Hkv, C, scorer.hidden if scorer is not None else 0,
                                   window_stream)
    S = workspace.num_splits
    if window_splits is None:
        n_idx = perm.shape[-1]
        window_splits = window_split_count(S, sink + max(0, N - sink - n_idx), probes * n_idx / max(1, C))
    if not 0 <= window_splits < S:
        raise ValueError(f"saap_decode_kernel: window_splits must be in [0, {S}) for {S} splits; got {window_splits}")
    pdl = pdl_supported(q.device) if pdl is None else bool(pdl) and pdl_supported(q.device)
    # the module default yields to a window stream; asked for by name, the two are refused together
    shared = SHARE_SPLITS and not window_stream if share_splits is None else bool(share_splits)
    if shared and window_stream:
        raise ValueError("saap_decode_kernel: share_splits and window_stream exclude each other (every split takes "
                         "window keys when shared; window_stream launches the window splits apart)")
    apart = bool(window_stream) and window_splits > 0  # the window splits in a launch of their own
    side = workspace.side if apart and q.is_cuda else None
    if apart and q.is_cuda and side is None:
        raise ValueError("saap_decode_kernel: window_stream needs a workspace with a side stream: allocate it with "
                         "saap_workspace(..., window_stream=True)")
    args, consts = _attention_launch(q, k, v, perm, indexed_end, valid_len, out, lse, workspace, sm_scale, sink,
                                     window_splits, block_n, num_warps, num_stages, fused_merge, geo, shared)

    def launch_window():
        window_grid = (B * Hkv * geo.num_m, window_splits)
        if side is not None:  # fork: the window's launch waits for what came before it, nothing else
            side.wait_stream(torch.cuda.current_stream(q.device))
            with torch.cuda.stream(side):
                _SAAP_LAUNCH(window_grid, *args, 0, **consts, WAIT_PRIOR=False, LAUNCH_DEPENDENTS=False)
        else:  # the interpreter: one stream, the same partials
            _SAAP_LAUNCH(window_grid, *args, 0, **consts, WAIT_PRIOR=False, LAUNCH_DEPENDENTS=False)

    late = apart and bool(window_after_scoring)
    if apart and not late:
        launch_window()
    sel = saap_select(q, offsets, indexed_end, workspace.select, probes=probes, scale=sm_scale, n_keys=N, sink=sink,
                      scorer=scorer, scores=scores, valid_len=valid_len, stats=stats, pdl=pdl and not late,
                      fused=fused_select, after_scoring=launch_window if late else None, num_warps=select_warps,
                      perm=perm)
    fused = bool(fused_merge) and S > 1
    extra = {"launch_pdl": True} if pdl else {}
    first = window_splits if apart else 0  # the splits this launch runs: from ``first`` on
    _SAAP_LAUNCH((B * Hkv * geo.num_m, S - first), *args, first, **consts, WAIT_PRIOR=pdl,
                 LAUNCH_DEPENDENTS=pdl and not fused, **extra)
    if side is not None:  # join: the merge reads the window's partials (so it is not chained past the join)
        torch.cuda.current_stream(q.device).wait_stream(side)
    if not fused:
        merge_states(workspace.o, workspace.lse[0], out=out, lse_out=lse if lse is not None else False,
                     pdl=pdl and side is None, log_l_parts=workspace.lse[1], dv_split=MERGE_DV_SPLIT)
    return out, lse


def _attention_launch(q, k, v, perm, indexed_end, valid_len, out, lse, workspace: SaapWorkspace, sm_scale, sink,
                      window_splits, block_n, num_warps, num_stages, fused_merge, geo, shared=False):
    """The attention launch's positional arguments before ``SPLIT_BASE`` (its last) and its keyword arguments but
    ``WAIT_PRIOR``, ``LAUNCH_DEPENDENTS`` and the PDL flag: the same for the window's and the clusters' launches
    (``shared``: every split takes a share of both parts, ``SHARE_SPLITS``)."""
    B, Hq, L, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    S = workspace.num_splits
    sel = workspace.select
    upcast, precision = dot_flags(q.dtype)
    has_valid = valid_len is not None
    ws_o, ws_lse = workspace.o, workspace.lse
    fused = bool(fused_merge) and S > 1
    extra = {}
    if fused and block_n <= 32 and num_warps == 4 and not interpreting() and backend_has_option("maxnreg"):
        # The merge's registers must not cost programs per SM: without a cap, the H100's Triton 3.6 gave the fused
        # launch fewer resident programs and 2.5x the time. 128 lets four 4-warp programs share an SM, as unfused.
        extra["maxnreg"] = 128
    args = (q, k, v, sel.incl, sel.shift, sel.total, perm, indexed_end, valid_len if has_valid else indexed_end, ws_o,
            ws_lse, out, lse if lse is not None else out, workspace.counters, *q.stride(), *k.stride(), *v.stride(),
            *perm.stride(), *ws_o.stride(), *ws_lse.stride()[1:], ws_lse.stride(0), *out.stride(),
            *(lse.stride() if lse is not None else (0, 0, 0)), sm_scale, N, L, geo.G, Hkv, geo.num_m, int(sink), S,
            int(window_splits))
    consts = dict(D=D, DV=geo.Dv, BLOCK_M=geo.block_m, BLOCK_N=block_n, BLOCK_D=geo.block_d, BLOCK_DV=geo.block_dv,
                  BLOCK_C=sel.incl.shape[1], FIRST_CHUNK=min(FIRST_CHUNK, sel.incl.shape[1]), HAS_VALID=has_valid,
                  UPCAST=upcast, PRECISION=precision, FUSED=fused, WRITE_LSE_OUT=lse is not None, BLOCK_R=geo.block_r,
                  MERGE_GROUP=merge_group_size(S, geo.block_r, geo.block_dv), num_warps=num_warps,
                  num_stages=num_stages, PREFETCH_LINES=0 if interpreting() else PREFETCH_LINES,
                  KV_LINES=kv_prefetch_lines(max(D, geo.Dv), k.element_size()) if PREFETCH_KV and not interpreting()
                  else 0, KV_LINE_ELEMS=128 // k.element_size(), SHARE_ALL=bool(shared), **extra)
    return args, consts
