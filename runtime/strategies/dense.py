"""``dense``: one SDPA call over the un-expanded K/V. Always applicable; the fallback of every site."""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import Tensor

from attnopt.cost import kernel as kernel_cost
from attnopt.hardware import HardwareProfile
from attnopt.plan import DensePlan
from attnopt.site import AttentionSite

from .base import PlanContext, Strategy, register_strategy


def combined_mask(q: Tensor, k: Tensor, attn_mask: Tensor | None, valid_len: Tensor | None) -> Tensor | None:
    """Fold ``valid_len`` (B,) into the mask SDPA takes: bool (B, 1, 1, N) or the original mask narrowed by it."""
    if valid_len is None:
        return attn_mask
    n = k.shape[2]
    keep = torch.arange(n, device=k.device)[None, :] < valid_len.to(k.device).view(-1, 1)
    keep = keep[:, None, None, :]
    if attn_mask is None:
        return keep
    if attn_mask.dtype == torch.bool:
        return attn_mask & keep
    return attn_mask.masked_fill(~keep, float("-inf"))


@register_strategy(DensePlan)
class Dense(Strategy[DensePlan]):
    def check(self, site: AttentionSite, hw: HardwareProfile, ctx: PlanContext) -> str | None:
        return None

    def candidates(self, site: AttentionSite, hw: HardwareProfile, ctx: PlanContext) -> Iterable[DensePlan]:
        yield DensePlan(reason="SDPA over the un-expanded cache")

    def estimate_us(self, plan: DensePlan, site: AttentionSite, hw: HardwareProfile, ctx: PlanContext) -> float:
        return kernel_cost.dense_us(site, hw)

    def run(self, state, plan, q, k, v, attn_mask, valid_len, scale, is_causal):
        if attn_mask is not None and attn_mask.dim() < 4:
            # SDPA rejects a 1-D (N,) mask that broadcasts fine in eager code: view it as (1, ..., N)
            attn_mask = attn_mask.view((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
        mask = combined_mask(q, k, attn_mask, valid_len)
        gqa = q.shape[1] != k.shape[1]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, is_causal=is_causal, enable_gqa=gqa)

    def run_states(self, state, plan, q, k, v, attn_mask, valid_len, scale, is_causal):
        from ..reference import attention_states

        return attention_states(q, k, v, attn_mask=attn_mask, valid_len=valid_len, scale=scale, is_causal=is_causal)
