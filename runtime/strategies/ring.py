"""``ring``: Ring Attention decode over a sequence-sharded KV cache (pass-KV baseline, or pass-Q).

The ring steps live in ``runtime/distributed/ring.py``; this file is the planner's view and the op's entry.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from torch import Tensor

from attnopt.hardware import HardwareProfile
from attnopt.plan import RingPlan
from attnopt.site import AttentionSite

from ..distributed.cache import localize
from ..distributed.checks import check_decode_shapes, check_world
from ..distributed.groups import current_group
from ..distributed.local import local_states
from ..distributed.ring import RING_VARIANTS, ring_pass_kv, ring_pass_q
from .base import PlanContext, Strategy, register_strategy
from .tree import distributed_check


@dataclass
class RingState:
    """Prepared once per plan and shape family: the registered group the op runs over."""

    group: Any


@register_strategy(RingPlan)
class Ring(Strategy[RingPlan]):
    distributed = True

    def check(self, site: AttentionSite, hw: HardwareProfile, ctx: PlanContext) -> str | None:
        return distributed_check(site, ctx)

    def candidates(self, site: AttentionSite, hw: HardwareProfile, ctx: PlanContext) -> Iterable[RingPlan]:
        for variant in RING_VARIANTS:
            yield RingPlan(world=ctx.world_size, variant=variant)

    def estimate_us(self, plan: RingPlan, site: AttentionSite, hw: HardwareProfile, ctx: PlanContext) -> float:
        from attnopt.cost.collective import ring_decode_us

        return float(ring_decode_us(site, hw, ctx.topology, plan.world, plan.variant))

    def prepare(self, plan: RingPlan, q: Tensor, k: Tensor, v: Tensor) -> Any:
        g = current_group()
        check_world(g, plan.world, f"ring plan {plan.describe()}")
        check_decode_shapes(g, q, k, v, f"ring plan {plan.describe()}", plan.runtime_key())
        return RingState(group=g)

    def run_states(self, state, plan, q, k, v, attn_mask, valid_len, scale, is_causal):
        g = state.group if state is not None else current_group()
        attn_mask, valid_len, is_causal = localize(g, q, k, attn_mask, valid_len, is_causal)
        lens = g.cache.shard_lens() if (g.cache is not None and g.cache.positions.numel() == k.shape[2]) else None
        if g.world == 1:
            return local_states(q, k, v, attn_mask=attn_mask, valid_len=valid_len, scale=scale, is_causal=is_causal)
        if plan.variant == "pass_kv":
            # prepare() checked the shapes across ranks: no per-call check here
            return ring_pass_kv(q, k, v, g, attn_mask=attn_mask, valid_len=valid_len, scale=scale,
                                is_causal=is_causal, shard_lens=lens, check_shapes=False)
        if plan.variant == "pass_q":
            return ring_pass_q(q, k, v, g, attn_mask=attn_mask, valid_len=valid_len, scale=scale,
                               is_causal=is_causal, check_shapes=False)
        raise ValueError(f"unknown ring variant {plan.variant!r}; valid: {', '.join(RING_VARIANTS)}")

    def run(self, state, plan, q, k, v, attn_mask, valid_len, scale, is_causal):
        o, _ = self.run_states(state, plan, q, k, v, attn_mask, valid_len, scale, is_causal)
        return o.to(q.dtype)
