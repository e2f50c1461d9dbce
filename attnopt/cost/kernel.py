"""Kernel cost of the single-device decode strategies, in microseconds.

The model, per kernel launch:

* **Bytes.** K and V up to the valid length, the mask when there is one, the query, and the fp32 partial
  states (o, lse) that split-KV and stream-K write and merge.
* **Bandwidth per program** (Little's law): a program keeps about one KV tile in flight, so it streams at
  ``tile_bytes / mem_latency_us``; programs on one SM share its cap (``hw.sm_gbps()``), and all resident
  programs share ``hbm_read_gbps * efficiency``.
* **Wave quantisation.** A grid of ``P`` programs runs in ``ceil(P / slots)`` waves, ``slots = sm_count x
  occupancy(num_warps)``; the last, partial wave has fewer programs, each faster but never faster than its
  own Little's-law rate.
* **Per-tile overhead.** Each program's loop costs at least ``tiles x per_tile_us``.
* **Launches and merges.** ``launch_us`` per dependent launch; the split-KV merge kernel reads every partial;
  the stream-K fix-up reads the partials of the tiles that programs share.

Every estimate is monotone: with a fixed plan, more keys, a larger batch, more heads, a larger head dim or a
wider dtype is never predicted faster (``tests/attnopt/test_cost.py``).

**Runtime rule for symbolic lengths.** A plan fixes the grid (``num_splits`` or ``grid``) and ``block_n``;
the kernel derives each program's share from the valid length on the device (split ``s`` covers tiles
``[s * T // S, (s + 1) * T // S)`` of ``T = ceil(valid_len / block_n)``; stream-K program ``p``
covers work units ``[p * ceil(U / P), ...)``). This costs nothing on the host and stays correct under
CUDA-graph replay as the cache grows. A split-KV plan with ``tiles_per_split`` sizes its grid by the cache's
length, a host integer, at each call (``SplitKVPlan.splits_at``); the estimates take the grid of the length.
``best_split_kv`` and ``best_stream_k`` pick the grid that is best
over the range of lengths a symbolic site is expected to see (``planning_lengths``).

The byte counts (K/V, mask, query and output, softmax states, one tile) and the roofline are in ``traffic``.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from attnopt.hardware import HardwareProfile
from attnopt.site import AttentionSite

from .traffic import (DEFAULT_KV_LEN, MAX_BLOCK_M, _dims, _keys_read, _kv_len, _next_pow2, _tile_bytes,  # noqa: F401
                      block_m_for, io_bytes, kv_bytes, m_blocks, mask_bytes, packed_state_bytes, roofline_us,
                      state_bytes, total_bytes)  # (re-exported: callers read them as attnopt.cost.kernel's)

#: Split counts and block sizes the planner considers.
SPLIT_CHOICES = (1, 2, 4, 8, 16, 32, 64, 128)
BLOCK_N_CHOICES = (32, 64, 128)
WARP_CHOICES = (4, 8)
#: Serial tail of the stream-K fix-up protocol (atomic arrival counter, the last program merges), µs.
#: Measured, not guessed: in benchmarks/results/kernels-nvidia-h{100,200}*.json our stream-K kernel takes
#: 20-30 µs more than split-KV at 8k-32k on both cards (e.g. H200 llama3-8b-8k: 46.4 vs 15.1 µs), so the
#: uncalibrated default is 25 µs; ``attnopt calibrate`` refits it per GPU.
STREAM_K_FIXUP_US = 25.0
#: Serial tail of split-KV's in-launch merge, in merge launches (``hw.launch_us``) until a calibration fits
#: ``fused_merge_tail_us``: no measurement yet separates it from the merge launch it replaces (which programmatic
#: dependent launch partly hides), so uncalibrated a fused plan is priced as its two-launch twin and only the measured
#: choice (``attnopt.tuning``) tells them apart.
FUSED_MERGE_TAIL_LAUNCHES = 1.0


# --------------------------------------------------------------------------------------------- calibration
#: Prefix of the per-configuration factors in ``HardwareProfile.fitted``: ``cfg:<kind>/<block_n>/<warps>/<stages>``
#: for the Triton kernels, ``cfg:dense/flash``, ``cfg:dense/flash_rows`` and ``cfg:dense/efficient`` for SDPA
#: (``dense_config``); ``cfg:<kind>`` is the kind's mean, used for a configuration the calibration did not run.
CONFIG_FACTOR_PREFIX = "cfg:"
#: Prefix of the per-configuration offsets (µs) fitted with the factors: a configuration's time is
#: ``factor * model + offset``. The offset carries what the wave model misses at small sizes (a library's fixed
#: setup per call, a second launch hidden by programmatic dependent launch), the factor what it misses per byte.
CONFIG_OFFSET_PREFIX = "cfgoff:"


def config_adjust(hw: HardwareProfile, key: str, t: float) -> float:
    """``factor * t + offset`` for one configuration (``t`` unchanged on an uncalibrated profile). The offset is
    only used with its configuration's own factor, and the result never drops below a quarter of ``factor *
    t``: increasing in ``t`` (more bytes are never predicted faster)."""
    f = config_factor(hw, key)
    off = hw.fitted.get(CONFIG_OFFSET_PREFIX + key, 0.0) if hw.fitted and \
        (CONFIG_FACTOR_PREFIX + key) in hw.fitted else 0.0
    return max(f * t + float(off), 0.25 * f * t)


def config_factor(hw: HardwareProfile, key: str) -> float:
    """Measured / modelled time of one kernel configuration on this GPU (1.0 on an uncalibrated profile).

    The wave model knows bytes, grids and waves; it does not know how well a given (block_n, num_warps,
    num_stages) pipelines its loads, which moves the time by up to ~20 % between configurations that move the
    same bytes. ``attnopt calibrate`` measures every configuration and stores the ratio."""
    if not hw.fitted:
        return 1.0
    f = hw.fitted.get(CONFIG_FACTOR_PREFIX + key)
    if f is None:
        f = hw.fitted.get(CONFIG_FACTOR_PREFIX + key.split("/")[0], 1.0)
    return float(f)


# --------------------------------------------------------------------------------------------- the wave model
def wave_time_us(hw: HardwareProfile, programs: int, tiles_per_program: int, tile_bytes: float,
                 efficiency: float, num_warps: int = 4) -> float:
    """Time for ``programs`` equal programs, each streaming ``tiles_per_program`` tiles of ``tile_bytes``.

    Parameters
    ----------
    hw
        The profile (SM count, occupancy, bandwidth, memory latency, per-tile cost).
    programs
        Grid size. Programs beyond ``hw.slots(num_warps)`` run in later waves.
    tiles_per_program
        KV tiles of the heaviest program (the wave waits for it).
    tile_bytes
        Bytes per tile.
    efficiency
        Fraction of ``hbm_read_gbps`` the kernel reaches when the chip is saturated.
    num_warps
        Selects the occupancy (resident programs per SM).
    """
    if programs <= 0 or tiles_per_program <= 0:
        return 0.0
    slots = hw.slots(num_warps)
    peak = hw.hbm_read_gbps * 1e3 * efficiency  # bytes per µs
    per_program = tile_bytes / hw.mem_latency_us
    sm_cap = hw.sm_gbps() * 1e3
    work = tiles_per_program * tile_bytes

    def one_wave(active: int) -> float:
        if active <= 0:
            return 0.0
        # The scheduler spreads programs over SMs first; programs sharing an SM share its bandwidth.
        bw = min(per_program, sm_cap / math.ceil(active / hw.sm_count), peak / active)
        return max(work / bw, tiles_per_program * hw.per_tile_us)

    full, rem = divmod(programs, slots)
    return full * one_wave(slots) + one_wave(rem)


def _stream_us(hw: HardwareProfile, nbytes: float) -> float:
    """A bandwidth-bound elementwise pass over ``nbytes`` (merge kernels)."""
    return nbytes / (hw.hbm_read_gbps * 1e3 * hw.kernel_efficiency)


# --------------------------------------------------------------------------------------------- dense (SDPA)
def dense_backend(site: AttentionSite) -> str:
    """Which SDPA kernel the dense plan reaches: ``flash`` (no mask) or ``efficient`` (a mask tensor)."""
    if site.mask_kind in ("valid_length", "arbitrary"):
        return "efficient"
    return "flash"


def dense_config(site: AttentionSite) -> str:
    """The calibration key of the SDPA kernel the dense plan reaches: ``dense/flash`` (one query token: FA2's
    split-KV decode path), ``dense/flash_rows`` (several query tokens: FA2's forward kernel, one program per
    (batch, query head), no key split), or ``dense/efficient`` (a mask tensor). The three scale differently with
    the shape, so each gets its own fitted factor and offset."""
    backend = dense_backend(site)
    if backend == "flash" and (site.q_len or 1) > 1:
        return "dense/flash_rows"
    return "dense/" + backend


def dense_us(site: AttentionSite, hw: HardwareProfile) -> float:
    """The dense plan: one SDPA call over the un-expanded K/V (``enable_gqa``), as SDPA's own pick runs it."""
    return config_adjust(hw, dense_config(site), _dense_model_us(site, hw))


def cudnn_us(site: AttentionSite, hw: HardwareProfile) -> float:
    """The dense plan with SDPA's cuDNN backend called explicitly: it splits the keys at decode as flash does, with
    or without a mask tensor, and reads the mask. So: the flash model over the whole cache, plus the mask's bytes
    (B x L x N bools), with its own calibration key ``dense/cudnn``.

    Measured on an H100 (benchmarks/results/kernels-nvidia-h100-80gb-hbm3.json): a 32k cache with its bool mask
    took cuDNN 58.5 µs, against flash's 58.9 µs over 32k keys without a mask and the memory-efficient kernel's
    1349.6 µs with the mask (what SDPA's own pick runs there); without a mask cuDNN was no slower than flash on
    any of the nine shapes, on the H200 too (kernels-nvidia-h200.json)."""
    b, _, _, L, *_ = _dims(site)
    mask = float(b * L * _kv_len(site)) if site.mask_kind in ("valid_length", "arbitrary") else 0.0
    unmasked = dataclasses.replace(site, mask_kind="none")
    return config_adjust(hw, "dense/cudnn", _dense_model_us(unmasked, hw) + mask / (hw.hbm_read_gbps * 1e3))


def _dense_model_us(site: AttentionSite, hw: HardwareProfile) -> float:
    """The dense plan's wave model, before calibration.

    Without a mask it is flash attention, which at decode packs the G query heads of a KV head into one row
    block and splits the keys (FlashAttention-2's split-KV, then a combine kernel). With a mask tensor
    (valid length, arbitrary) it is the memory-efficient kernel: one program per (batch, query head), no split,
    the G heads of one KV head sharing its K/V through L2.
    """
    b, hkv, g, L, d, dv, e = _dims(site)
    n = _kv_len(site)
    eff = hw.dense_efficiency
    if dense_backend(site) == "flash" and L > 1:
        # Measured on an H100 (benchmarks/results/cost_model-*.json): with q_len > 1 flash neither packs the G
        # heads of a KV head into one row block nor splits the keys. One program per (batch, query head, 128
        # rows) streams all N keys. The G programs of one KV head run together, so L2 serves their repeats and
        # HBM sees each tile about once; what binds instead is one of three:
        #   * each program's own streaming rate (few programs: MHA, small batches),
        #   * the L2-to-SM bandwidth, which carries every program's reads (many GQA programs),
        #   * the tensor cores, which multiply full 128-row tiles for the q_len real rows.
        # On the H100 calibration samples (calibration-samples-nvidia-h100-73d14e9.json, 12 multi-token shapes)
        # this came within 0.77-1.17x of the measured time at a 1.25 µs memory latency; the streaming term alone
        # was off by up to 1.9x.
        programs = b * hkv * g * math.ceil(L / 128)
        tiles = max(1, math.ceil(n / 128))
        tile = _tile_bytes(site, 128)
        stream = wave_time_us(hw, programs, tiles, tile, eff * g, 4)
        through_l2 = programs * tiles * tile / (hw.l2_gbps() * 1e3)
        mma = programs * tiles * 4 * 128 * 128 * max(d, dv, 128) / (hw.mma_tflops * 1e6)
        return hw.launch_us + max(stream, through_l2, mma)
    if dense_backend(site) == "flash":
        # FA2's split-KV kernel uses 256/128/64-key blocks for D <= 64 / <= 128 / larger; one 128-key
        # granularity for every D keeps the estimate monotone in D (a larger head is never cheaper).
        block_n = 128
        mb = math.ceil(g * L / 64)
        n_blocks = max(1, math.ceil(n / block_n))
        base = b * hkv * mb
        # FlashAttention-2 never splits a grid that already fills 80 % of the SMs, and splits at most
        # min(128, SMs, KV blocks) ways. Its heuristic picks the count by wave efficiency; the model takes the
        # best count in those bounds (powers of two and the bound), which keeps the estimate monotone in N.
        top = 1 if base >= 0.8 * hw.sm_count else max(1, min(128, hw.sm_count, n_blocks))
        splits = sorted({1 << k for k in range(8) if (1 << k) <= top} | {top})

        def flash(s: int) -> float:
            t = hw.launch_us + wave_time_us(hw, base * s, math.ceil(n_blocks / s), _tile_bytes(site, block_n), eff, 4)
            if s > 1:
                t += hw.launch_us + _stream_us(hw, 2 * state_bytes(site) * s)
            return t

        return min(flash(s) for s in splits)
    block_n = 64
    tiles = max(1, math.ceil(n / block_n))
    # The G programs of one KV head read the same K/V; L2 serves the repeats, so HBM sees each tile once and
    # the bandwidth the programs share is G times the unique-byte rate.
    return hw.launch_us + wave_time_us(hw, b * hkv * g * math.ceil(L / 64), tiles, _tile_bytes(site, block_n), eff * g, 4)


# --------------------------------------------------------------------------------------------- split-KV
def split_kv_us(site: AttentionSite, hw: HardwareProfile, num_splits: int, block_n: int, num_warps: int = 4,
                num_stages: int = 2, fused_merge: bool = False) -> float:
    """Split-KV (FlashDecoding): grid (B x Hkv x M-blocks, num_splits); each split streams at most ``ceil(T/S)`` of
    the ``T`` KV tiles and writes an fp32 (o, lse) partial; a second kernel merges the partials, or with
    ``fused_merge`` the last split to finish each tile merges them in the same launch: no merge launch, a serial tail
    instead (``fused_merge_tail_us``: an atomic arrival and the partials read back from L2 by one program per tile;
    ``FUSED_MERGE_TAIL_US`` until a calibration fits it)."""
    if num_splits < 1 or block_n < 1:
        raise ValueError(f"num_splits and block_n must be >= 1, got {num_splits}, {block_n}")
    b, hkv, g, L, d, dv, e = _dims(site)
    n = _keys_read(site)
    n_tiles = max(1, math.ceil(n / block_n))
    tiles = math.ceil(n_tiles / num_splits)
    mb = m_blocks(site)
    programs = b * hkv * mb * num_splits
    t = hw.launch_us + wave_time_us(hw, programs, tiles, _tile_bytes(site, block_n), hw.kernel_efficiency, num_warps)
    if num_splits > 1:
        partials = state_bytes(site) * num_splits
        t += _stream_us(hw, partials)                        # the first kernel writes them
        if fused_merge:
            t += hw.fitted.get("fused_merge_tail_us", hw.launch_us * FUSED_MERGE_TAIL_LAUNCHES)
            t += _stream_us(hw, partials + io_bytes(site) / 2)
        else:
            t += hw.launch_us + _stream_us(hw, partials + io_bytes(site) / 2)  # the merge reads them, writes o
    return config_adjust(hw, f"split_kv/{block_n}/{num_warps}/{num_stages}", t * hw.emulation_slowdown)


# --------------------------------------------------------------------------------------------- stream-K
def stream_k_us(site: AttentionSite, hw: HardwareProfile, grid: int, block_n: int, num_warps: int = 4,
                num_stages: int = 2) -> float:
    """Stream-K (LeanAttention): ``grid`` persistent programs cut the (B x Hkv x M-block x KV tile) work units
    into equal contiguous shares; a program whose share covers part of an output tile writes a partial, and
    the last to arrive merges it (fix-up)."""
    if grid < 1 or block_n < 1:
        raise ValueError(f"grid and block_n must be >= 1, got {grid}, {block_n}")
    b, hkv, g, L, d, dv, e = _dims(site)
    n = _keys_read(site)
    n_tiles = max(1, math.ceil(n / block_n))
    outputs = b * hkv * m_blocks(site)
    units = outputs * n_tiles
    programs = min(grid, units)
    share = math.ceil(units / programs)
    t = hw.launch_us + wave_time_us(hw, programs, share, _tile_bytes(site, block_n), hw.kernel_efficiency, num_warps)
    # Every program boundary inside an output tile makes one more partial (o, lse): at most programs + outputs
    # segments, written and read back across the chip. Each output tile then pays the fix-up protocol (an
    # atomic arrival counter; the last program to arrive merges), a fixed serial tail.
    segments = min(units, programs + outputs)
    partial = state_bytes(site) / outputs
    t += _stream_us(hw, 2 * partial * segments) + hw.fitted.get("stream_k_fixup_us", STREAM_K_FIXUP_US)
    return config_adjust(hw, f"stream_k/{block_n}/{num_warps}/{num_stages}", t * hw.emulation_slowdown)


# --------------------------------------------------------------------------------------------- plan choice
@dataclass(frozen=True)
class KernelChoice:
    """A grid chosen by the cost model, and the rule the kernel applies at run time."""

    kind: str
    #: split-KV: num_splits; stream-K: grid.
    grid: int
    block_n: int
    num_warps: int
    est_us: float
    #: The lengths the choice was optimised over (one for a static length).
    lengths: tuple[int, ...]
    #: The runtime rule, in words.
    rule: str


def planning_lengths(site: AttentionSite) -> tuple[int, ...]:
    """The KV lengths a plan must serve: the static length, or for a symbolic length the hint (default 4096)
    and the range it is expected to grow through (hint / 2 .. 8 x hint).

    A static cache with a valid-length mask (``mask_kind == "valid_length"``: HF StaticCache) holds ``kv_len``
    slots, but the kernels read only the valid prefix, which grows from a few tokens to ``kv_len`` as generation
    goes on; its plan serves ``kv_len / 16 .. kv_len``. (On the H100 validation at c686f31, planning the
    32k-slot cache for 32k alone picked 8 splits of 128 keys, 1.15x slower than 16 of 64 at 4k valid.)"""
    if site.kv_len is not None:
        if site.mask_kind == "valid_length":
            n = int(site.kv_len)
            return tuple(sorted({max(1, n // 16), max(1, n // 8), max(1, n // 4), max(1, n // 2), n}))
        return (int(site.kv_len),)
    hint = int(site.kv_len_hint or DEFAULT_KV_LEN)
    return tuple(sorted({max(1, hint // 2), hint, 2 * hint, 4 * hint, 8 * hint}))


def _at_length(site: AttentionSite, n: int) -> AttentionSite:
    import dataclasses

    return dataclasses.replace(site, kv_len=int(n))


def _choose(site: AttentionSite, hw: HardwareProfile, configs, cost) -> tuple[tuple[int, int, int], float, tuple[int, ...]]:
    """The config minimising the mean slowdown against the per-length best over ``planning_lengths``."""
    lengths = planning_lengths(site)
    sites = [_at_length(site, n) for n in lengths]
    table = {c: [cost(s, hw, *c) for s in sites] for c in configs}
    best_per_len = [min(v[i] for v in table.values()) for i in range(len(sites))]
    score = {c: sum(v[i] / best_per_len[i] for i in range(len(sites))) for c, v in table.items()}
    chosen = min(configs, key=lambda c: (score[c], table[c][0]))
    est = cost(_at_length(site, _kv_len(site)), hw, *chosen)
    return chosen, est, lengths


def split_kv_configs(site: AttentionSite, hw: HardwareProfile) -> list[tuple[int, int, int]]:
    """(num_splits, block_n, num_warps) the planner considers: splits up to the number of KV tiles at the
    longest planning length."""
    n_max = max(planning_lengths(site))
    out = []
    for bn in BLOCK_N_CHOICES:
        n_tiles = max(1, math.ceil(n_max / bn))
        for s in SPLIT_CHOICES:
            if s > 1 and s > n_tiles:
                continue
            for w in WARP_CHOICES:
                out.append((s, bn, w))
    return out


def stream_k_configs(site: AttentionSite, hw: HardwareProfile) -> list[tuple[int, int, int]]:
    """(grid, block_n, num_warps): persistent grids of 1..occupancy programs per SM."""
    out = []
    for bn in BLOCK_N_CHOICES:
        for w in WARP_CHOICES:
            for k in range(1, hw.programs_per_sm(w) + 1):
                out.append((hw.sm_count * k, bn, w))
    return out


def best_split_kv(site: AttentionSite, hw: HardwareProfile) -> KernelChoice:
    """The split-KV grid the cost model prefers at this site (over ``planning_lengths`` when symbolic)."""
    (s, bn, w), est, lengths = _choose(site, hw, split_kv_configs(site, hw), split_kv_us)
    rule = (f"grid (B*Hkv*M, {s}); split i streams KV tiles [i*T//{s}, (i+1)*T//{s}) of "
            f"T = ceil(valid_len/{bn}) read on the device; empty splits write lse=-inf")
    return KernelChoice("split_kv", s, bn, w, est, lengths, rule)


def best_stream_k(site: AttentionSite, hw: HardwareProfile) -> KernelChoice:
    """The stream-K grid the cost model prefers at this site (over ``planning_lengths`` when symbolic)."""
    (grid, bn, w), est, lengths = _choose(site, hw, stream_k_configs(site, hw), stream_k_us)
    rule = (f"{grid} persistent programs; program p takes work units [p*ceil(U/{grid}), (p+1)*ceil(U/{grid})) "
            f"of U = B*Hkv*M*ceil(valid_len/{bn}) read on the device; the last program to finish a tile merges it")
    return KernelChoice("stream_k", grid, bn, w, est, lengths, rule)


def best_single_device_us(site: AttentionSite, hw: HardwareProfile) -> tuple[str, float]:
    """(kind, µs) of the fastest single-device plan the model knows: dense, split-KV or stream-K.

    The multi-GPU cost functions use it for the local attention over a shard.
    """
    options = [("dense", dense_us(site, hw)), ("split_kv", best_split_kv(site, hw).est_us),
               ("stream_k", best_stream_k(site, hw).est_us)]
    return min(options, key=lambda kv: kv[1])
