"""``stream_k``: LeanAttention with one persistent Triton launch; the last program to finish a tile merges it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from torch import Tensor

from attnopt.cost import kernel as kernel_cost
from attnopt.hardware import HardwareProfile
from attnopt.plan import StreamKPlan
from attnopt.site import AttentionSite

from .base import PlanContext, register_strategy
from .split_kv import KernelStrategy, cost_model_pick, fitting_configs, output_tiles, planned_len, use_triton

#: Partitions the CPU fallback cuts the keys into (the persistent grid has no meaning there).
CPU_PARTITIONS = 4
#: Planned keys from which the stream-K candidates merge their split tiles in a second launch
#: (``StreamKPlan.merge_launch``). H100 (``benchmarks/split_kv_long.py --quick --extra`` at 105b395, CUDA graphs, L2
#: rotated): faster than the in-launch merge in all 12 timings at 49k-524k keys, grids 132/bn128 and 264/bn64 (B1 14/2
#: D80 512k 124.7 against 153.6 and 132.5 against 190.4 µs; B2 24/8 D80 N144576 258.2 against 259.9; B1 32/8 D128
#: N98368 140.0 against 145.8). Not measured below; the in-launch merge stays there.
MERGE_LAUNCH_FROM = 49152


@dataclass
class StreamKState:
    """Prepared once per plan and shape family: (workspace o, workspace lse, zeroed arrival counters)."""

    workspace: tuple[Tensor, Tensor, Tensor] | None


@register_strategy(StreamKPlan)
class StreamK(KernelStrategy[StreamKPlan]):
    def cpu_partitions(self, plan: StreamKPlan, n_keys: int) -> int:
        return CPU_PARTITIONS

    def candidates(self, site: AttentionSite, hw: HardwareProfile, ctx: PlanContext) -> Iterable[StreamKPlan]:
        """One and two programs per SM, and a grid that is a whole multiple of the output tiles (each program's
        share then stays inside one tile, as split-KV's does), for each kernel config that split-KV offers.
        The grid is fixed; the iteration space follows the valid length at run time. K/V tiles go through TMA
        where the GPU and strides allow it.

        Measured on the H100 (benchmarks/results/experiments/stream-k-grids-*): with 4 warps and 3 stages,
        stream-K took 19.3 µs at 32/8 heads, D=128, 8k and 181 µs at 128k (grid 128), against 28-40 and 205 µs
        for the 8-warp, 2-stage configs these candidates were before; a grid of 128 (16 programs per KV head)
        beat 132 at 128k by 2.5 %."""
        n = planned_len(site)
        base = output_tiles(site)
        merge_launch = n >= MERGE_LAUNCH_FROM
        seen = set()
        for block_n, warps, stages in fitting_configs(site, hw=hw):
            iterations = base * max(1, -(-n // block_n))
            grids = [hw.sm_count, 2 * hw.sm_count]
            if base <= hw.sm_count:
                grids.append(base * (hw.sm_count // base))
            for grid in grids:
                if site.kv_len is not None:
                    # A static length bounds the useful grid; a symbolic one may grow, so keep the full grid.
                    grid = min(grid, iterations)
                grid = max(1, grid)
                if (grid, block_n, warps, stages) not in seen:
                    seen.add((grid, block_n, warps, stages))
                    yield StreamKPlan(grid=grid, block_n=block_n, num_warps=warps, num_stages=stages, tma=True,
                                      merge_launch=merge_launch)
        pick = cost_model_pick("best_stream_k", site, hw)  # the cost model's own pick, when it has one
        if pick is not None:
            c, stages = pick
            grid = c.grid
            if site.kv_len is not None:
                grid = max(1, min(grid, base * max(1, -(-n // c.block_n))))
            if (grid, c.block_n, c.num_warps, stages) not in seen:
                yield StreamKPlan(grid=grid, block_n=c.block_n, num_warps=c.num_warps, num_stages=stages, tma=True,
                                  merge_launch=merge_launch)

    def estimate_us(self, plan: StreamKPlan, site: AttentionSite, hw: HardwareProfile, ctx: PlanContext) -> float:
        return kernel_cost.stream_k_us(site, hw, plan.grid, plan.block_n, plan.num_warps, plan.num_stages)

    def prepare(self, plan: StreamKPlan, q: Tensor, k: Tensor, v: Tensor) -> Any:
        if plan.grid < 1:
            raise ValueError(f"stream_k: grid must be >= 1; got {plan.grid}")
        if not use_triton(q):
            return StreamKState(workspace=None)
        from ..kernels.stream_k import stream_k_workspace

        return StreamKState(workspace=stream_k_workspace(plan.grid, q, k, v))

    def _launch(self, state, plan, q, k, v, attn_mask, valid_len, scale, is_causal, out, lse, *, key_start=None,
                softcap=0.0, alibi_slopes=None):
        from ..kernels.stream_k import stream_k_decode

        workspace = state.workspace if state is not None else None
        stream_k_decode(q, k, v, out, lse, workspace=workspace, attn_mask=attn_mask, valid_len=valid_len,
                        scale=scale, is_causal=is_causal, grid=plan.grid, block_n=plan.block_n,
                        num_warps=plan.num_warps, num_stages=plan.num_stages, tma=plan.tma, key_start=key_start,
                        softcap=softcap, alibi_slopes=alibi_slopes, merge_launch=plan.merge_launch)
