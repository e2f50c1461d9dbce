"""``saap``: sparse decode over the sink, the recent window and the top-``probes`` key clusters (opt-in only).

The planner offers it only when the user passes an index (``attnopt.optimize(model, saap="index.safetensors")``,
which fills ``PlanContext.extras["saap"]``), and only at the layers the index covers (layer 0 stays dense). It is
*not* exact attention: the user opted in to an approximation. The plan carries the index path and its layer; at
run time the op finds the loaded index and the live sequence's clusters in ``runtime.saap.registry``, where a
``saap_cache`` built them at prefill. Each call scores the query (the index's MLP, or its centroids), and on
CUDA (or the interpreter) the Triton kernel picks the top clusters and attends in one launch plus the merge;
on the CPU the pure-PyTorch reference does the same. Each call adds its selectivity to a device-side counter
that the plan table reads.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch import Tensor

from attnopt.hardware import HardwareProfile
from attnopt.plan import SaapPlan
from attnopt.site import AttentionSite

from .base import PlanContext, Strategy, register_strategy
from .split_kv import MAX_Q_LEN, kernel_check, use_triton

_LAYER = re.compile(r"(?:^|\.)layers?\.(\d+)(?:\.|$)")
#: Attended keys per kernel tile.
BLOCK_N = 64
#: Kernel launches per call besides the attention: scoring (2-3 small ops), top-l statistics, the merge.
EXTRA_LAUNCHES = 4


def site_layer(site: AttentionSite) -> int | None:
    """The layer number in a site's module path (``model.layers.7.self_attn`` -> 7), or None."""
    found = _LAYER.findall(site.module_path or "")
    return int(found[-1]) if found else None


@dataclass
class SaapState:
    """Prepared per plan and shape family: the index on the device, the kernel's partial-state workspace (None on
    the reference path) and the plan's selectivity accumulator."""

    index: Any
    workspace: tuple[Tensor, Tensor, Tensor] | None
    stats: Tensor


@register_strategy(SaapPlan)
class Saap(Strategy[SaapPlan]):
    def check(self, site: AttentionSite, hw: HardwareProfile, ctx: PlanContext) -> str | None:
        opts = ctx.extras.get("saap")
        if not opts:
            return "opt-in only: pass saap='index.safetensors' to attnopt.optimize"
        layer = site_layer(site)
        if layer is None:
            return f"cannot tell the model layer of module {site.module_path!r}"
        from ..saap.index import SaapIndexError
        from ..saap.registry import get_index

        index = get_index(opts["index"])
        ident = index.identity
        if (site.q_heads, site.kv_heads, site.head_dim) != (ident.num_q_heads, ident.num_kv_heads, ident.head_dim):
            raise SaapIndexError(f"SAAP index {opts['index']} is for {ident.num_q_heads} query / {ident.num_kv_heads} KV "
                                 f"heads of dim {ident.head_dim}, but site {site.module_path} has {site.q_heads} / "
                                 f"{site.kv_heads} of dim {site.head_dim}: another model")
        if layer not in index.layers:
            return f"layer {layer} is not in the SAAP index (layer 0 stays dense)"
        if site.q_len is None or site.q_len > MAX_Q_LEN:
            return f"q_len {site.q_len} is not a static decode length <= {MAX_Q_LEN}"
        if site.mask_kind not in ("none", "valid_length") or site.is_causal:
            return f"mask {site.mask_kind!r} (is_causal={site.is_causal}) is not supported by SAAP (none or valid length)"
        return kernel_check(site, ctx)  # head dims, dtypes, layout and Triton: those of the dense decode kernels

    def candidates(self, site: AttentionSite, hw: HardwareProfile, ctx: PlanContext) -> Iterable[SaapPlan]:
        opts = ctx.extras["saap"]
        heads = (site.batch or 1) * site.kv_heads
        # about two programs per SM: the virtual sequence is split evenly, so more splits only shorten each
        splits = max(1, min(64, round(2 * hw.sm_count / heads)))
        yield SaapPlan(index=opts["index"], probes=int(opts["probes"]), sink=int(opts["sink"]),
                       window=int(opts["window"]), layer=site_layer(site), num_splits=splits, block_n=BLOCK_N)

    def estimate_us(self, plan: SaapPlan, site: AttentionSite, hw: HardwareProfile, ctx: PlanContext) -> float:
        """Roofline of the attended keys: sink + window + probes clusters of average size, read once."""
        from ..saap.registry import get_index

        n = site.effective_kv_len or 4096
        clusters = get_index(plan.index).num_clusters
        attended = min(n, plan.sink + plan.window + plan.probes * max(0, n - plan.sink - plan.window) / clusters)
        dv = site.v_head_dim or site.head_dim
        nbytes = (site.batch or 1) * site.kv_heads * attended * (site.head_dim + dv) * site.dtype_bytes
        return nbytes / (hw.hbm_read_gbps * 1e3) + (1 + EXTRA_LAUNCHES) * hw.launch_us

    def prepare(self, plan: SaapPlan, q: Tensor, k: Tensor, v: Tensor) -> Any:
        from ..saap.registry import get_index, stats_buffer

        workspace = None
        if use_triton(q):
            from ..kernels.saap import saap_workspace

            workspace = saap_workspace(plan.num_splits, q, v, k.shape[1], get_index(plan.index).num_clusters)
        return SaapState(index=get_index(plan.index, q.device), workspace=workspace,
                         stats=stats_buffer(plan.runtime_key(), q.device))

    def run(self, state, plan, q, k, v, attn_mask, valid_len, scale, is_causal):
        from ..saap.decode import attended_keys, saap_decode_states
        from ..saap.registry import get_state

        B, Hq, L, D = q.shape
        N = k.shape[2]
        clusters_state = get_state(plan.index, plan.layer)
        if clusters_state is None:
            raise RuntimeError(f"SAAP layer {plan.layer}: no clusters were built for this sequence; pass "
                               f"past_key_values=attnopt.runtime.saap.registry.saap_cache({plan.index!r}, "
                               f"sink={plan.sink}, window={plan.window}) to generate")
        if (clusters_state.sink, clusters_state.window) != (plan.sink, plan.window):
            raise RuntimeError(f"SAAP layer {plan.layer}: the clusters were built with sink={clusters_state.sink}, "
                               f"window={clusters_state.window} but the plan has sink={plan.sink}, "
                               f"window={plan.window}")
        steps = torch.arange(L, device=q.device)
        if valid_len is None:
            positions = steps + (N - L)
            kv_len = torch.full((B,), N, device=q.device)
        else:
            kv_len = valid_len.to(q.device).clamp(max=N)
            positions = kv_len[:, None] - L + steps[None, :]
        scores = state.index.cluster_scores(plan.layer, q, positions, scale).sum(dim=2)  # (B, Hkv, C)
        top = scores.topk(min(plan.probes, scores.shape[-1]), dim=-1).indices
        sizes = clusters_state.offsets[..., 1:] - clusters_state.offsets[..., :-1]
        attended = (sizes.gather(-1, top).sum(-1) + clusters_state.sink
                    + (kv_len[:, None] - clusters_state.ends[:, None]).clamp(min=0))
        state.stats.add_(torch.stack([(attended / kv_len[:, None]).mean().double(),
                                      torch.ones((), dtype=torch.float64, device=q.device)]))
        if use_triton(q):
            from ..kernels.saap import saap_decode_kernel

            if attn_mask is not None and valid_len is None:
                # the planner plans SAAP only without a mask or with a valid-length one (then valid_len carries it)
                raise ValueError("the SAAP kernel takes no arbitrary attention mask, only a valid length")

            out = torch.empty(q.shape[:3] + (v.shape[-1],), device=q.device, dtype=q.dtype)
            saap_decode_kernel(q, k, v, scores, clusters_state.offsets, clusters_state.perm, clusters_state.ends,
                               out, probes=plan.probes, sink=plan.sink, scale=scale, valid_len=valid_len,
                               num_splits=plan.num_splits, block_n=plan.block_n, workspace=state.workspace)
            return out
        keep = attended_keys(clusters_state, top, N, L)
        o, _ = saap_decode_states(q, k, v, keep, scale, valid_len, attn_mask)
        return o.to(q.dtype)
