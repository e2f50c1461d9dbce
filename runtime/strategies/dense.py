"""``dense``: one SDPA call over the un-expanded K/V. Always applicable; the fallback of every site.

``DensePlan.backend`` names the SDPA backend: ``auto`` (SDPA's own pick) or one called explicitly through
``sdpa_kernel``. On CUDA the planner also offers ``flash``, ``cudnn`` and ``efficient`` where they apply
(``backend_reason``), so the measured choice (``attnopt.tuning``) can time the device's fastest SDPA backend.
A backend that rejects ``enable_gqa`` gets K/V expanded to the query heads on every call (a G-fold copy, which
the timing then includes); ``prepare`` finds out once, outside any capture.
"""
from __future__ import annotations

import logging
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import Tensor

from attnopt.cost import kernel as kernel_cost
from attnopt.hardware import HardwareProfile
from attnopt.plan import DensePlan
from attnopt.site import AttentionSite

from .base import PlanContext, Strategy, register_strategy

log = logging.getLogger("attnopt")

#: Backends offered as explicit candidates on CUDA, in the order they are tried.
EXPLICIT_BACKENDS = ("flash", "cudnn", "efficient")
_HALF = ("float16", "bfloat16")
#: Profiles (Hopper) where SDPA's cuDNN backend was measured no slower than flash on every decode shape and far
#: faster than SDPA's own pick with a mask (the memory-efficient kernel): benchmarks/results/kernels-nvidia-h100-*
#: and kernels-nvidia-h200.json, 10 shapes each. There the cuDNN plan is offered first, so that it wins the ties
#: of the cost model (which models cuDNN as flash) and the dense plan is cuDNN without tuning.
CUDNN_FIRST_PROFILES = ("h100-sxm", "h100-pcie", "h200")


def backend_reason(backend: str, site: AttentionSite, device_type: str) -> str | None:
    """Why SDPA backend ``backend`` cannot run ``site`` on ``device_type`` (``None``: it can).

    The rules are PyTorch's documented constraints (torch 2.11): flash and cuDNN need CUDA, fp16/bf16 and equal
    head dims that are multiples of 8 up to 256; flash takes no mask tensor; the memory-efficient kernel has no
    ``enable_gqa``, so it is offered for MHA only (with GQA it would copy K/V G-fold on every call).
    """
    if backend in ("auto", "math"):
        return None
    if device_type != "cuda":
        return f"SDPA backend {backend!r} needs CUDA (device {device_type})"
    d, dv = site.head_dim, site.v_head_dim or site.head_dim
    if backend in ("flash", "cudnn"):
        if site.dtype not in _HALF:
            return f"SDPA {backend} needs float16 or bfloat16, not {site.dtype}"
        if d != dv or d % 8 or not 0 < d <= 256:
            return f"SDPA {backend} needs equal head dims, multiples of 8 up to 256 (D={d}, Dv={dv})"
    if backend == "flash" and site.mask_kind in ("valid_length", "arbitrary"):
        return "SDPA flash takes no attn_mask tensor"
    if backend == "efficient" and site.group_size != 1:
        return f"SDPA efficient has no enable_gqa: K/V would be copied {site.group_size}-fold every call"
    return None


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


_AUTO = DensePlan()


def _sdpa_backend(name: str):
    from torch.nn.attention import SDPBackend

    return {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[name]


def _expand(x: Tensor, heads: int) -> Tensor:
    """(B, Hkv, N, D) -> (B, heads, N, D), query head h reading KV head h // G (a copy, as HF's repeat_kv)."""
    b, hkv, n, d = x.shape
    return x[:, :, None].expand(b, hkv, heads // hkv, n, d).reshape(b, heads, n, d)


def _sdpa(plan: DensePlan, expand: bool, q, k, v, mask, scale, is_causal) -> Tensor:
    gqa = q.shape[1] != k.shape[1]
    if gqa and expand:
        k, v, gqa = _expand(k, q.shape[1]), _expand(v, q.shape[1]), False
    if plan.backend == "auto":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, is_causal=is_causal,
                                              enable_gqa=gqa)
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel([_sdpa_backend(plan.backend)]):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, is_causal=is_causal,
                                              enable_gqa=gqa)


@register_strategy(DensePlan)
class Dense(Strategy[DensePlan]):
    def check(self, site: AttentionSite, hw: HardwareProfile, ctx: PlanContext) -> str | None:
        return None

    def candidates(self, site: AttentionSite, hw: HardwareProfile, ctx: PlanContext) -> Iterable[DensePlan]:
        explicit = [b for b in EXPLICIT_BACKENDS if backend_reason(b, site, ctx.device_type) is None]
        if "cudnn" in explicit and getattr(hw, "name", None) in CUDNN_FIRST_PROFILES:
            explicit.remove("cudnn")
            yield DensePlan(reason="SDPA cudnn, called explicitly", backend="cudnn")
        yield DensePlan(reason="SDPA over the un-expanded cache")
        for backend in explicit:
            yield DensePlan(reason=f"SDPA {backend}, called explicitly", backend=backend)

    def estimate_us(self, plan: DensePlan, site: AttentionSite, hw: HardwareProfile, ctx: PlanContext) -> float:
        # cuDNN has its own model (flash's, with or without a mask). The other explicit backends tie with ``auto``
        # (which the stable ranking keeps ahead of them); only a measurement (attnopt.tuning) separates them.
        if plan.backend == "cudnn":
            return kernel_cost.cudnn_us(site, hw)
        return kernel_cost.dense_us(site, hw)

    def prepare(self, plan: DensePlan, q: Tensor, k: Tensor, v: Tensor) -> bool | str:
        """How ``run`` calls SDPA, found by calls on these tensors (without the mask), outside any capture:
        ``False`` as planned; ``True`` with K/V expanded (the named backend rejects ``enable_gqa``); ``"auto"``
        when the named backend cannot run them at all (this build or GPU lacks it), so SDPA picks its own: a
        planned backend that is missing costs speed, never the call. ``auto`` never expands."""
        if plan.backend == "auto":
            return False
        for expand in ((False,) if q.shape[1] == k.shape[1] else (False, True)):
            try:
                _sdpa(plan, expand, q, k, v, None, None, False)
                return expand
            except RuntimeError:
                continue
        log.warning("attnopt: SDPA backend %r cannot run q %s, k %s (%s); using SDPA's own pick", plan.backend,
                    tuple(q.shape), tuple(k.shape), q.dtype)
        return "auto"

    def run(self, state, plan, q, k, v, attn_mask, valid_len, scale, is_causal):
        if attn_mask is not None and attn_mask.dim() < 4:
            # SDPA rejects a 1-D (N,) mask that broadcasts fine in eager code: view it as (1, ..., N)
            attn_mask = attn_mask.view((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
        if attn_mask is not None and attn_mask.dtype in (torch.float16, torch.bfloat16) and attn_mask.dtype != q.dtype:
            # Eager code adds a half-precision bias to wider scores (type promotion); SDPA takes a float mask only in
            # q's dtype or fp32. The promoted dtype (fp32 or fp64) holds every fp16/bf16 value exactly.
            attn_mask = attn_mask.to(torch.promote_types(attn_mask.dtype, q.dtype))
        mask = combined_mask(q, k, attn_mask, valid_len)
        if state == "auto":
            return _sdpa(_AUTO, False, q, k, v, mask, scale, is_causal)
        return _sdpa(plan, bool(state), q, k, v, mask, scale, is_causal)

    def run_states(self, state, plan, q, k, v, attn_mask, valid_len, scale, is_causal, split_lse=False):
        from ..reference import attention_states

        return attention_states(q, k, v, attn_mask=attn_mask, valid_len=valid_len, scale=scale, is_causal=is_causal,
                                split_lse=split_lse)
