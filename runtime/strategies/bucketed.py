"""``bucketed``: one plan per KV-length bucket, for sites whose KV length is symbolic (a growing cache).

The planner never proposes it (no candidates); ``attnopt.tuning`` builds it from the plans chosen for each
bucket's representative length. ``prepare`` prepares every distinct inner plan once; ``run`` picks the inner
plan by ``k.shape[2]``, a host integer, so the choice allocates nothing, never syncs, and a captured CUDA graph
replays the plan of the length it was captured at.
"""
from __future__ import annotations

from typing import Any, Iterable

from attnopt.hardware import HardwareProfile
from attnopt.plan import BucketedPlan, plan_from_json
from attnopt.site import AttentionSite

from .base import PlanContext, Strategy, get_strategy, register_strategy, variant_kwargs


@register_strategy(BucketedPlan)
class Bucketed(Strategy[BucketedPlan]):
    #: The planner does not rank this kind: ``attnopt.tuning`` builds it from the plans chosen per bucket.
    ranked = False
    #: Its inner plans were ranked for the same site, so they take the site's variant: forwarded as given.
    variants = frozenset({"window", "softcap", "alibi"})

    def check(self, site: AttentionSite, hw: HardwareProfile, ctx: PlanContext) -> str | None:
        return None

    def candidates(self, site: AttentionSite, hw: HardwareProfile, ctx: PlanContext) -> Iterable[BucketedPlan]:
        """The trivial bucketing (the dense plan at every length); real ones come from ``attnopt.tuning``."""
        yield BucketedPlan()

    def estimate_us(self, plan: BucketedPlan, site: AttentionSite, hw: HardwareProfile, ctx: PlanContext) -> float:
        n = site.effective_kv_len or plan.bounds[-1]
        inner = plan_from_json(plan.plan_for(n))
        return get_strategy(inner.kind).estimate_us(inner, site, hw, ctx)

    def prepare(self, plan: BucketedPlan, q, k, v) -> list[tuple[Any, Strategy, Any]]:
        """Per bucket: (inner plan, its strategy, its prepared state); buckets sharing a plan share the state."""
        done: dict[str, tuple[Any, Strategy, Any]] = {}
        for text in plan.plans:
            if text not in done:
                inner = plan_from_json(text)
                strategy = get_strategy(inner.kind)
                done[text] = (inner, strategy, strategy.prepare(inner, q, k, v))
        return [done[text] for text in plan.plans]

    def run(self, state, plan, q, k, v, attn_mask, valid_len, scale, is_causal, **variant):
        inner, strategy, inner_state = state[plan.index_of(k.shape[2])]
        return strategy.run(inner_state, inner, q, k, v, attn_mask, valid_len, scale, is_causal,
                            **variant_kwargs(strategy, **variant))

    def run_states(self, state, plan, q, k, v, attn_mask, valid_len, scale, is_causal, split_lse=False, **variant):
        inner, strategy, inner_state = state[plan.index_of(k.shape[2])]
        return strategy.run_states(inner_state, inner, q, k, v, attn_mask, valid_len, scale, is_causal, split_lse,
                                   **variant_kwargs(strategy, **variant))
