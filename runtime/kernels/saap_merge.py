"""The SAAP attention launch's in-launch merge (``fused_merge``), in two levels of arrival.

The splits of an output tile are cut into groups of ``GROUP`` consecutive splits. Each split stores its partial state
and arrives at its group's counter; the last to arrive merges the group's partials (all loaded at once) into the
slot of the group's first split, then arrives at the tile's counter; the last group to arrive merges the group
partials into the output. Every counter is reset by the program that found it complete, so a launch leaves them all
at zero (CUDA-graph replays). Merging states is associative, so the result is the merge of all the tile's partials.

Why two levels: one program merging all S partials (``partials._arrive_and_merge``) reads them MERGE_P at a time, one
L2 round trip a step, on the launch's critical path (S = 64 at llama3-8b 128k: 8 steps, the tail longer than the
separate merge launch it saves); here the tail is two merges of about sqrt(S) partials, each loaded at once.
"""
from __future__ import annotations

import math

import triton
import triton.language as tl

from .partials import _finish, _finish_parts, _load_partials, _merge_step, _merged_row_offsets, _store_lse, \
    _store_rows

#: fp32 values a merging program holds per load (GROUP x rows x Dv): 32 registers a thread at 4 warps.
MERGE_ELEMENTS = 4096


def merge_group_size(num_splits: int, block_r: int, block_dv: int) -> int:
    """Splits per first-level group: a power of two near sqrt(num_splits) (two merges of about the same width),
    at most what ``MERGE_ELEMENTS`` allows for block_r rows of block_dv values."""
    cap = max(1, MERGE_ELEMENTS // (block_r * block_dv))
    return max(1, min(triton.next_power_of_2(math.isqrt(max(1, num_splits - 1)) + 1), 1 << (cap.bit_length() - 1)))


def merge_counter_count(tiles: int, num_splits: int) -> int:
    """Arrival counters the two-level merge needs: one per tile, then up to num_splits groups per tile."""
    return tiles * (1 + num_splits)


@triton.jit
def _merge_slots(o_ptr, lse_ptr, first, stride_slot, count, o_row, l_row, ok_c, offs_dv, stride_os, stride_od,
                 stride_ls, stride_lpart, DV, BLOCK_R: tl.constexpr, GROUP: tl.constexpr):
    """Merge ``count`` partial states at slots first, first + stride_slot, ... (GROUP loaded at a time; one load for
    count <= GROUP): (row max, l, unnormalised output sum) over the tile's rows."""
    mm = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    den = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, offs_dv.shape[0]], dtype=tl.float32)
    offs_g = tl.arange(0, GROUP)
    for c0 in range(0, count, GROUP):
        # slots past ``count`` lie at or past first + count * stride_slot: _load_partials masks them off
        sp = first + (c0 + offs_g) * stride_slot
        pl, pll, po = _load_partials(o_ptr, lse_ptr, sp, first + count * stride_slot, o_row, l_row, ok_c, offs_dv,
                                     stride_os, stride_od, stride_ls, stride_lpart, DV)
        mm, den, acc = _merge_step(mm, den, acc, pl, po, pll)
    return mm, den, acc


@triton.jit
def _arrive_and_merge_grouped(counter_ptr, tile, num_tiles, split, o_ptr, lse_ptr, out_ptr, lse_out_ptr, mb, b, kvh,
                              offs_dv, stride_os, stride_ob, stride_oh, stride_ol, stride_od, stride_ls, stride_lb,
                              stride_lh, stride_ll, stride_lpart, stride_fb, stride_fh, stride_fl, stride_fd,
                              stride_gb, stride_gh, stride_gl, NUM_PARTS, L, G, DV, BLOCK_M: tl.constexpr,
                              BLOCK_R: tl.constexpr, GROUP: tl.constexpr, WRITE_LSE_OUT: tl.constexpr):
    """Count split ``split``'s arrival (its partial is stored in slot ``split`` of the (S, B, Hq, L, Dv) outputs at
    ``o_ptr`` and the (row max, log l) planes at ``lse_ptr`` / ``lse_ptr + stride_lpart``) at output ``tile`` of
    ``num_tiles``; see the module docstring. ``counter_ptr``: ``merge_counter_count(num_tiles, NUM_PARTS)`` int32
    counters, zero before and after every launch (the tiles', then ``cdiv(NUM_PARTS, GROUP)`` groups per tile)."""
    n_groups = tl.cdiv(NUM_PARTS, GROUP)
    group = split // GROUP
    first = group * GROUP
    size = tl.minimum(NUM_PARTS - first, GROUP)
    group_counter = counter_ptr + num_tiles + tile * n_groups + group
    tl.debug_barrier()  # every thread's partial is stored before the release below
    arrived = tl.atomic_add(group_counter, 1, sem="acq_rel", scope="gpu")
    if arrived == size - 1:
        tl.debug_barrier()
        gc, ic, ok_c, o_row, l_row = _merged_row_offsets(mb, b, kvh, L, G, stride_ob, stride_oh, stride_ol, stride_lb,
                                                         stride_lh, stride_ll, BLOCK_M, BLOCK_R)
        mm, den, acc = _merge_slots(o_ptr, lse_ptr, first, 1, size, o_row, l_row, ok_c, offs_dv, stride_os,
                                    stride_od, stride_ls, stride_lpart, DV, BLOCK_R, GROUP)
        tl.atomic_xchg(group_counter, 0, sem="relaxed", scope="gpu")  # ready for the next launch
        # the group's state replaces its first split's partial (read above, by this program only)
        o, m_part, log_l = _finish_parts(acc, mm, den)
        slot = first.to(tl.int64)
        _store_rows(o, m_part, o_ptr + slot * stride_os, lse_ptr + slot * stride_ls, b, kvh, gc, ic, ok_c, offs_dv,
                    stride_ob, stride_oh, stride_ol, stride_od, stride_lb, stride_lh, stride_ll, G, DV, True)
        _store_lse(log_l, lse_ptr + stride_lpart + slot * stride_ls, b, kvh, gc, ic, ok_c, stride_lb, stride_lh,
                   stride_ll, G)
        tl.debug_barrier()  # the group's state is stored before the release below
        done = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if done == n_groups - 1:
            tl.debug_barrier()
            mm, den, acc = _merge_slots(o_ptr, lse_ptr, 0, GROUP, n_groups, o_row, l_row, ok_c, offs_dv, stride_os,
                                        stride_od, stride_ls, stride_lpart, DV, BLOCK_R, GROUP)
            o2, lse2 = _finish(acc, mm, den)
            _store_rows(o2, lse2, out_ptr, lse_out_ptr, b, kvh, gc, ic, ok_c, offs_dv, stride_fb, stride_fh, stride_fl,
                        stride_fd, stride_gb, stride_gh, stride_gl, G, DV, WRITE_LSE_OUT)
            tl.atomic_xchg(counter_ptr + tile, 0, sem="relaxed", scope="gpu")
