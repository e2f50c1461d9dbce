"""``cascade``: the shared-prefix cascade (FlashInfer's cascade attention as a compiler rewrite).

When every batch row's K/V are one shared prefix (1, Hkv, P, D) followed by the row's own suffix (B, Hkv, S, D) --
proven in the graph (``passes/patterns/prefix.py``: a ``cat`` of a batch-1 tensor expanded over the batch and the
suffixes), which is what ``attnopt.runtime.shared_prefix.SharedPrefixCache`` gives a Hugging Face model for
parallel sampling or beam search -- the prefix is attended once for all rows (their queries stacked into the packed
query tile), each suffix per row, and the states merged exactly (``runtime/kernels/cascade.py``).

The lowered op is ``attnopt::cascade_attention`` (it takes the prefix and suffixes apart, so the plain
``run(q, k, v)`` of the strategy contract does not apply: ``run_cascade`` does). On CPU tensors it runs the
reference's cascade (``reference_cascade.cascade_attention_states``), unless the interpreter is asked for
(``ATTNOPT_CPU_KERNELS=interpret``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch import Tensor

from attnopt.cost.cascade import cascade_us, prefix_site, suffix_site
from attnopt.cost.kernel import m_blocks
from attnopt.hardware import HardwareProfile
from attnopt.plan import CascadePlan
from attnopt.site import AttentionSite

from .base import PlanContext, Strategy, register_strategy
from .split_kv import fitting_configs, kernel_check, occupancy, use_triton

#: Why a site without a proven shared prefix gets no cascade plan (the user reads it in ``attnopt plans``).
NO_SHARED_PREFIX = ("K/V are not provably one prefix shared by every row plus per-row suffixes (the cascade needs a "
                    "cat of a batch-1 prefix expanded over the batch and the suffixes, as attnopt's SharedPrefixCache "
                    "gives)")


def cascade_check(site: AttentionSite, ctx: PlanContext) -> str | None:
    """Why the cascade cannot run ``site`` (None when it can)."""
    if site.shared_prefix is None:
        return NO_SHARED_PREFIX
    if site.batch is None:
        return "symbolic batch size: the cascade stacks a static number of rows over the prefix"
    if site.batch < 2:
        return "batch of 1: a shared prefix saves nothing with one row"
    if site.is_causal:
        return "is_causal (top-left) at decode hides every key past the first q_len: nothing to share"
    if ctx.extras.get("onnx_export"):
        return "ONNX export: the cascade op has no ONNX form (the site exports with a plain plan)"
    return kernel_check(site, ctx)


def _splits(tiles: int, target: float, n: int, block_n: int) -> int:
    """Splits per output tile for about ``target`` programs over ``tiles`` output tiles, at most one per KV tile,
    at least 2 (the partial states go to the shared merge)."""
    return max(2, min(max(2, -(-n // block_n)), round(target / max(tiles, 1))))


@dataclass
class CascadeState:
    """Prepared once per plan and shape family: the partial-state workspace (None on the reference path)."""

    workspace: tuple[Tensor, Tensor, Tensor] | None


@register_strategy(CascadePlan)
class Cascade(Strategy[CascadePlan]):
    def check(self, site: AttentionSite, hw: HardwareProfile, ctx: PlanContext) -> str | None:
        return cascade_check(site, ctx)

    def candidates(self, site: AttentionSite, hw: HardwareProfile, ctx: PlanContext) -> Iterable[CascadePlan]:
        """Per kernel config: prefix splits for one program per SM and for a full wave of resident programs over the
        prefix's KV heads x query tiles, suffix splits for half a wave over the rows x KV heads."""
        pre, suf = prefix_site(site), suffix_site(site)
        pre_tiles = site.kv_heads * m_blocks(pre)
        suf_tiles = (site.batch or 1) * site.kv_heads * m_blocks(suf)
        seen = set()
        for block_n, warps, stages in fitting_configs(site, hw=hw):
            slots = hw.sm_count * occupancy(site, block_n, warps, stages, hw=hw)
            suffix = _splits(suf_tiles, slots / 2, suf.kv_len, block_n)
            for target in (hw.sm_count, slots):
                key = (_splits(pre_tiles, target, pre.kv_len, block_n), suffix, block_n, warps, stages)
                if key not in seen:
                    seen.add(key)
                    yield CascadePlan(prefix_splits=key[0], suffix_splits=suffix, block_n=block_n, num_warps=warps,
                                      num_stages=stages, tma=True)

    def estimate_us(self, plan: CascadePlan, site: AttentionSite, hw: HardwareProfile, ctx: PlanContext) -> float:
        return cascade_us(site, hw, plan.prefix_splits, plan.suffix_splits, plan.block_n, plan.num_warps,
                          plan.num_stages)

    def prepare(self, plan: CascadePlan, q: Tensor, k: Tensor, v: Tensor) -> Any:
        """``k``/``v``: any K/V of the site's value dim (only ``v.shape[-1]`` is read)."""
        if not use_triton(q):
            return CascadeState(workspace=None)
        from ..kernels.cascade import cascade_workspace

        return CascadeState(workspace=cascade_workspace(plan.prefix_splits, plan.suffix_splits, q, v))

    def run(self, state, plan, q, k, v, attn_mask, valid_len, scale, is_causal):
        raise NotImplementedError("a cascade plan takes the shared prefix and the suffixes apart: it runs through "
                                  "attnopt::cascade_attention (Cascade.run_cascade), not decode_attention")

    def run_cascade(self, state: CascadeState | None, plan: CascadePlan, q: Tensor, k_prefix: Tensor,
                    v_prefix: Tensor, k_suffix: Tensor, v_suffix: Tensor, attn_mask: Tensor | None,
                    valid_len: Tensor | None, scale: float) -> Tensor:
        """Attention of q (B, Hq, L, D) over k_prefix (1, Hkv, P, D) / v_prefix (1, Hkv, P, Dv) shared by every row,
        then k_suffix (B, Hkv, S, D) / v_suffix (B, Hkv, S, Dv) per row -> (B, Hq, L, Dv) in q's dtype. No allocation
        beyond the output, no host sync."""
        if state is None or state.workspace is None:
            from ..reference_cascade import cascade_attention_states

            compute = torch.float64 if q.dtype == torch.float64 else torch.float32
            o, _ = cascade_attention_states(q, k_prefix, v_prefix, k_suffix, v_suffix, attn_mask=attn_mask,
                                            valid_len=valid_len, scale=scale, compute_dtype=compute)
            return o.to(q.dtype)
        from ..kernels.cascade import cascade_decode

        out = torch.empty(q.shape[:3] + (v_prefix.shape[-1],), device=q.device, dtype=q.dtype)
        return cascade_decode(q, k_prefix, v_prefix, k_suffix, v_suffix, out, workspace=state.workspace,
                              attn_mask=attn_mask, valid_len=valid_len, scale=scale,
                              prefix_splits=plan.prefix_splits, suffix_splits=plan.suffix_splits,
                              block_n=plan.block_n, num_warps=plan.num_warps, num_stages=plan.num_stages, tma=plan.tma)

    def timed_call(self, plan: CascadePlan, site: AttentionSite, s: dict[str, Any], state: Any, scale: float):
        """For ``attnopt.tuning``: a call on a synthetic input set ``s`` (full q/k/v/mask of the site's shape) with
        row 0's first P keys as the prefix and every row's keys past P as its suffix (the bytes the plan reads)."""
        P = int(site.shared_prefix or 0)
        q, k, v, mask = s["q"], s["k"], s["v"], s["mask"]
        parts = (k[:1, :, :P], v[:1, :, :P], k[:, :, P:], v[:, :, P:])

        # The valid length as the tuner's input set carries it, computed once outside the timing (the tuner charges
        # each site its share of the one computation per step); computed here for a set without it.
        valid_len = s.get("valid_len")
        if mask is not None and valid_len is None:
            valid_len = torch.ops.attnopt.valid_len_from_mask(mask, q.shape[0])

        def call():
            return self.run_cascade(state, plan, q, *parts, mask, valid_len, scale)
        return call
