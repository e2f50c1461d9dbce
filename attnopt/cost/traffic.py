"""What one decode launch reads and writes, in bytes, for the kernel cost model (``attnopt.cost.kernel``): K and V
up to the planned length, the mask, the query and output, the fp32 softmax states, one KV tile; the packed query
block of the kernels; and the roofline (those bytes at full read bandwidth), the floor of any plan.
"""
from __future__ import annotations

import math

from attnopt.hardware import HardwareProfile
from attnopt.site import AttentionSite


#: KV length assumed when a site's length is symbolic and carries no hint.
DEFAULT_KV_LEN = 4096
#: Largest packed query block of the attnopt kernels (``runtime/kernels/common.py``: MAX_BLOCK_M).
MAX_BLOCK_M = 64


def head_chunk_widths(head_dim: int, head_dim_v: int) -> tuple[int, int]:
    """How the kernels cut the head dims (``runtime/kernels/common.py``: head_dim_split): (width of the first
    chunk, width of the second), both powers of two, or (0, 0) for one chunk padded to a power of two. The first
    chunk is the largest power of two <= D, the second covers the rest, padded to a power of two of at least 32
    (a 16-wide chunk spilled registers; ptxas sm_90); cut only where that pads less than one chunk and D == Dv:
    72, 80, 96 (64 + 32), 160 (128 + 32), 192 (128 + 64)."""
    if head_dim != head_dim_v or head_dim < 1:
        return 0, 0
    lo = 1 << (int(head_dim).bit_length() - 1)
    hi = max(32, _next_pow2(head_dim - lo)) if head_dim > lo else 0
    return (lo, hi) if hi and lo + hi < _next_pow2(head_dim) else (0, 0)


def padded_head_dim(head_dim: int, head_dim_v: int | None = None) -> int:
    """Columns of Q/K the kernels hold per row (shared memory, MMA work): the two chunks' widths where
    ``head_chunk_widths`` cuts the head dim, else the next power of two (at least 16)."""
    lo, hi = head_chunk_widths(head_dim, head_dim if head_dim_v is None else head_dim_v)
    return lo + hi if lo else max(16, _next_pow2(head_dim))


def _kv_len(site: AttentionSite) -> int:
    n = site.effective_kv_len
    return int(n) if n is not None else DEFAULT_KV_LEN


def _keys_read(site: AttentionSite) -> int:
    """Keys the attnopt kernels read per row: a sliding window's band (``site.keys_read``: they start at the
    window's first key, found on device), else the whole length. SDPA with the window as a mask reads them all."""
    n = site.keys_read
    return int(n) if n is not None else DEFAULT_KV_LEN


def _dims(site: AttentionSite) -> tuple[int, int, int, int, int, int, int]:
    """(B, Hkv, G, L, D, Dv, element bytes)."""
    return (site.batch or 1, site.kv_heads, max(site.group_size, 1), site.q_len or 1, site.head_dim,
            site.v_head_dim or site.head_dim, site.dtype_bytes)


def _next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def block_m_for(rows: int) -> int:
    """Packed query rows per tile for ``rows = G * q_len``: a power of two in [16, 64] (as the kernels use)."""
    return max(16, min(MAX_BLOCK_M, _next_pow2(max(rows, 1))))


def m_blocks(site: AttentionSite) -> int:
    _, _, g, L, *_ = _dims(site)
    return math.ceil(g * L / block_m_for(g * L))


def kv_bytes(site: AttentionSite) -> float:
    """Bytes of K and V read up to the planned KV length (the roofline numerator)."""
    b, hkv, _, _, d, dv, e = _dims(site)
    return float(b * hkv * _kv_len(site) * (d + dv) * e)


def mask_bytes(site: AttentionSite) -> float:
    """Bytes of the mask the kernels read: an arbitrary bool mask, broadcast over heads, is (B, L, N)."""
    if site.mask_kind != "arbitrary":
        return 0.0
    b, _, _, L, *_ = _dims(site)
    return float(b * L * _kv_len(site))


def io_bytes(site: AttentionSite) -> float:
    """Query read plus output written."""
    b, hkv, g, L, d, dv, e = _dims(site)
    return float(b * hkv * g * L * (d + dv) * e)


def state_bytes(site: AttentionSite) -> float:
    """Bytes of one fp32 softmax state (o, lse) for the whole site: (B, Hq, L, Dv + 1) x 4."""
    b, hkv, g, L, _, dv, _ = _dims(site)
    return float(b * hkv * g * L * (dv + 1) * 4)


def packed_state_bytes(site: AttentionSite) -> float:
    """Bytes of one fp32 softmax state as it crosses ranks, with the row max and log l apart (exact weights for a
    row that finfo.min hides; ``runtime/distributed/local.py``): (B, Hq, L, Dv + 2) x 4."""
    b, hkv, g, L, _, dv, _ = _dims(site)
    return float(b * hkv * g * L * (dv + 2) * 4)


def total_bytes(site: AttentionSite) -> float:
    return kv_bytes(site) + mask_bytes(site) + io_bytes(site)


def roofline_us(site: AttentionSite, hw: HardwareProfile) -> float:
    """Bytes that must be read (K, V, mask, query) at the full read bandwidth: the floor of any plan."""
    return total_bytes(site) / (hw.hbm_read_gbps * 1e3)


def _tile_bytes(site: AttentionSite, block_n: int) -> float:
    """Bytes one program reads per KV tile: K and V rows, plus its slice of the mask."""
    _, _, g, L, d, dv, e = _dims(site)
    mask = block_n * L if site.mask_kind == "arbitrary" else 0
    return float(block_n * (d + dv) * e + mask)
