"""Stream-K's iteration space, and its merge as a second launch.

``_iteration_space`` cuts (batch row x KV head x M block x KV tile), batch-major, from the valid lengths on device;
the stream-K kernel walks it and this module's merge finds each output tile's contributors in it again.

``stream_k_merge`` (``stream_k_decode(merge_launch=True)``): the persistent grid parks every partial segment in its
workspace slots and a second launch, chained by programmatic dependent launch, merges each output tile split across
programs. In one launch the program that arrives last merges a tile after its own share, at most two tiles, each in
steps over the partials; the tuner's timings at 3fed422 (H100, lhs25 B1 32/8 D128, 185k and 371k keys) gave
stream-K the fastest streaming (3.13-3.16 TB/s against split-KV's 3.08) and 19-27 µs of fixed cost against 7. Here
every tile's merge runs in parallel, over shares of Dv.
"""
from __future__ import annotations

import triton
import triton.language as tl

try:  # grid dependency control (programmatic dependent launch); absent from older Tritons
    from triton.language.extra.cuda import gdc_wait
except ImportError:  # pragma: no cover - then pdl_supported() is False and the branch is never compiled
    gdc_wait = None

from .launch import KernelLauncher
from .partials import _finish, _finish_parts, _merge_step, _merged_rows, _store_lse, _store_rows


@triton.jit
def _iteration_space(valid_ptr, start_ptr, B, N, L, tiles_per_b, GRID, BLOCK_B: tl.constexpr,
                     BLOCK_N: tl.constexpr, HAS_VALID: tl.constexpr, IS_CAUSAL: tl.constexpr,
                     HAS_START: tl.constexpr):
    """Stream-K's iteration space from the (B,) valid lengths and first keys on device: (offs_b, lens, starts, nblk
    (KV tiles per row: at least one, an empty row still owns a fully masked iteration), excl / incl (the iterations
    before / up to each row), total iterations, share (iterations per program))."""
    offs_b = tl.arange(0, BLOCK_B)
    b_ok = offs_b < B
    if HAS_VALID:
        lens = tl.load(valid_ptr + offs_b, mask=b_ok, other=0).to(tl.int32)
        lens = tl.minimum(tl.maximum(lens, 0), N)
    else:
        lens = tl.zeros([BLOCK_B], dtype=tl.int32) + N
    if IS_CAUSAL:
        lens = tl.minimum(lens, L)  # no query row sees a key at or past L
    # A window's first key per row, rounded down to a tile (the keys below it are masked in _attend_tile): a row's
    # iterations cover only [firsts, lens), the last W keys.
    starts = lens * 0
    if HAS_START:
        starts = tl.minimum(tl.maximum(tl.load(start_ptr + offs_b, mask=b_ok, other=0).to(tl.int32), 0), lens)
    firsts = starts // BLOCK_N * BLOCK_N
    nblk = tl.maximum(tl.cdiv(lens - firsts, BLOCK_N), 1)
    cnt = tl.where(b_ok, nblk * tiles_per_b, 0)
    incl = tl.cumsum(cnt, axis=0)
    excl = incl - cnt
    total = tl.sum(cnt, axis=0)
    return offs_b, lens, starts, nblk, excl, incl, total, tl.cdiv(total, GRID)


@triton.jit
def _merge_tile(ws_o_ptr, ws_lse_ptr, first_p, last_p, share, ts, r, row_ok, offs_dv, stride_ws, stride_wm,
                stride_wd, stride_wls, stride_wlm, stride_wlpart, DV, BLOCK_R: tl.constexpr, MERGE_P: tl.constexpr):
    """Merge the partials that programs ``first_p`` to ``last_p`` left of the output tile whose first iteration is
    ``ts`` (rows ``r`` where ``row_ok``, columns ``offs_dv``), MERGE_P partials per step, loaded together (their loads
    are independent) and past L1 (other programs wrote them): (row max, sum, acc (BLOCK_R, len(offs_dv))) as in
    ``partials._merge_step``. A program's partial is in its slot 0 when the tile began at or before its share (the
    segment that starts its share), else in slot 1."""
    mm = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    den = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, offs_dv.shape[0]], dtype=tl.float32)
    offs_p = tl.arange(0, MERGE_P)
    for p0 in range(first_p, last_p + 1, MERGE_P):
        p = p0 + offs_p
        ok = (p <= last_p)[:, None] & row_ok[None, :]
        ps = p * 2 + (p * share < ts).to(tl.int32)
        pl = tl.load(ws_lse_ptr + ps[:, None] * stride_wls + r[None, :] * stride_wlm, mask=ok, other=float("-inf"),
                     cache_modifier=".cg")  # (MERGE_P, BLOCK_R), natural log
        pll = tl.load(ws_lse_ptr + stride_wlpart + ps[:, None] * stride_wls + r[None, :] * stride_wlm, mask=ok,
                      other=float("-inf"), cache_modifier=".cg")
        po = tl.load(ws_o_ptr + ps[:, None, None] * stride_ws + r[None, :, None] * stride_wm
                     + offs_dv[None, None, :] * stride_wd, mask=ok[:, :, None] & (offs_dv[None, None, :] < DV),
                     other=0.0, cache_modifier=".cg")  # (MERGE_P, BLOCK_R, len(offs_dv))
        mm, den, acc = _merge_step(mm, den, acc, pl, po, pll)
    return mm, den, acc


@triton.jit
def _stream_k_merge_kernel(
    # the stream-K launch's (``_stream_k_kernel``): valid lengths and first keys (or dummies), its workspace (two
    # slots per program: partial outputs, then (row max, log l) planes) and the final output and LSE
    valid_ptr, start_ptr, ws_o_ptr, ws_lse_ptr, o_ptr, lse_ptr,
    stride_ob, stride_oh, stride_ol, stride_od, stride_lb, stride_lh, stride_ll, stride_lplane,  # output, LSE
    stride_ws, stride_wm, stride_wd, stride_wls, stride_wlm, stride_wlpart,  # workspace (slot, row, dim; planes)
    B, N, L, G, HKV, NUM_M, GRID,  # as in the stream-K launch
    DV: tl.constexpr,  # head dim of V
    BLOCK_B: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,  # as in the stream-K launch
    BLOCK_R: tl.constexpr,  # rows merged per tile: the tile's real ones, up to a power of two
    BLOCK_DV: tl.constexpr,  # the padded Dv's share of one program (the grid's second axis)
    MERGE_P: tl.constexpr,  # partials loaded per step
    HAS_VALID: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_START: tl.constexpr,
    WRITE_LSE: tl.constexpr, LSE_PLANES: tl.constexpr,  # as in the stream-K launch
    WAIT_PRIOR: tl.constexpr,  # launched as a programmatic dependent of the stream-K grid
):
    if WAIT_PRIOR:
        gdc_wait()  # the stream-K grid's partials are complete and visible from here on
    tile = tl.program_id(0)  # b * HKV * NUM_M + t_in_b
    tiles_per_b = HKV * NUM_M
    offs_b, lens, starts, nblk, excl, incl, total, share = _iteration_space(
        valid_ptr, start_ptr, B, N, L, tiles_per_b, GRID, BLOCK_B, BLOCK_N, HAS_VALID, IS_CAUSAL, HAS_START)
    b = tile // tiles_per_b
    t_in_b = tile - b * tiles_per_b
    sel = offs_b == b
    nb = tl.sum(tl.where(sel, nblk, 0), axis=0)
    ts = tl.sum(tl.where(sel, excl, 0), axis=0) + t_in_b * nb  # the tile's first iteration
    first_p = ts // share
    last_p = (ts + nb - 1) // share
    if last_p > first_p:  # else one program walked the whole tile and wrote it out
        kvh = t_in_b // NUM_M
        mb = t_in_b - kvh * NUM_M
        r, g, i, row_ok = _merged_rows(mb, L, G, BLOCK_M, BLOCK_R)
        offs_dv = tl.program_id(1) * BLOCK_DV + tl.arange(0, BLOCK_DV)
        mm, den, acc = _merge_tile(ws_o_ptr, ws_lse_ptr, first_p, last_p, share, ts, r, row_ok, offs_dv, stride_ws,
                                   stride_wm, stride_wd, stride_wls, stride_wlm, stride_wlpart, DV, BLOCK_R, MERGE_P)
        first_share = tl.program_id(1) == 0  # one program of the tile's Dv shares writes its LSE
        if LSE_PLANES:
            o, lse, log_l = _finish_parts(acc, mm, den)
            if first_share:
                _store_lse(log_l, lse_ptr + stride_lplane, b, kvh, g, i, row_ok, stride_lb, stride_lh, stride_ll, G)
        else:
            o, lse = _finish(acc, mm, den)
        _store_rows(o, lse, o_ptr, lse_ptr, b, kvh, g, i, row_ok, offs_dv, stride_ob, stride_oh, stride_ol,
                    stride_od, stride_lb, stride_lh, stride_ll, G, DV, False)
        if WRITE_LSE:
            if first_share:
                _store_lse(lse, lse_ptr, b, kvh, g, i, row_ok, stride_lb, stride_lh, stride_ll, G)


_STREAM_K_MERGE_LAUNCH = KernelLauncher(_stream_k_merge_kernel)


def stream_k_merge(geo, grid: int, block_n: int, workspace, out, lse, valid_len, key_start, is_causal: bool,
                   pdl: bool) -> None:
    """Merge the output tiles that stream-K's ``grid`` programs left in ``workspace`` (``stream_k_decode`` with
    ``merge_launch``) into ``out`` (B, Hq, L, Dv) and ``lse`` ((B, Hq, L), its (2, B, Hq, L) planes, or None).
    ``geo``: the launch's ``common.DecodeGeometry``; ``pdl``: launched as a programmatic dependent of the stream-K
    grid (which must have called ``gdc_launch_dependents``).

    One program per output tile and share of the padded Dv: for few tiles (a decode step at small batch) the
    shares are 16 columns wide, so that many programs each merge their columns in few steps."""
    from .common import next_pow2

    ws_o, ws_lse, _ = workspace
    tiles = geo.B * geo.Hkv * geo.num_m
    dv_split = max(1, geo.block_dv // 16) if tiles < 256 else 1
    block_dv = geo.block_dv // dv_split
    merge_p = max(2, min(next_pow2(grid), 8192 // (geo.block_r * block_dv)))
    planes = lse is not None and lse.dim() == 4
    lstr = tuple(lse.stride()[-3:]) if lse is not None else (0, 0, 0)
    dummy = out
    _STREAM_K_MERGE_LAUNCH(
        (tiles, dv_split), valid_len if valid_len is not None else dummy,
        key_start if key_start is not None else dummy, ws_o, ws_lse, out, lse if lse is not None else dummy,
        *out.stride(), *lstr, lse.stride(0) if planes else 0, *ws_o.stride(), *ws_lse.stride()[1:],
        ws_lse.stride(0), geo.B, geo.N, geo.L, geo.G, geo.Hkv, geo.num_m, grid, DV=geo.Dv,
        BLOCK_B=max(2, next_pow2(geo.B)), BLOCK_M=geo.block_m, BLOCK_N=block_n, BLOCK_R=geo.block_r,
        BLOCK_DV=block_dv, MERGE_P=merge_p, HAS_VALID=valid_len is not None, IS_CAUSAL=bool(is_causal),
        HAS_START=key_start is not None, WRITE_LSE=lse is not None, LSE_PLANES=planes, WAIT_PRIOR=pdl,
        num_warps=4, **({"launch_pdl": True} if pdl else {}),
    )
