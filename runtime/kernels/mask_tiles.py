"""Split-KV over a mask: each program reads the mask over its own KV tiles and attends only to the tiles where
some query row sees a key; no device valid length is needed (one still bounds the keys where it is given).

A static cache hands the attention its whole storage (say 32k slots holding 4k tokens) and a mask that hides the
empty slots. The split-KV launch used to take the tokens' extent from ``valid_len_from_mask`` (a scan of the mask,
a launch of its own ahead of the attention), then split [0, valid_len) among its programs. Here the scan is part
of the attention launch, and it is exact for any mask, not only a prefix: a tile whose every key is hidden (False,
or -inf) for every row that the program computes adds nothing to any row's softmax, so skipping it changes no bit
of the result.

* Ownership is strided: split ``s`` of ``S`` owns tiles ``s, s + S, s + 2S, ...`` of the cache, so the visible
  tiles of a prefix (or of any mask whose holes are not periodic in S) spread evenly over the splits. Contiguous
  shares of the whole cache would give a 4k prefix of 32k to two of 16 splits.
* A program reads the mask over its tiles ``CHUNK_T`` at a time, over the mask rows it computes (a superset of
  them: a mask broadcast over the heads is read once per query position, one broadcast over the queries too
  once), and keeps the tiles with a visible key, compacted (``tl.cumsum`` ranks): a hidden tile costs its share
  of one vector load and nothing in the KV loop.
* A kept tile is attended with the mask per key up to the tile's last visible key: K/V rows after it do not count
  (a static cache's unused tail may hold anything, and a hidden key's zero weight times NaN is NaN), as the
  valid-length path attends its last tile. Where the launch takes copy-engine (TMA) tiles, a chunk's leading run of
  whole tiles (every key visible for a bool mask of one row per batch row, which is then not read in them; else
  the last key visible, the mask applied per key) comes through it in a pipelined loop whose tile positions follow
  from the loop index, as the valid-length loop's do: over a prefix that is every kept tile but the boundary one,
  over a full cache every tile. The other kept tiles follow one by one, by the copy engine too with their V rows
  past the last visible key zeroed (by pointer loads that stop there, these spilled registers: ptxas sm_90 bf16
  D=128 128-key tiles 1648 bytes, now none), or all by pointer loads without TMA (``split_kv_decode(mask_tiles=True)``:
  all by pointers; ``benchmarks/static_mask.py`` times both). On the H100
  (4k of a 32k cache, S=16, 128-key tiles, CUDA graphs, L2 rotated): 11.38 µs (27b1fd3), where compacting the TMA
  loop's tiles too ran 11.94 (a53b723), all tiles by pointers 14.09, the valid-length scan ahead of contiguous
  shares 17.33, the kernel given the length and no mask 10.65, and SDPA's cuDNN over the whole cache 59.22.
* A mask with one row per batch row (broadcast over heads and queries, as Hugging Face passes it at q_len 1) is
  read as one (BLOCK_N,) vector a tile (``MASK_ROW``), not a (BLOCK_M, BLOCK_N) tile of pointers: ptxas (sm_90,
  bf16, D=128, 128-key tiles, 4 warps) spilled 1128 bytes instead of 2216, the valid-length path with its mask
  2112 and without a mask 1192.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .attend import _attend_step
from .common import cdiv, next_pow2

#: Mask elements a program classifies per chunk of its tiles (registers: the chunk's mask values are live while
#: the accumulators are). Each chunk restarts the KV loop's pipeline (a full 128k cache over 25 splits of 64-key
#: tiles: 3 chunks). ptxas (sm_90, bf16, D=128, 4 warps, 3 stages, a one-row bool mask) spilled 400 / 520 bytes at
#: 64-key tiles for chunks of 2048 / 4096 elements, and 848 / 2984 at 128-key tiles.
CHUNK_ELEMENTS = 2048


def chunk_tiles(n_keys: int, num_splits: int, block_n: int) -> tuple[int, bool]:
    """(``CHUNK_T``: tiles a program classifies at once, a power of two, enough for all of its tiles where they fit
    in ``CHUNK_ELEMENTS`` mask elements; whether they do, ``ONE_CHUNK``)."""
    owned = cdiv(cdiv(max(n_keys, 1), block_n), max(num_splits, 1))
    chunk = max(1, min(next_pow2(owned), max(1, CHUNK_ELEMENTS // block_n)))
    return chunk, chunk >= owned


def scan_rows(mask_strides: tuple[int, int, int, int], q_len: int) -> tuple[bool, int]:
    """(HEAD_BCAST, rows): a mask broadcast over the heads (head stride 0) is scanned once per query position (once
    when it is broadcast over the queries too); rows = 0 otherwise (the kernel scans each row of its query tile)."""
    _, stride_h, stride_l, _ = mask_strides
    if stride_h != 0:
        return False, 0
    return True, 1 if (stride_l == 0 or q_len == 1) else q_len


@triton.jit
def _visible_tiles(mask_ptr, b, kvh, mb, tiles, t_ok, kv_len, stride_mb, stride_mh, stride_ml, stride_mn, L, G,
                   n_scan: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASK_KIND: tl.constexpr,
                   HEAD_BCAST: tl.constexpr):
    """Of the tiles ``tiles`` (CHUNK_T,) (``t_ok``: owned), over the mask rows this program computes (with HEAD_BCAST
    query positions [0, n_scan), else the real packed rows of M block ``mb``): whether some key is visible and
    whether every key is (CHUNK_T,) bool (every: found for one row only, else False), and one past the last visible
    key (CHUNK_T,) int32."""
    keys = tiles[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    in_range = t_ok[:, None] & (keys < kv_len)
    base = mask_ptr + b.to(tl.int64) * stride_mb
    if HEAD_BCAST and n_scan == 1:  # one row: no running OR to keep
        if MASK_KIND == 1:
            row_vis = tl.load(base + keys.to(tl.int64) * stride_mn, mask=in_range, other=0) != 0
        else:
            row_vis = tl.load(base + keys.to(tl.int64) * stride_mn, mask=in_range,
                              other=float("-inf")).to(tl.float32) != float("-inf")
        seen = (row_vis & in_range).to(tl.int32)
        every = tl.min(seen, axis=1) > 0
    else:
        seen = tl.zeros(keys.shape, dtype=tl.int32)
        if HEAD_BCAST:
            rows = n_scan
        else:
            rows = tl.minimum(BLOCK_M, G * L - mb * BLOCK_M)
        zero64 = b.to(tl.int64) * 0  # int64 row offsets (the loop index is a plain int in the interpreter)
        for r in range(0, rows):
            if HEAD_BCAST:
                row = (zero64 + r) * stride_ml
            else:
                packed = mb * BLOCK_M + r
                row = (kvh * G + packed // L).to(tl.int64) * stride_mh + (packed % L).to(tl.int64) * stride_ml
            ptrs = base + row + keys.to(tl.int64) * stride_mn
            if MASK_KIND == 1:
                vis = tl.load(ptrs, mask=in_range, other=0) != 0
            else:
                vis = tl.load(ptrs, mask=in_range, other=float("-inf")).to(tl.float32) != float("-inf")
            seen = seen | (vis & in_range).to(tl.int32)
        every = tl.max(seen, axis=1) < 0  # not tracked over several rows: False
    some = tl.max(seen, axis=1) > 0
    hi = tl.max(tl.where(seen > 0, keys + 1, 0), axis=1)
    return some, every, hi


@triton.jit
def _pick(sel, rank, j, values):
    """The value of ``values`` at the ``j``-th set entry of ``sel`` (``rank``: inclusive running count of ``sel``)."""
    return tl.sum(tl.where(sel & (rank == j + 1), values, 0), axis=0)


@triton.jit
def _attend_picked(q, q_hi, acc, acc_hi, m_i, l_i, sel, tiles, hi, k_base, v_base, k_desc, v_desc, k_hi_desc,
                   v_hi_desc, mask_ptr, b, kvh, h64, i, i64, row_ok, offs_d, offs_dv, offs_hi,
                   stride_kn, stride_kd, stride_vn, stride_vd,
                   stride_mb, stride_mh, stride_ml, stride_mn, sm_scale, D, DV,
                   BLOCK_N: tl.constexpr, MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr, UPCAST: tl.constexpr,
                   PRECISION: tl.constexpr, USE_TMA: tl.constexpr, STAGES: tl.constexpr, softcap,
                   SOFTCAP: tl.constexpr, slope, ALIBI: tl.constexpr, MASK_ROW: tl.constexpr, D_LO: tl.constexpr):
    """Attend to the tiles ``tiles`` where ``sel`` (CHUNK_T,) is set, compacted, each up to its ``hi`` (one past
    its last visible key), the mask applied per key: K/V by the copy engine (USE_TMA: whole tiles, V's rows from
    ``hi`` on zeroed) or by pointer loads stopping at ``hi``. STAGES: the loop's pipeline depth (None: the
    launch's). MASK_ROW: one mask row per batch row (``attend._attend_tile``). The state and the head chunks (D_LO)
    as in ``attend._attend_chunks``; returns (acc, acc_hi, m_i, l_i)."""
    rank = tl.cumsum(sel.to(tl.int32), axis=0)
    for jj in tl.range(0, tl.sum(sel.to(tl.int32), axis=0), num_stages=STAGES):
        start_n = _pick(sel, rank, jj, tiles) * BLOCK_N
        tile_end = _pick(sel, rank, jj, hi)
        acc, acc_hi, m_i, l_i = _attend_step(
            q, q_hi, acc, acc_hi, m_i, l_i, start_n, tile_end, k_base, v_base, k_desc, v_desc, k_hi_desc, v_hi_desc,
            mask_ptr, b, kvh, h64, i, i64, row_ok, offs_d, offs_dv, offs_hi, stride_kn, stride_kd, stride_vn,
            stride_vd, stride_mb, stride_mh, stride_ml, stride_mn, sm_scale, D, DV, BLOCK_N, MASK_KIND, IS_CAUSAL,
            UPCAST, PRECISION, USE_TMA, 0, softcap, False, SOFTCAP, slope, ALIBI, D_LO, MASK_ROW, USE_TMA)
    return acc, acc_hi, m_i, l_i


@triton.jit
def _attend_visible(q, q_hi, acc, acc_hi, m_i, l_i, split, num_splits, kv_len,
                    k_ptr, v_ptr, k_desc, v_desc, k_hi_desc, v_hi_desc, mask_ptr, b, kvh, mb, i, row_ok, offs_d,
                    offs_dv, offs_hi,
                    stride_kb, stride_kh, stride_kn, stride_kd,
                    stride_vb, stride_vh, stride_vn, stride_vd,
                    stride_mb, stride_mh, stride_ml, stride_mn,
                    sm_scale, L, G, D, DV, n_scan: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK_T: tl.constexpr, MASK_KIND: tl.constexpr,
                    HEAD_BCAST: tl.constexpr, IS_CAUSAL: tl.constexpr, UPCAST: tl.constexpr,
                    PRECISION: tl.constexpr, softcap=0.0, SOFTCAP: tl.constexpr = False, alibi_ptr=0,
                    ALIBI: tl.constexpr = False, USE_TMA: tl.constexpr = False, ONE_CHUNK: tl.constexpr = False,
                    D_LO: tl.constexpr = 0):
    """Online softmax of the query tile over the visible tiles among split ``split``'s strided share of keys
    [0, kv_len) (see the module docstring). Same state, head chunks and arguments as ``attend._attend_chunks`` (the
    descriptors read only with USE_TMA), and returns (acc, acc_hi, m_i, l_i); ``i``: the query rows' positions;
    ``n_scan``: the query positions to scan with HEAD_BCAST; ONE_CHUNK: CHUNK_T covers every split's tiles."""
    k_base = k_ptr + b.to(tl.int64) * stride_kb + kvh.to(tl.int64) * stride_kh
    v_base = v_ptr + b.to(tl.int64) * stride_vb + kvh.to(tl.int64) * stride_vh
    g = (mb * BLOCK_M + tl.arange(0, BLOCK_M)) // L
    h64 = (kvh * G + g).to(tl.int64)
    i64 = i.to(tl.int64)
    slope = i.to(tl.float32) * 0.0
    if ALIBI:
        slope = tl.load(alibi_ptr + h64, mask=row_ok, other=0.0).to(tl.float32)
    MASK_ROW: tl.constexpr = HEAD_BCAST and n_scan == 1  # one mask row per batch row: a (BLOCK_N,) load a tile
    WHOLE_KIND: tl.constexpr = 0 if (MASK_KIND == 1 and MASK_ROW) else MASK_KIND  # the mask in the TMA loop's tiles
    owned = tl.cdiv(tl.maximum(tl.cdiv(kv_len, BLOCK_N) - split, 0), num_splits)
    offs_c = tl.arange(0, CHUNK_T)
    # one chunk holds every owned tile: constant bounds, a loop of one trip that the compiler removes
    for c0 in range(0, CHUNK_T if ONE_CHUNK else owned, CHUNK_T):
        j = c0 + offs_c
        tiles = split + j * num_splits
        some, every, hi = _visible_tiles(mask_ptr, b, kvh, mb, tiles, j < owned, kv_len, stride_mb, stride_mh,
                                         stride_ml, stride_mn, L, G, n_scan, BLOCK_M, BLOCK_N, MASK_KIND, HEAD_BCAST)
        if USE_TMA:  # the chunk's leading run of whole tiles by the copy engine, pipelined
            if MASK_KIND == 1 and MASK_ROW:  # a bool row: the tiles it shows whole, no mask read in them
                whole = every
            else:  # the kept tiles whose last key is visible, the mask applied per key
                whole = some & (hi == (tiles + 1) * BLOCK_N)
            # tiles [c0, c0 + run) are whole: their positions follow from the loop index, as the valid-length loop's
            # do (no compaction in the loop); a prefix's kept tiles are such a run (and its boundary tile), a full
            # cache's every chunk
            run = tl.min(tl.where(whole, CHUNK_T, offs_c), axis=0)
            for jj in range(0, run):
                start_n = (split + (c0 + jj) * num_splits) * BLOCK_N
                acc, acc_hi, m_i, l_i = _attend_step(
                    q, q_hi, acc, acc_hi, m_i, l_i, start_n, start_n + BLOCK_N, k_base, v_base, k_desc, v_desc,
                    k_hi_desc, v_hi_desc, mask_ptr, b, kvh, h64, i, i64, row_ok, offs_d, offs_dv, offs_hi, stride_kn,
                    stride_kd, stride_vn, stride_vd, stride_mb, stride_mh, stride_ml, stride_mn, sm_scale, D, DV,
                    BLOCK_N, WHOLE_KIND, IS_CAUSAL, UPCAST, PRECISION, True, 0, softcap, False, SOFTCAP, slope, ALIBI,
                    D_LO, MASK_ROW)
            some = some & (offs_c >= run)
        # the (other) kept tiles, compacted, each up to its last visible key; after a TMA loop not pipelined, so
        # that it adds no shared-memory buffers
        acc, acc_hi, m_i, l_i = _attend_picked(
            q, q_hi, acc, acc_hi, m_i, l_i, some, tiles, hi, k_base, v_base, k_desc, v_desc, k_hi_desc, v_hi_desc,
            mask_ptr, b, kvh, h64, i, i64, row_ok, offs_d, offs_dv, offs_hi, stride_kn, stride_kd, stride_vn,
            stride_vd, stride_mb, stride_mh, stride_ml, stride_mn, sm_scale, D, DV, BLOCK_N, MASK_KIND, IS_CAUSAL,
            UPCAST, PRECISION, USE_TMA, 1 if USE_TMA else None, softcap, SOFTCAP, slope, ALIBI, MASK_ROW, D_LO)
    return acc, acc_hi, m_i, l_i
