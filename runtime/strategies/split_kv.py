"""``split_kv``: FlashDecoding with Triton kernels (partial states per KV chunk, then ``merge_states``).

Also holds what the two single-device kernel strategies share: the applicability check, the block sizes
worth trying per head dim, and the CPU policy. On CPU tensors the strategies run the pure-PyTorch
partition-and-merge of ``runtime/reference.py`` (fast, for end-to-end model tests), unless the Triton
interpreter is asked for with ``ATTNOPT_CPU_KERNELS=interpret`` together with ``TRITON_INTERPRET=1``.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch import Tensor

from attnopt.cost import kernel as kernel_cost
from attnopt.cost.traffic import padded_head_dim
from attnopt.hardware import HardwareProfile
from attnopt.plan import SplitKVPlan
from attnopt.site import AttentionSite

from .base import P, PlanContext, Strategy, register_strategy

#: Head dims the decode kernels support (Dv must equal D); others fall back to dense.
KERNEL_HEAD_DIMS = (64, 80, 96, 128, 256)
#: Longest query (tokens per head) the decode kernels take.
MAX_Q_LEN = 16
KERNEL_DTYPES = ("float16", "bfloat16", "float32")


def kernel_check(site: AttentionSite, ctx: PlanContext) -> str | None:
    """Why the Triton decode kernels cannot run this site (None when they can)."""
    if site.q_len is None:
        return "q_len is symbolic; the decode kernels need a static q_len <= 16"
    if site.q_len > MAX_Q_LEN:
        return f"q_len {site.q_len} > {MAX_Q_LEN}: not decode-shaped for the kernels"
    if site.kv_heads <= 0 or site.q_heads % site.kv_heads:
        return f"query heads ({site.q_heads}) are not a multiple of KV heads ({site.kv_heads})"
    if site.head_dim not in KERNEL_HEAD_DIMS:
        dims = ", ".join(str(d) for d in KERNEL_HEAD_DIMS)
        return f"head_dim {site.head_dim} not supported by the kernels ({dims})"
    if site.v_head_dim is not None and site.v_head_dim != site.head_dim:
        return f"v_head_dim {site.v_head_dim} != head_dim {site.head_dim}: the kernels need Dv == D"
    if site.dtype not in KERNEL_DTYPES:
        return f"dtype {site.dtype} not supported by the kernels ({', '.join(KERNEL_DTYPES)})"
    if site.kv_layout != "bhnd":
        return f"KV layout {site.kv_layout!r} not supported by the kernels (bhnd only)"
    if ctx.device_type == "cuda" and not ctx.triton_available:
        return "Triton is not available on this CUDA machine"
    return None


def kernel_configs(head_dim: int) -> tuple[tuple[int, int, int], ...]:
    """(block_n, num_warps, num_stages) worth trying. Measured on an H100 (bf16, TMA tiles; results in
    ``benchmarks/results/``): a third pipeline stage is worth 3-8 % over two at every length, 64-key tiles with
    4 warps win for D=128, wide 128-256-key tiles for D <= 96 (few bytes per key). Larger heads take smaller tiles
    (shared memory per stage). For D <= 96, 256-key tiles with 4 warps and 3 stages (one program per SM, two tiles
    in flight) were the fastest at 56 MHA heads, 64k: 304.3 / 305.0 µs against cuDNN's 304.1 / 304.6 in two runs
    (``benchmarks/results/experiments/kernel-headroom-*``); they come last so that equal estimates plan the others."""
    if head_dim > 128:
        return ((32, 4, 3), (64, 8, 2), (64, 4, 3))
    if 64 < head_dim <= 96:
        # (128, 4, 3) last: at D=80/96 it was the fastest config in 3 of 5 trailing dynamic shapes (H100 at a5cad6d,
        # benchmarks/head_chunks.py: B64 8/8 N2432 S1 139.6 µs, B1 14/2 512k S66 122.2, B3 12/4 N5000 S11 15.9, each
        # ahead of every listed config) and was a candidate only when the cost model picked it
        return ((64, 4, 3), (128, 4, 2), (128, 8, 3), (256, 8, 2), (256, 4, 3), (128, 4, 3))
    if head_dim <= 96:
        return ((64, 4, 3), (128, 4, 2), (128, 8, 3), (256, 8, 2), (256, 4, 3))
    # (128, 4, 3) before (128, 8, 3): an uncalibrated cost model cannot tell them apart, the first of equal
    # estimates is planned, and 4 warps measured faster (692 against 780 us at 32/8 heads, 512k, H100)
    return ((64, 4, 3), (128, 4, 3), (128, 8, 3))


#: The small-splits candidate: KV tiles per split, and a cap on programs per SM. At 56 MHA heads, 64k (D=64, H100,
#: 256-key tiles) 64 splits of 4 tiles (27 programs per SM) ran 0.3-1 % faster than 48, 80, 96 or 128 splits and
#: 3 % faster than the best of the wave-sized candidates (``benchmarks/results/experiments/kernel-headroom-*``).
TILES_PER_SMALL_SPLIT = 4
MAX_SMALL_PROGRAMS_PER_SM = 32

#: How the planned split-KV candidates launch (``SplitKVPlan.chain``, ``merge_dv_split``); every candidate takes them,
#: so the tuner's work stays the same. H100 (``benchmarks/split_kv_long.py`` at 32e6a4d, the tuner's picks at
#: 3fed422, CUDA graphs, L2 rotated, every round): the merge over shares of Dv in one step (``merge_dv_split=0``,
#: "auto") against one program per row: B1 14/2 D80 512k S66 120.0-121.3 µs against 122.6-123.9; B2 24/8 D80 N144576
#: S33 263.0-263.7 against 263.9-264.0; B1 32/8 D128 N98368 S33 138.4-138.7 against 139.2-139.5. ``chain`` did not
#: win everywhere (with auto: 121.7-122.4, 264.6-265.0, 137.6-137.9): it stays off.
#: ``l2_prefetch``: tiles ahead that each program prefetches into L2 (``runtime/kernels/tile_ops.py``); 0 until an H100
#: run of ``benchmarks/trail_variants.py`` measures it faster.
LAUNCH = {"chain": False, "merge_dv_split": 0, "l2_prefetch": 0}

#: A split-KV grid that follows the cache's length (``split_counts``) grows to at most this many times the tiles
#: (or small splits) of the planned length.
FOLLOW_RANGE = 2

from .kernel_smem import (HOPPER_SMEM_PER_BLOCK, SMEM_BUDGET, SMEM_MARGIN, WGMMA_ROWS,  # noqa: F401
                          _pow2, fit_stages, occupancy, on_hopper, rows_per_tile, smem_budget, smem_bytes,
                          smem_per_block, swaps)


def planned_len(site: AttentionSite) -> int:
    """Keys the kernels read per row, to plan for: the static length, else the trace-time hint, else 4096; a
    sliding window's band when shorter (``site.keys_read``)."""
    return site.keys_read or 4096


def fitting_configs(site: AttentionSite, head_chunks: bool = False, hw: HardwareProfile | None = None,
                    swap_ab: bool = False) -> Iterable[tuple[int, int, int]]:
    """``kernel_configs`` whose tiles fit ``hw``'s shared-memory budget, with their pipeline depth fitted."""
    for block_n, warps, stages in kernel_configs(site.head_dim):
        stages = fit_stages(site, block_n, stages, head_chunks, hw, swap_ab)
        if stages is not None:
            yield block_n, warps, stages


#: Tiles at least this wide get a head-chunked twin where the kernels cut the head dim (``SplitKVPlan.head_chunks``):
#: every config. H100 at a5cad6d (``benchmarks/head_chunks.py``, D=80/96 as 64 + 32, against one padded chunk):
#: B8 4/2 D80 N2048 S32/bn64 10.76 µs against 12.02 (1.019x cuDNN, the fastest row), B64 8/8 D80 N2432 S1/bn64 143.6
#: against 164.8, B7 4/2 D96 N3264 S18/bn64 13.36 against 13.59; at B3 12/4 D96 N5000 3-5 % slower at 64-key tiles
#: and 11 splits; at 128-key tiles up to 15 % faster with many splits (padded, 139 KB of shared memory holds one
#: program per SM; chunked, 105 KB, two). Neither wins everywhere, so measurement chooses.
CHUNK_MIN_BLOCK_N = 64
#: A head-chunked plan's estimate is its padded twin's times (1 + this): the untuned choice stays padded.
CHUNK_ESTIMATE_PENALTY = 0.01


#: Swap-AB twins among the candidates (``SplitKVPlan.swap_ab``) where the products swap (``swaps``), for measurement
#: to choose. H100, ``benchmarks/trail_variants.py`` round 2 (batch 2c6eb78), lhs37 (B6 32/32 D64 30464 keys, dynamic):
#: S7/bn128 487.70 µs against 501.31 unswapped, S14/bn128 487.73 against 491.51, S14/bn64 490.59 against 503.37
#: (cuDNN 488.17); round 1 (1a15bc4) elsewhere from 2.4 % faster to 20 % slower (B1 56/56 D64 64k S64/bn256 303.92
#: against 304.08; 512k D80 G7 0.6 % slower; S1/bn256/w8 19.7 % slower), so never without a measurement. Those
#: timings are of the first form, wrong compiled in one combination (``kernels.split_kv.swap_applies`` refuses it).
#: The form without register transposes (``tile_ops``), H100 at 87976e5: its CUDA tests pass (``test_tile_ops.py``,
#: 12 cuda ids), and at lhs37 (``trail_variants.py`` round 4) S7/bn128 487.86
#: µs against 500.95 unswapped, S14/bn128 488.18 against 491.58, S11/bn128 489.49 against 491.11 (cuDNN 489.08): on.
SWAP_AB_TWINS = True
#: A swap-AB plan's estimate is its twin's times (1 + this): the untuned choice stays unswapped.
SWAP_ESTIMATE_PENALTY = 0.01
#: > 0: every candidate also comes with a twin that prefetches this many tiles ahead into L2
#: (``SplitKVPlan.l2_prefetch``), for measurement to choose; 0: none. H100, ``benchmarks/trail_variants.py`` (batches
#: 1a15bc4, 2c6eb78): 2 tiles ahead at 512k D80 G7 S66/bn128 118.34 / 118.21 µs against 120.08 / 119.61 (chunks),
#: 117.72 against 120.26 (padded; cuDNN 117.2-117.6); B64 8/8 D80 2432 S1/bn64 chunks 141.0 / 140.5 against 142.9 /
#: 143.6; slower at lhs37 (S7/bn64 517.5 against 504.8) and B1 56/56 D64 64k (306.1 against 304.1); 1 tile ahead
#: slower or equal everywhere, 3 slower, 4-8 up to 1.6x slower (L2 thrash).
PREFETCH_TWINS = 2
#: A prefetching plan's estimate is its twin's times (1 + this): the untuned choice prefetches nothing.
PREFETCH_ESTIMATE_PENALTY = 0.01


def chunk_twins(site: AttentionSite) -> bool:
    """Whether the candidates include head-chunked twins: the kernels cut this head dim (D == Dv, 72-96, 160, 192)."""
    return padded_head_dim(site.head_dim, site.v_head_dim or site.head_dim) < _pow2(site.head_dim)


def output_tiles(site: AttentionSite) -> int:
    """Output tiles of a launch: batch rows x KV heads x packed query tiles per KV head."""
    return (site.batch or 1) * site.kv_heads * rows_per_tile(site)[1]


def cost_model_pick(name: str, site: AttentionSite, hw: HardwareProfile):
    """(the cost model's own best config from ``attnopt.cost.kernel.<name>``, its fitted stages), or None when
    the cost model has no such pick or its tiles do not fit."""
    best = getattr(kernel_cost, name, None)
    if best is None:
        return None
    c = best(site, hw)
    stages = fit_stages(site, c.block_n, 3, hw=hw) if c.block_n >= 16 else None
    return None if stages is None else (c, stages)


def use_triton(t: Tensor) -> bool:
    """Whether to launch the Triton kernels for tensors on ``t``'s device (see the module docstring)."""
    if t.device.type == "cuda":
        return True
    if t.device.type == "cpu" and os.environ.get("ATTNOPT_CPU_KERNELS", "") == "interpret":
        from ..kernels import triton_usable

        return triton_usable("cpu")
    return False


@dataclass
class SplitKVState:
    """Prepared once per plan and shape family: the partial-state workspace and the fused merge's zeroed
    arrival counters (None with one split)."""

    workspace: tuple[Tensor, Tensor, Tensor] | None


def split_counts(site: AttentionSite, hw: HardwareProfile, block_n: int, warps: int, stages: int,
                 chunks: bool = False, swap_ab: bool = False) -> list[tuple[int, int]]:
    """(``num_splits``, ``tiles_per_split``) of the split-KV candidates of one kernel config, in the order they are
    planned: grids of one program per SM and of half a wave, a wave and two waves of resident programs (one split
    when the batch and heads alone fill it), then small splits of ``TILES_PER_SMALL_SPLIT`` tiles (at most
    ``MAX_SMALL_PROGRAMS_PER_SM`` programs per SM).

    The grid follows the cache's length at run time (``SplitKVPlan.splits_at``) where that is how the candidate is
    sized: never more splits than KV tiles (``tiles_per_split=1``: a wave-sized grid over fewer tiles gets one per
    split), and the small splits keep their tiles (``tiles_per_split=TILES_PER_SMALL_SPLIT``). So a plan tuned at one
    length of a growing cache runs as the candidate planned at another would: on the H100 (e052280) the bucket
    (1024, 2048] of B=8, 4/2 heads, D=80 tuned 12 splits of one 128-key tile at 1472 keys and ran 16 tiles at 2048 in
    12 splits, 4 of them of two tiles (11.14 µs against cuDNN's 10.46). Wave-sized grids come largest first, so that
    of those the tiles cap alike at the planned length the one that keeps one tile per split furthest is planned.

    Only where the site has no mask: a sliding window's band does not grow with the cache, and a static cache's
    keys are its valid ones, which the tuner times as a shorter cache (a grid sized by the length would differ
    there from the run's); their grids stay fixed (``tiles_per_split=0``) and capped by the tiles."""
    base = output_tiles(site)
    slots = hw.sm_count * occupancy(site, block_n, warps, stages, chunks, hw, swap_ab)
    adapt = site.window is None and site.mask_kind == "none"
    waves = sorted({max(1, round(t / base)) for t in (hw.sm_count, slots / 2, slots, 2 * slots)}, reverse=True)
    max_splits = max(1, -(-planned_len(site) // block_n))
    # a grid follows the length up to FOLLOW_RANGE times the planned one (a bucket spans sqrt(2) either side of its
    # middle): the workspace, sized for the most splits, stays within that of the planned grid times FOLLOW_RANGE
    out = [(min(s, FOLLOW_RANGE * max_splits), 1) if adapt and s > 1 else (s, 0) for s in waves]
    out = [(s, m if s > 1 else 0) for s, m in out]
    cap = max(1, round(MAX_SMALL_PROGRAMS_PER_SM * hw.sm_count / base))
    if adapt and cap > 1:
        out.append((max(2, min(cap, FOLLOW_RANGE * (max_splits // TILES_PER_SMALL_SPLIT))), TILES_PER_SMALL_SPLIT))
    else:
        out.append((max(1, min(max_splits, max_splits // TILES_PER_SMALL_SPLIT, cap)), 0))
    if not adapt:  # fixed grids: never more splits than tiles at the planned length
        out = [(max(1, min(max_splits, s)), 0) for s, _ in out]
    return out


class KernelStrategy(Strategy[P]):
    """What the split-KV and stream-K strategies share: the applicability check, and ``run`` / ``run_states``,
    which on tensors the kernels do not take (``use_triton``) run the reference's partition-and-merge over
    ``cpu_partitions(plan)`` partitions, else allocate the output and ``_launch`` the plan's kernel."""

    #: Both kernels read only a window's keys (``key_start`` on device) and apply a softcap (constexpr paths).
    variants = frozenset({"window", "softcap", "alibi"})

    def check(self, site: AttentionSite, hw: HardwareProfile, ctx: PlanContext) -> str | None:
        return kernel_check(site, ctx)

    def cpu_partitions(self, plan: P, n_keys: int) -> int:
        """Partitions the CPU reference cuts ``n_keys`` keys into (the kernel's split count there)."""
        raise NotImplementedError

    def _launch(self, state, plan: P, q, k, v, attn_mask, valid_len, scale, is_causal, out, lse, *, key_start=None,
                softcap=0.0, alibi_slopes=None) -> None:
        """Launch the kernel into ``out`` (B, Hq, L, Dv) and ``lse`` (B, Hq, L) fp32, or its (2, B, Hq, L) planes of
        row max and log l, or None."""
        raise NotImplementedError

    def run(self, state, plan, q, k, v, attn_mask, valid_len, scale, is_causal, *, key_start=None, softcap=0.0,
            alibi_slopes=None):
        if not use_triton(q):
            from ..reference import decode_attention

            return decode_attention(q, k, v, attn_mask=attn_mask, valid_len=valid_len, scale=scale,
                                    is_causal=is_causal, num_partitions=self.cpu_partitions(plan, k.shape[2]),
                                    key_start=key_start, softcap=softcap, alibi_slopes=alibi_slopes)
        out = torch.empty(q.shape[:3] + (v.shape[-1],), device=q.device, dtype=q.dtype)
        self._launch(state, plan, q, k, v, attn_mask, valid_len, scale, is_causal, out, None, key_start=key_start,
                     softcap=softcap, alibi_slopes=alibi_slopes)
        return out

    def run_states(self, state, plan, q, k, v, attn_mask, valid_len, scale, is_causal, split_lse=False, *,
                   key_start=None, softcap=0.0, alibi_slopes=None):
        if not use_triton(q):
            from ..reference import decode_attention_states

            return decode_attention_states(q, k, v, attn_mask=attn_mask, valid_len=valid_len, scale=scale,
                                           is_causal=is_causal, num_partitions=self.cpu_partitions(plan, k.shape[2]),
                                           split_lse=split_lse, key_start=key_start, softcap=softcap,
                                           alibi_slopes=alibi_slopes)
        out = torch.empty(q.shape[:3] + (v.shape[-1],), device=q.device, dtype=torch.float32)
        lse = torch.empty(((2,) if split_lse else ()) + tuple(q.shape[:3]), device=q.device, dtype=torch.float32)
        self._launch(state, plan, q, k, v, attn_mask, valid_len, scale, is_causal, out, lse, key_start=key_start,
                     softcap=softcap, alibi_slopes=alibi_slopes)
        return (out, lse[0], lse[1]) if split_lse else (out, lse)


@register_strategy(SplitKVPlan)
class SplitKV(KernelStrategy[SplitKVPlan]):
    def cpu_partitions(self, plan: SplitKVPlan, n_keys: int) -> int:
        return plan.splits_at(n_keys)

    def candidates(self, site: AttentionSite, hw: HardwareProfile, ctx: PlanContext) -> Iterable[SplitKVPlan]:
        """Split counts that give one program per SM, and half a wave, one wave and two waves of resident
        programs, for each kernel config (one split when the batch and heads alone fill it), never more splits
        than KV tiles. Also small splits of TILES_PER_SMALL_SPLIT tiles (at most MAX_SMALL_PROGRAMS_PER_SM programs
        per SM): the block scheduler then balances many short programs as they finish. For a symbolic length
        the trace-time hint sizes the splits; the share of each split then follows the length at run time. K/V
        tiles go through TMA where the GPU and strides allow it. Where the kernels cut the head dim in two chunks
        (D=80/96), the configs of tiles >= CHUNK_MIN_BLOCK_N come again with ``head_chunks`` (sized by their own
        shared memory), each estimated just behind its padded twin, for measurement to choose."""
        n = planned_len(site)
        seen = set()
        forms = [(chunks, swap) for swap in ((False, True) if SWAP_AB_TWINS and swaps(site) else (False,))
                 for chunks in ((False, True) if chunk_twins(site) else (False,))]
        for chunks, swap in forms:
            for block_n, warps, stages in fitting_configs(site, chunks, hw, swap):
                if chunks and block_n < CHUNK_MIN_BLOCK_N:
                    continue
                for splits, per_split in split_counts(site, hw, block_n, warps, stages, chunks, swap):
                    # fused_merge stays False: the in-launch merge costs more than the second launch (chained by
                    # programmatic dependent launch). H200 (benchmarks/results/kernels-nvidia-h200.json): about 0.6 µs
                    # per split of a tile. H100, timed as twins by the tuner (batch bf50495, 2048 fp32 a merge step):
                    # 2.3-3.3 µs more at 6-22 splits (lhs04 704 keys S22/64: 9.81 against 7.46; static 4k of 32k
                    # S16/128: 55.47 against 52.26), 10-80 µs more at 66-440 splits; a tie only at 9 splits of 185k+.
                    plan = SplitKVPlan(num_splits=splits, block_n=block_n, num_warps=warps, num_stages=stages,
                                       tma=True, head_chunks=chunks, tiles_per_split=per_split, swap_ab=swap,
                                       **LAUNCH)
                    key = (plan.splits_at(n), block_n, warps, stages, chunks, swap)
                    if key not in seen:  # plans that run alike at the planned length are timed once
                        seen.add(key)
                        yield plan
                        if PREFETCH_TWINS > 0 and not plan.l2_prefetch:
                            yield dataclasses.replace(plan, l2_prefetch=PREFETCH_TWINS)
        pick = cost_model_pick("best_split_kv", site, hw)  # the cost model's own pick, when it has one
        if pick is not None:
            c, stages = pick
            if (c.grid, c.block_n, c.num_warps, stages, False, False) not in seen:
                yield SplitKVPlan(num_splits=c.grid, block_n=c.block_n, num_warps=c.num_warps, num_stages=stages,
                                  tma=True, **LAUNCH)

    def estimate_us(self, plan: SplitKVPlan, site: AttentionSite, hw: HardwareProfile, ctx: PlanContext) -> float:
        splits = plan.splits_at(planned_len(site))
        us = kernel_cost.split_kv_us(site, hw, splits, plan.block_n, plan.num_warps, plan.num_stages)
        # the model does not see what the head chunks change (measured from 16 % faster to 8 % slower): a chunked
        # plan ranks just behind its padded twin, so that only a measurement chooses one; a swap-AB plan likewise
        if plan.head_chunks and chunk_twins(site):
            us *= 1 + CHUNK_ESTIMATE_PENALTY
        if plan.l2_prefetch:
            us *= 1 + PREFETCH_ESTIMATE_PENALTY
        return us * (1 + SWAP_ESTIMATE_PENALTY) if plan.swap_ab and swaps(site) else us

    def prepare(self, plan: SplitKVPlan, q: Tensor, k: Tensor, v: Tensor) -> Any:
        if plan.num_splits < 1:
            raise ValueError(f"split_kv: num_splits must be >= 1; got {plan.num_splits}")
        if not use_triton(q) or plan.num_splits <= 1:
            return SplitKVState(workspace=None)
        from ..kernels.split_kv import split_kv_workspace

        return SplitKVState(workspace=split_kv_workspace(plan.num_splits, q, k, v))

    def _launch(self, state, plan, q, k, v, attn_mask, valid_len, scale, is_causal, out, lse, *, key_start=None,
                softcap=0.0, alibi_slopes=None):
        from ..kernels.split_kv import split_kv_decode

        workspace = state.workspace if state is not None else None
        split_kv_decode(q, k, v, out, lse, workspace=workspace, attn_mask=attn_mask, valid_len=valid_len,
                        scale=scale, is_causal=is_causal, num_splits=plan.splits_at(k.shape[2]), block_n=plan.block_n,
                        num_warps=plan.num_warps, num_stages=plan.num_stages, fused_merge=plan.fused_merge,
                        tma=plan.tma, key_start=key_start, softcap=softcap, alibi_slopes=alibi_slopes,
                        head_chunks=plan.head_chunks, chain=plan.chain, merge_dv_split=plan.merge_dv_split or "auto",
                        swap_ab=plan.swap_ab, l2_prefetch=plan.l2_prefetch)
