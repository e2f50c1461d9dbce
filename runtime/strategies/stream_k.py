"""``stream_k``: LeanAttention with one persistent Triton launch; the last program to finish a tile merges it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch import Tensor

from attnopt.cost import kernel as kernel_cost
from attnopt.hardware import HardwareProfile
from attnopt.plan import StreamKPlan
from attnopt.site import AttentionSite

from .base import PlanContext, Strategy, register_strategy
from .split_kv import fit_stages, kernel_check, planned_len, rows_per_tile, use_triton

#: Partitions the CPU fallback cuts the keys into (the persistent grid has no meaning there).
CPU_PARTITIONS = 4


@dataclass
class StreamKState:
    """Prepared once per plan and shape family: (workspace o, workspace lse, zeroed arrival counters)."""

    workspace: tuple[Tensor, Tensor, Tensor] | None


@register_strategy(StreamKPlan)
class StreamK(Strategy[StreamKPlan]):
    def check(self, site: AttentionSite, hw: HardwareProfile, ctx: PlanContext) -> str | None:
        return kernel_check(site, ctx)

    def candidates(self, site: AttentionSite, hw: HardwareProfile, ctx: PlanContext) -> Iterable[StreamKPlan]:
        """One and two programs per SM (the kernel caps itself at two resident programs), two tile sizes. The
        grid is fixed; the iteration space follows the valid length at run time. K/V tiles go through TMA where
        the GPU and strides allow it (on the H100, 1-1.5 % faster than pointer tiles at B=8 and B=64, equal at
        128k: benchmarks/results/experiments/kernel-headroom-*)."""
        n = planned_len(site)
        _, num_m = rows_per_tile(site)
        base = (site.batch or 1) * site.kv_heads * num_m
        seen = set()
        for block_n in ((32, 64) if site.head_dim > 128 else (64, 128)):
            if fit_stages(site, block_n, 2) != 2:
                continue
            iterations = base * max(1, -(-n // block_n))
            for grid in (hw.sm_count, 2 * hw.sm_count):
                if site.kv_len is not None:
                    # A static length bounds the useful grid; a symbolic one may grow, so keep the full grid.
                    grid = min(grid, iterations)
                grid = max(1, grid)
                if (grid, block_n) not in seen:
                    seen.add((grid, block_n))
                    yield StreamKPlan(grid=grid, block_n=block_n, num_warps=8, num_stages=2, tma=True)
        best = getattr(kernel_cost, "best_stream_k", None)  # the cost model's own pick, when it has one
        if best is not None:
            c = best(site, hw)
            grid = c.grid
            if site.kv_len is not None:
                grid = max(1, min(grid, base * max(1, -(-n // c.block_n))))
            if c.block_n >= 16 and fit_stages(site, c.block_n, 2) == 2 and (grid, c.block_n) not in seen:
                yield StreamKPlan(grid=grid, block_n=c.block_n, num_warps=c.num_warps, num_stages=2, tma=True)

    def estimate_us(self, plan: StreamKPlan, site: AttentionSite, hw: HardwareProfile, ctx: PlanContext) -> float:
        return kernel_cost.stream_k_us(site, hw, plan.grid, plan.block_n, plan.num_warps, plan.num_stages)

    def prepare(self, plan: StreamKPlan, q: Tensor, k: Tensor, v: Tensor) -> Any:
        if not use_triton(q):
            return StreamKState(workspace=None)
        from ..kernels.stream_k import stream_k_workspace

        return StreamKState(workspace=stream_k_workspace(plan.grid, q, k, v))

    def _launch(self, state, plan, q, k, v, attn_mask, valid_len, scale, is_causal, out, lse):
        from ..kernels.stream_k import stream_k_decode

        workspace = state.workspace if state is not None else None
        stream_k_decode(q, k, v, out, lse, workspace=workspace, attn_mask=attn_mask, valid_len=valid_len,
                        scale=scale, is_causal=is_causal, grid=plan.grid, block_n=plan.block_n,
                        num_warps=plan.num_warps, num_stages=plan.num_stages, tma=plan.tma)

    def run(self, state, plan, q, k, v, attn_mask, valid_len, scale, is_causal):
        if not use_triton(q):
            from ..reference import decode_attention

            return decode_attention(q, k, v, attn_mask=attn_mask, valid_len=valid_len, scale=scale,
                                    is_causal=is_causal, num_partitions=CPU_PARTITIONS)
        out = torch.empty(q.shape[:3] + (v.shape[-1],), device=q.device, dtype=q.dtype)
        self._launch(state, plan, q, k, v, attn_mask, valid_len, scale, is_causal, out, None)
        return out

    def run_states(self, state, plan, q, k, v, attn_mask, valid_len, scale, is_causal):
        if not use_triton(q):
            from ..reference import decode_attention_states

            return decode_attention_states(q, k, v, attn_mask=attn_mask, valid_len=valid_len, scale=scale,
                                           is_causal=is_causal, num_partitions=CPU_PARTITIONS)
        out = torch.empty(q.shape[:3] + (v.shape[-1],), device=q.device, dtype=torch.float32)
        lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
        self._launch(state, plan, q, k, v, attn_mask, valid_len, scale, is_causal, out, lse)
        return out, lse
