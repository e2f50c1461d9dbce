"""``tree``: Tree Attention decode over a sequence-sharded KV cache (local attention, one tree collective).

The collectives, the group registry and the sharded cache live in ``runtime/distributed/``; this file is
the planner's view (check, candidates, cost) and the op's entry (prepare, run).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch import Tensor

from attnopt.hardware import HardwareProfile
from attnopt.plan import TreePlan
from attnopt.site import AttentionSite

from ..distributed.cache import localize
from ..distributed.checks import check_decode_shapes, check_world
from ..distributed.groups import DistributedDecodeError, current_group
from ..distributed.tree import TREE_COLLECTIVES, tree_step
from .base import PlanContext, Strategy, register_strategy

#: Longest query the distributed decode handles (decode-time only).
MAX_Q_LEN = 16


def topology_nodes(topology: Any, world: int) -> int:
    """How many nodes the ``world`` ranks span, from the planning topology (or the registered group).

    Accepts a topology object with ``nodes_for(world)`` (``attnopt.topology.Topology``) or ``num_nodes`` (int or
    method, with optional ``gpus_per_node``), a name ``attnopt.topology.resolve_topology`` knows, or ``None``
    (then the current registered group's node count when its size is ``world``, else 1).
    """
    topo = topology
    if isinstance(topo, str):
        try:
            from attnopt.topology import resolve_topology

            topo = resolve_topology(topo, world)
        except (ImportError, ValueError):
            topo = None
    if topo is not None:
        for attr in ("nodes_for",):
            fn = getattr(topo, attr, None)
            if callable(fn):
                return int(fn(world))
        n = getattr(topo, "num_nodes", None)
        if callable(n):
            n = n()
        if n is not None:
            gpn = getattr(topo, "gpus_per_node", None)
            gpn = gpn() if callable(gpn) else gpn
            return int(min(n, -(-world // gpn))) if gpn else int(n)
    try:
        g = current_group()
        return g.nodes if g.world == world else 1
    except Exception:
        return 1


def distributed_check(site: AttentionSite, ctx: PlanContext) -> str | None:
    """Why sequence-parallel decode cannot run at ``site`` (None when it can)."""
    if ctx.world_size <= 1:
        return "world size 1: tree/ring decode needs a process group of at least 2 ranks"
    if site.q_len is None:
        return "q_len is symbolic; distributed decode needs a static q_len <= 16"
    if site.q_len > MAX_Q_LEN:
        return f"q_len {site.q_len} > {MAX_Q_LEN}: not decode-shaped (prefill stays local)"
    if site.kv_heads <= 0 or site.q_heads % site.kv_heads:
        return f"query heads ({site.q_heads}) are not a multiple of KV heads ({site.kv_heads})"
    return None


@dataclass
class TreeState:
    """Prepared once per plan and shape family: the registered group the op runs over."""

    group: Any


@register_strategy(TreePlan)
class Tree(Strategy[TreePlan]):
    distributed = True

    def check(self, site: AttentionSite, hw: HardwareProfile, ctx: PlanContext) -> str | None:
        return distributed_check(site, ctx)

    def candidates(self, site: AttentionSite, hw: HardwareProfile, ctx: PlanContext) -> Iterable[TreePlan]:
        hier = [False]
        if topology_nodes(ctx.topology, ctx.world_size) > 1:
            hier.append(True)
        for h in hier:
            for c in TREE_COLLECTIVES:
                yield TreePlan(world=ctx.world_size, collective=c, hierarchical=h)

    def estimate_us(self, plan: TreePlan, site: AttentionSite, hw: HardwareProfile, ctx: PlanContext) -> float:
        from attnopt.cost.collective import tree_decode_us

        return float(tree_decode_us(site, hw, ctx.topology, plan.world, plan.collective, plan.hierarchical))

    def prepare(self, plan: TreePlan, q: Tensor, k: Tensor, v: Tensor) -> Any:
        g = current_group()
        check_world(g, plan.world, f"tree plan {plan.describe()}")
        if plan.hierarchical and g.nodes <= 1:
            raise DistributedDecodeError(f"tree plan {plan.describe()} is hierarchical but {g.describe()} has one node")
        check_decode_shapes(g, q, k, v, f"tree plan {plan.describe()}", plan.runtime_key())
        return TreeState(group=g)

    def _decode(self, state, plan, q, k, v, attn_mask, valid_len, scale, is_causal, out_dtype, with_lse):
        g = state.group if state is not None else current_group()
        attn_mask, valid_len, is_causal = localize(g, q, k, attn_mask, valid_len, is_causal)
        return tree_step(g, q, k, v, collective=plan.collective, hierarchical=plan.hierarchical,
                           attn_mask=attn_mask, valid_len=valid_len, scale=scale, is_causal=is_causal,
                           local=plan.local, out_dtype=out_dtype, with_lse=with_lse)

    def run_states(self, state, plan, q, k, v, attn_mask, valid_len, scale, is_causal):
        return self._decode(state, plan, q, k, v, attn_mask, valid_len, scale, is_causal, torch.float32, True)

    def run(self, state, plan, q, k, v, attn_mask, valid_len, scale, is_causal):
        return self._decode(state, plan, q, k, v, attn_mask, valid_len, scale, is_causal, q.dtype, False)[0]
