"""Kernel cost of the single-device decode strategies, in microseconds.

Every estimate is ``launches * launch_us + max(bytes / bandwidth, tiles / parallelism * per_tile_us)`` plus
the merge, with the bandwidth scaled by how much of the chip the grid fills (wave quantisation).
"""
from __future__ import annotations

import math

from attnopt.hardware import HardwareProfile
from attnopt.site import AttentionSite


def kv_bytes(site: AttentionSite) -> float:
    """Bytes of K and V read up to the planned KV length (the roofline numerator)."""
    n = site.effective_kv_len or 4096
    b = site.batch or 1
    dv = site.v_head_dim or site.head_dim
    return float(b * site.kv_heads * n * (site.head_dim + dv) * site.dtype_bytes)


def roofline_us(site: AttentionSite, hw: HardwareProfile) -> float:
    return kv_bytes(site) / (hw.hbm_read_gbps * 1e3)


def _fill(programs: int, hw: HardwareProfile, num_warps: int = 4) -> float:
    """Fraction of peak bandwidth a grid of ``programs`` reaches, with wave quantisation."""
    slots = hw.sm_count * hw.occupancy.get(num_warps, 2)
    if programs <= 0:
        return 1e-3
    waves = math.ceil(programs / slots)
    busy = programs / (waves * slots)
    # One program per SM already reaches a good share of bandwidth; more resident programs hide latency.
    per_sm = min(1.0, programs / hw.sm_count)
    return max(1e-3, min(1.0, 0.35 + 0.65 * per_sm) * (0.5 + 0.5 * busy))


def dense_us(site: AttentionSite, hw: HardwareProfile) -> float:
    """SDPA (flash/cuDNN decode): one program per (batch, query head) block, no KV split."""
    b = site.batch or 1
    programs = b * site.q_heads
    bw = hw.hbm_read_gbps * 1e3 * hw.kernel_efficiency * _fill(programs, hw)
    read = kv_bytes(site) * max(1.0, site.group_size / 2.0) if site.gqa_source == "repeat_kv" else kv_bytes(site)
    return 2 * hw.launch_us + read / bw


def split_kv_us(site: AttentionSite, hw: HardwareProfile, num_splits: int, block_n: int, num_warps: int = 4) -> float:
    b = site.batch or 1
    n = site.effective_kv_len or 4096
    programs = b * site.kv_heads * num_splits
    bw = hw.hbm_read_gbps * 1e3 * hw.kernel_efficiency * _fill(programs, hw, num_warps)
    tiles_per_program = math.ceil(n / num_splits / block_n)
    compute = tiles_per_program * hw.per_tile_us * math.ceil(programs / (hw.sm_count * hw.occupancy.get(num_warps, 2)))
    dv = site.v_head_dim or site.head_dim
    merge_bytes = b * site.q_heads * (site.q_len or 1) * num_splits * (dv + 1) * 4 * 2
    merge = hw.launch_us + merge_bytes / (hw.hbm_read_gbps * 1e3) if num_splits > 1 else 0.0
    return hw.launch_us + max(kv_bytes(site) / bw, compute) + merge


def stream_k_us(site: AttentionSite, hw: HardwareProfile, grid: int, block_n: int, num_warps: int = 4) -> float:
    b = site.batch or 1
    n = site.effective_kv_len or 4096
    tiles = b * site.kv_heads * math.ceil(n / block_n)
    programs = min(grid, tiles)
    bw = hw.hbm_read_gbps * 1e3 * hw.kernel_efficiency * _fill(programs, hw, num_warps)
    compute = math.ceil(tiles / max(programs, 1)) * hw.per_tile_us
    dv = site.v_head_dim or site.head_dim
    outputs = b * site.kv_heads
    fixups = min(programs, tiles) + outputs
    fixup_bytes = fixups * site.group_size * (site.q_len or 1) * (dv + 1) * 4 * 2
    return hw.launch_us + max(kv_bytes(site) / bw, compute) + fixup_bytes / (hw.hbm_read_gbps * 1e3) + 1.0
