"""Local attention: the softmax state of the query over this rank's shard, and the merge of packed states.

The states that cross ranks keep the row max ``m`` and ``log l`` apart (``lse = m + log l``), as the single-device
merge does: a row that ``finfo.min`` hides in a shard has ``m`` near -3.4e38, where ``m + log l`` rounds to ``m``,
so whole LSEs would weigh every rank alike instead of by its key count (the original gives the mean of V over the
row's keys). A packed state is [o | m | log l], (..., Dv + 2) fp32.

Tree and ring decode both start from :func:`local_states`. The local back-end is the reference, flash attention
(CUDA), or a single-device plan kind (dense, split_kv, stream_k) run through its strategy's ``run_states``: those
strategies sit below this package in the layering (tree and ring, the distributed plan kinds, sit above it), so
this module imports the modules of those three kinds, never the strategies package that registers every kind.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ..reference import attention_states, merge_states

#: Local attention back-ends (``TreePlan.local``): ``auto`` picks flash on CUDA when it applies, else a
#: registered single-GPU strategy's ``run_states``, else the reference.
LOCAL_KINDS = ("auto", "reference", "flash", "dense", "split_kv", "stream_k")


_LOCAL_STATES: dict[tuple, Any] = {}


def single_device_strategy(kind: str):
    """The registered strategy of the single-device plan kind ``kind`` (dense, split_kv or stream_k)."""
    from ..strategies import dense, split_kv, stream_k  # noqa: F401  (each module registers its kind)
    from ..strategies.base import STRATEGIES

    return STRATEGIES.get(kind)


def _flash_states(q: Tensor, k: Tensor, v: Tensor, scale: float, fp32: bool = True) -> tuple[Tensor, Tensor]:
    """Flash attention's (o, lse) on CUDA, GQA folded into the query rows: (B, Hkv, G*L, D) against K/V.
    ``fp32=False`` leaves o in the input dtype (the tree's pack converts it on the way)."""
    B, Hq, L, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    qg = q.reshape(B, Hkv, G * L, D)
    out = torch.ops.aten._scaled_dot_product_flash_attention(qg, k, v, 0.0, False, False, scale=scale)
    o, lse = out[0].reshape(B, Hq, L, v.shape[-1]), out[1].reshape(B, Hq, L)
    return (o.float(), lse.float()) if fp32 else (o, lse)


def _local_plan(kind: str, strategy, q: Tensor, k: Tensor, v: Tensor):
    """The single-device strategy's best plan for the local shard (its own candidates and cost model), chosen
    once per shape family with the shard length of the first call; the kind's default plan if that fails."""
    from attnopt.plan import plan_kind

    try:
        from attnopt.hardware import detect_profile, resolve_profile
        from attnopt.site import AttentionSite

        from ..strategies.base import PlanContext

        B, Hq, L, D = q.shape
        dt = str(q.dtype).replace("torch.", "")
        site = AttentionSite(node="local", module_path="", pattern="distributed", batch=B, q_heads=Hq,
                             kv_heads=k.shape[1], head_dim=D, q_len=L, kv_len=max(1, k.shape[2]), dtype=dt,
                             v_head_dim=v.shape[-1], gqa_source="enable_gqa" if Hq != k.shape[1] else "mha")
        try:
            hw = resolve_profile(None)
        except Exception:  # e.g. the calibrated-profile cache needs platformdirs
            hw = detect_profile()
        ctx = PlanContext(world_size=1, device_type=q.device.type, triton_available=q.is_cuda)
        if strategy.check(site, hw, ctx) is None:
            cands = list(strategy.candidates(site, hw, ctx))
            if cands:
                return min(cands, key=lambda p: strategy.estimate_us(p, site, hw, ctx))
    except Exception:
        pass
    return plan_kind(kind)()


def local_states(q: Tensor, k: Tensor, v: Tensor, *, attn_mask: Tensor | None = None,
                 valid_len: Tensor | None = None, scale: float | None = None, is_causal: bool = False,
                 local: str = "auto", fp32: bool = True, split_lse: bool = False) -> tuple[Tensor, ...]:
    """Softmax state of ``q`` over the local shard.

    Parameters
    ----------
    q : (B, Hq, L, D); k : (B, Hkv, n, D); v : (B, Hkv, n, Dv) (n may be 0).
    attn_mask : bool or additive, broadcastable to (B, Hq, L, n), local columns.
    valid_len : (B,) int, local: keys at local index >= valid_len[b] are ignored.
    local : one of ``LOCAL_KINDS``.
    fp32 : False lets o come back in q's dtype where the local kernel produces that (flash): one conversion
        fewer when the caller converts anyway (the tree's pack).
    split_lse : return the row max and ``log l`` apart (see the module docstring), for a merge across ranks.

    Returns
    -------
    o : (B, Hq, L, Dv) float32 (or q's dtype, see ``fp32``); lse : (B, Hq, L) float32 (-inf where no key is
    visible); with ``split_lse`` m and log l (B, Hq, L) float32 instead of lse (both -inf where no key is visible).
    """
    if local not in LOCAL_KINDS:
        raise ValueError(f"unknown local attention {local!r}; valid: {', '.join(LOCAL_KINDS)}")
    D = q.shape[-1]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    plain = attn_mask is None and valid_len is None and not is_causal
    if k.shape[2] == 0:
        return attention_states(q, k, v, scale=scale, split_lse=split_lse)
    if local in ("auto", "flash") and plain and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) \
            and v.shape[-1] == D and D <= 256:
        o, lse = _flash_states(q, k, v, scale, fp32)
        # No mask, so no huge bias: the scores' own max is far from where m + log l would absorb log l, and
        # (m, log l) = (lse, 0) weighs this state exactly.
        return (o, lse, torch.zeros_like(lse)) if split_lse else (o, lse)
    if local not in ("auto", "reference", "flash"):
        strategy = single_device_strategy(local)
        if strategy is not None and (q.is_cuda or local == "dense"):
            key = (local, q.device, q.dtype, q.shape, k.shape[1], v.shape[-1])
            if key not in _LOCAL_STATES:
                plan = _local_plan(local, strategy, q, k, v)
                _LOCAL_STATES[key] = (plan, strategy.prepare(plan, q, k, v))
            plan, state = _LOCAL_STATES[key]
            return strategy.run_states(state, plan, q, k, v, attn_mask, valid_len, scale, is_causal,
                                       split_lse=split_lse)
    return attention_states(q, k, v, attn_mask=attn_mask, valid_len=valid_len, scale=scale, is_causal=is_causal,
                            split_lse=split_lse)


#: Extra columns of a packed state after o: the row max and log l.
PACKED_EXTRA = 2


def _pack(o: Tensor, m: Tensor, log_l: Tensor, out: Tensor) -> Tensor:
    """[o | m | log l] into ``out`` (..., Dv + 2) fp32 (o converted on the way): one concatenation, a single
    launch on CUDA where the parts are fp32 already (a copy per part otherwise)."""
    return torch.cat((o, m.unsqueeze(-1), log_l.unsqueeze(-1)), dim=-1, out=out)


def merge_packed(parts: Tensor, split_lse: bool = False) -> tuple[Tensor, ...]:
    """Merge P packed states (P, ..., Dv + 2) [o | m | log l] into (o (..., Dv), lse (...)), or with ``split_lse``
    (o, m, log l); empty parts (m = -inf) are ignored.

    On CUDA this is one launch of the Triton merge kernel (``runtime/kernels/merge.py``, strided reads of the
    packed buffer); elsewhere the reference merge.
    """
    if parts.is_cuda and _triton_merge_available():
        return merge_packed_triton(parts, split_lse)
    return merge_states(parts[..., :-2], parts[..., -2], parts[..., -1], split_lse=split_lse)


def merge_packed_triton(parts: Tensor, split_lse: bool = False) -> tuple[Tensor, ...]:
    """``merge_packed`` through the Triton kernel (on CPU tensors it needs ``TRITON_INTERPRET=1``)."""
    from ..kernels.merge import merge_states as triton_merge_states

    if not split_lse:
        return triton_merge_states(parts[..., :-2], parts[..., -2], log_l_parts=parts[..., -1])
    planes = torch.empty((2,) + tuple(parts.shape[1:-1]), device=parts.device, dtype=torch.float32)
    o, _ = triton_merge_states(parts[..., :-2], parts[..., -2], lse_out=planes, log_l_parts=parts[..., -1])
    return o, planes[0], planes[1]


_TRITON_MERGE: list[bool] = []


def _triton_merge_available() -> bool:
    if not _TRITON_MERGE:
        from ..kernels import triton_usable

        _TRITON_MERGE.append(triton_usable("cuda"))
    return _TRITON_MERGE[0]


def _merge_parts(parts: Tensor, out_dtype: torch.dtype | None, with_lse: bool) -> tuple[Tensor, Tensor | None]:
    """``merge_packed`` writing o straight in ``out_dtype`` (one launch on CUDA, no cast after it) and skipping
    the LSE when it is not wanted."""
    if parts.is_cuda and _triton_merge_available():
        from ..kernels.merge import merge_states as triton_merge_states

        return triton_merge_states(parts[..., :-2], parts[..., -2], out_dtype=out_dtype or torch.float32,
                                   lse_out=None if with_lse else False, log_l_parts=parts[..., -1])
    o, lse = merge_packed(parts)
    return (o.to(out_dtype) if out_dtype is not None else o), (lse if with_lse else None)
