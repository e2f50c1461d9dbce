"""``saap``: sparse decode over the sink, the recent window and the top-``probes`` key clusters (opt-in only).

The planner offers it only when the user passes an index (``attnopt.optimize(model, saap="index.safetensors")``,
which fills ``PlanContext.extras["saap"]``), and only at the layers the index covers (layer 0 stays dense). It is
*not* exact attention: the user opted in to an approximation. The plan carries the index path and its layer; at
run time the op finds the loaded index and the live sequence's clusters in ``runtime.saap.registry``, where a
``saap_cache`` built them at prefill. On CUDA (or the interpreter) a call runs the scoring (de-roping, centroid or
MLP logits), the selection (group softmax sums, top-l threshold, the work list, the selectivity counter), the
attention over sink + window + chosen clusters, and the merge: four launches (five with the MLP), one fewer each with
the plan's ``fused_select`` (the scoring launch's last program per head selects) and ``fused_merge`` (the attention
launch's last split per tile merges). On the CPU the pure-PyTorch reference does the same with
``torch.topk``. Each call adds its selectivity to a device-side counter
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
#: Centroid scoring selects in its own launch (the plan's ``fused_select``, its last program per head): on the H100
#: (2cefde7, llama3-8b, 5 %) 42.9 µs a call at 128k against 44.3 apart, 73.1 against 78.9 at 512k.
FUSED_SELECT_CENTROID = True
#: The query MLP's logits launch does not select: its fused launch took 76-78 µs against 44.3 apart (dbfa5c3), and
#: at 560e233 (H100, llama3-8b 128k 5 %, fp32 weights) the whole call 131.5 µs against 74.1 with the selection apart.
FUSED_SELECT_MLP = False
#: Attended keys per kernel tile. 32, not 64: compiled for sm_90 (bf16, D=128, 4 warps, 2 stages) the attention
#: kernel holds 114 registers per thread at 32 keys a tile but 255 at 64, and its gathered reads are latency-bound, so
#: the 4 programs per SM that PROGRAMS_PER_SM aims at are resident at once only at 32 (at 64 only 2 are: two waves).
BLOCK_N = 32
#: Kernel launches per call besides the attention: scoring, selection, the merge (one more with the query MLP; one
#: fewer each with the plan's ``fused_select`` and ``fused_merge``).
EXTRA_LAUNCHES = 3
#: Attention programs per SM that the split count aims at: the tiles' gathered loads are latency-bound, so
#: several resident programs per SM keep more of them in flight.
PROGRAMS_PER_SM = 4
#: Attention programs' room that one selection program (16 warps at 64 registers: half an SM's registers) takes
#: while the attention launch starts: chained by programmatic dependent launch, or while the fused scoring launch's
#: last programs still select. The split count leaves that room for each head's selection program, so that no
#: attention program waits for a second wave (at 66 splits of 8 heads, one wave exactly, it cost the H100 3-12 µs).
SELECT_PROGRAM_ROOM = 2
#: Tiles per attention program the split count aims at (fewer: more partial states to merge).
TILES_PER_SPLIT = 2
#: Centroid scoring chains its launches by programmatic dependent launch (the plan's ``pdl``; where the GPU and Triton
#: have it): on the H100 (0d2d7ed, llama3-8b 128k 5 %) 40.63 µs a call against 41.58 unchained. The fused scoring
#: launch's "fma" products leave room for attention programs beside its programs (90 registers a thread, not 128,
#: the whole register file at 16 warps); the older 3-12 µs cost was measured at 128 (74b717f, dbfa5c3). The query
#: MLP's chain: ``PDL_MLP_SCORING``.
PDL_CENTROID_SCORING = True
#: The query MLP's launches chained by programmatic dependent launch. Off: on the H100 (llama3-8b 5 %, the bench's
#: ``us_pdl`` against ``us``) 51.6 µs a call chained against 50.6 apart at 128k and 80.4 against 80.1 at 512k
#: (34a16e2); with the logits launch prefetching its w2 rows (``saap_select.MLP_PREFETCH_W2``, c95c447) 53.7 against
#: 50.4 at 128k, 84.4 against 87.3 at 512k.
PDL_MLP_SCORING = False


def site_layer(site: AttentionSite) -> int | None:
    """The layer number in a site's module path (``model.layers.7.self_attn`` -> 7), or None."""
    found = _LAYER.findall(site.module_path or "")
    return int(found[-1]) if found else None


@dataclass
class SaapState:
    """Prepared per plan and shape family: the index on the device, the kernel's partial-state workspace (None on
    the reference path) and the plan's selectivity accumulator."""

    index: Any
    workspace: Any  # runtime.kernels.saap.SaapWorkspace, or None on the reference path
    stats: Tensor
    scorer: Any = None  # runtime.kernels.saap_select.SaapScorer of the plan's layer (kernel path)


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
        from ..saap.registry import get_index

        opts = ctx.extras["saap"]
        probes, sink, window = int(opts["probes"]), int(opts["sink"]), int(opts["window"])
        index = get_index(opts["index"])
        layer = index.layers.get(site_layer(site))
        centroid = layer is not None and layer.mlp is None
        yield SaapPlan(index=opts["index"], probes=probes, sink=sink, window=window, layer=site_layer(site),
                       num_splits=split_count(site, hw, probes, sink, window, index.num_clusters), block_n=BLOCK_N,
                       fused_select=FUSED_SELECT_CENTROID if centroid else FUSED_SELECT_MLP,
                       pdl=(centroid and FUSED_SELECT_CENTROID and PDL_CENTROID_SCORING)
                       or (not centroid and PDL_MLP_SCORING))

    def estimate_us(self, plan: SaapPlan, site: AttentionSite, hw: HardwareProfile, ctx: PlanContext) -> float:
        """Roofline of the attended keys (sink + window + probes clusters of average size, read once) and of the
        scoring weights (the centroids as the scoring reads them, or the query MLP's two layers), plus the launches."""
        from ..kernels import saap_rule
        from ..kernels.saap_rule import scoring_centroids
        from ..saap.registry import get_index

        index = get_index(plan.index)
        clusters = index.num_clusters
        attended = attended_estimate(site, plan.probes, plan.sink, plan.window, clusters)
        dv = site.v_head_dim or site.head_dim
        nbytes = (site.batch or 1) * site.kv_heads * attended * (site.head_dim + dv) * site.dtype_bytes
        layer = index.layers.get(plan.layer) or next(iter(index.layers.values()))
        if layer.mlp is None:  # the centroids or the MLP's two weight matrices, as the scoring reads them (the rule)
            nbytes += layer.centroids.numel() * scoring_centroids(layer.centroids[:1, :1]).element_size()
        else:
            nbytes += (layer.mlp["w1"].numel() + layer.mlp["w2"].numel()) * saap_rule.MLP_DTYPE.itemsize
        launches = 1 + EXTRA_LAUNCHES + (layer.mlp is not None) - plan.fused_select - plan.fused_merge
        return nbytes / (hw.hbm_read_gbps * 1e3) + launches * hw.launch_us

    def prepare(self, plan: SaapPlan, q: Tensor, k: Tensor, v: Tensor) -> Any:
        from ..saap.registry import get_index, stats_buffer

        workspace = scorer = None
        index = get_index(plan.index, q.device)
        if use_triton(q):
            from ..kernels.saap import saap_workspace
            from ..saap.decode import kernel_scorer

            scorer = kernel_scorer(index, plan.layer)
            workspace = saap_workspace(plan.num_splits, q, v, k.shape[1], index.num_clusters, scorer.hidden,
                                       plan.window_stream)
        return SaapState(index=index, workspace=workspace, stats=stats_buffer(plan.runtime_key(), q.device),
                         scorer=scorer)

    def run(self, state, plan, q, k, v, attn_mask, valid_len, scale, is_causal):
        from ..saap.decode import attended_keys, saap_decode_states, top_clusters
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
        if use_triton(q):
            from ..kernels.saap import saap_decode_kernel, window_split_count

            if attn_mask is not None and valid_len is None:
                # the planner plans SAAP only without a mask or with a valid-length one (then valid_len carries it)
                raise ValueError("the SAAP kernel takes no arbitrary attention mask, only a valid length")
            out = torch.empty(q.shape[:3] + (v.shape[-1],), device=q.device, dtype=q.dtype)
            scorer = state.scorer
            if clusters_state.centroids is not None:  # refined over this prompt's keys at prefill (same shape)
                scorer = scorer._replace(centroids=clusters_state.centroids)
            saap_decode_kernel(q, k, v, clusters_state.offsets, clusters_state.perm, clusters_state.ends, out,
                               probes=plan.probes, sink=plan.sink, scale=scale, scorer=scorer,
                               valid_len=valid_len, stats=state.stats, block_n=plan.block_n,
                               num_stages=plan.num_stages, workspace=state.workspace, fused_select=plan.fused_select,
                               fused_merge=plan.fused_merge, pdl=plan.pdl, window_stream=plan.window_stream,
                               window_after_scoring=plan.window_after_scoring, select_warps=plan.select_warps or None,
                               window_splits=plan.window_splits or window_split_count(
                                   plan.num_splits, plan.sink + plan.window,
                                   plan.probes * clusters_state.perm.shape[-1] / clusters_state.num_clusters))
            return out
        steps = torch.arange(L, device=q.device)
        if valid_len is None:
            positions = steps + (N - L)
            kv_len = torch.full((B,), N, device=q.device)
        else:
            kv_len = valid_len.to(q.device).clamp(max=N)
            positions = kv_len[:, None] - L + steps[None, :]
        scores = state.index.cluster_scores(plan.layer, q, positions, scale,
                                            clusters_state.centroids).sum(dim=2)  # (B, Hkv, C)
        top = top_clusters(scores, plan.probes)  # the kernel's rule
        sizes = clusters_state.offsets[..., 1:] - clusters_state.offsets[..., :-1]
        attended = (sizes.gather(-1, top).sum(-1) + clusters_state.sink
                    + (kv_len[:, None] - clusters_state.ends[:, None]).clamp(min=0))
        state.stats.add_(torch.stack([(attended / kv_len[:, None]).mean().double(),
                                      torch.ones((), dtype=torch.float64, device=q.device)]))
        keep = attended_keys(clusters_state, top, N, L)
        o, _ = saap_decode_states(q, k, v, keep, scale, valid_len, attn_mask)
        return o.to(q.dtype)


def attended_estimate(site: AttentionSite, probes: int, sink: int, window: int, clusters: int) -> float:
    """Keys a call attends per (batch row, KV head): sink + window + probes clusters of average size."""
    n = site.effective_kv_len or 4096
    return min(n, sink + window + probes * max(0, n - sink - window) / clusters)


def split_count(site: AttentionSite, hw: HardwareProfile, probes: int, sink: int, window: int, clusters: int) -> int:
    """Attention programs per (batch row, KV head): about TILES_PER_SPLIT tiles of the expected attended keys each,
    and at most PROGRAMS_PER_SM programs per SM over all heads (then each takes more tiles)."""
    heads = (site.batch or 1) * site.kv_heads
    tiles = attended_estimate(site, probes, sink, window, clusters) / BLOCK_N
    cap = max(1, (PROGRAMS_PER_SM * hw.sm_count - SELECT_PROGRAM_ROOM * heads) // heads)
    return max(1, min(cap, round(tiles / TILES_PER_SPLIT)))
