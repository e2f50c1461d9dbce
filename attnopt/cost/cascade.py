"""Cost of the shared-prefix cascade plan: one split-KV pass over the prefix for all rows at once, one over the
per-row suffixes, and one merge of every partial state.

The prefix pass is priced as a split-KV launch of one batch row whose query tile holds the B rows' queries
(``G * B * L`` packed rows, so ``m_blocks`` passes over the prefix bytes instead of ``B``); the suffix pass as a
split-KV launch over the ``S = N - P`` suffix keys of every row. Neither merges on its own: the partial states of
both are written once and read once by one merge launch.
"""
from __future__ import annotations

import dataclasses

from attnopt.hardware import HardwareProfile
from attnopt.site import AttentionSite

from .kernel import _kv_len, _stream_us, _tile_bytes, config_adjust, io_bytes, m_blocks, state_bytes, wave_time_us


def prefix_site(site: AttentionSite) -> AttentionSite:
    """The prefix pass as a site: one batch row whose queries are the B rows' (q_len B * L), over the P prefix keys."""
    rows = (site.batch or 1) * (site.q_len or 1)
    return dataclasses.replace(site, batch=1, q_len=rows, kv_len=int(site.shared_prefix or 0), kv_len_hint=None)


def suffix_site(site: AttentionSite) -> AttentionSite:
    """The suffix pass as a site: every row over its own N - P keys."""
    return dataclasses.replace(site, kv_len=max(0, _kv_len(site) - int(site.shared_prefix or 0)), kv_len_hint=None)


def _pass_us(site: AttentionSite, hw: HardwareProfile, splits: int, block_n: int, num_warps: int) -> float:
    """One split-KV launch without its merge: ``splits`` programs per output tile, each over its share of tiles."""
    n_tiles = max(1, -(-_kv_len(site) // block_n))
    tiles = -(-n_tiles // splits)
    programs = (site.batch or 1) * site.kv_heads * m_blocks(site) * splits
    return hw.launch_us + wave_time_us(hw, programs, tiles, _tile_bytes(site, block_n), hw.kernel_efficiency, num_warps)


def cascade_us(site: AttentionSite, hw: HardwareProfile, prefix_splits: int, suffix_splits: int, block_n: int,
               num_warps: int = 4, num_stages: int = 2) -> float:
    """Estimated µs of a cascade plan at ``site`` (``site.shared_prefix`` set): the prefix pass, the suffix pass,
    the partial states written and read back by one merge, which also writes the output."""
    if prefix_splits < 1 or suffix_splits < 1 or block_n < 1:
        raise ValueError(f"splits and block_n must be >= 1, got {prefix_splits}, {suffix_splits}, {block_n}")
    t = _pass_us(prefix_site(site), hw, prefix_splits, block_n, num_warps)
    t += _pass_us(suffix_site(site), hw, suffix_splits, block_n, num_warps)
    partials = state_bytes(site) * (prefix_splits + suffix_splits)
    t += _stream_us(hw, partials)                                        # the passes write them
    t += hw.launch_us + _stream_us(hw, partials + io_bytes(site) / 2)    # the merge reads them, writes o
    return config_adjust(hw, f"cascade/{block_n}/{num_warps}/{num_stages}", t * hw.emulation_slowdown)
