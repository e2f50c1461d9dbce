"""SAAP sites in ONNX: an ``attnopt:saap_decode_attention`` node whose function body is SAAP's decode.

A ``saap`` plan is not exact attention (the user opted in to attending only the sink, the recent window and the
top ``probes`` key clusters), so no standard node computes it. Its node computes what the plan's reference decode
(``runtime/saap/decode.py``, the CPU path of the op) computes: the index's tensors (centroids, or the query MLP,
and the RoPE's inverse frequencies) become initializers of the graph, and the clusters of the live sequence's
keys, which the runtime builds at prefill, become an input of the graph per layer:

``saap_clusters_<layer>`` (B, Hkv, N) int64: the cluster of each key position of the static cache, -1 for the keys
every query attends (the sink, the recent window and everything decoded after the prefill).
``saap_cluster_inputs`` makes them from the clusters that a prefill with ``saap_cache`` registered, or from a
``ClusterState`` (``runtime.saap.build.build_clusters``); where there is no PyTorch, ``export_saap_clusters`` writes
the prefill's assignment as its own ONNX graph (standard ops: keys and the prompt length in, the clusters out).
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

#: The graph input of a SAAP layer's key clusters.
CLUSTERS_INPUT = "saap_clusters_{layer}"
_CLUSTERS_ARG = 5  # the node's input that the graph input replaces


def check_saap(plan: str, q, k, site: str) -> None:
    """``ValueError`` before the export when a SAAP site cannot be exported: its index does not load or lacks the
    plan's layer, or the clusters input would not have a static shape. ``q``/``k`` are example (fake) tensors."""
    from attnopt.plan import plan_from_json
    from attnopt.runtime.saap.registry import get_index

    p = plan_from_json(plan)
    index = get_index(p.index)
    _refuse_rotated(index, p.index, f"SAAP plan at {site}")
    if p.layer not in index.layers:
        raise ValueError(f"SAAP plan at {site}: layer {p.layer} is not in the index {p.index} "
                         f"(layers {sorted(index.layers)})")
    shape = (q.shape[0], k.shape[1], k.shape[2]) if q is not None and k is not None else (None,)
    if not all(isinstance(d, int) for d in shape):
        raise ValueError(f"SAAP plan at {site}: the clusters input needs a static batch, KV heads and cache length; "
                         f"got {shape}; export with static shapes")


def saap_attention(translator: Any, q, k, v, bias, lengths, scale: float, is_causal: bool, plan: str, site: str):
    """The ``attnopt:saap_decode_attention[_mlp]`` node of one site (an ``OnnxTranslator`` translation)."""
    import onnx_ir as ir

    from attnopt.plan import plan_from_json
    from attnopt.runtime.kernels.saap_rule import scoring_centroids
    from attnopt.runtime.saap.registry import get_index

    from .onnx_functions import SAAP_INDEX_INPUTS

    p = plan_from_json(plan)
    index = get_index(p.index)  # check_saap checked the layer before the export
    layer = index.layers[p.layer]
    name = "saap_decode_attention" if layer.mlp is None else "saap_decode_attention_mlp"
    op = translator._op()

    def constant(t, label: str):
        return op.Constant(value=ir.tensor(np.ascontiguousarray(t.detach().cpu().float().numpy()),
                                           name=f"saap_l{p.layer}_{label}"))

    # the centroids or the MLP as the op scores with them (the rule: saap_rule.scoring_centroids, scoring_mlp; the
    # 16-bit values as fp32 initializers)
    tensors = ([scoring_centroids(layer.centroids)] if layer.mlp is None
               else list(layer.scoring_mlp(index.bn_eps)))
    weights = [constant(t, n) for t, n in zip(tensors, SAAP_INDEX_INPUTS[name])]
    shape = (q.shape[0], k.shape[1], k.shape[2])  # static: check_saap
    # a placeholder: ``add_cluster_inputs`` replaces it with the graph input after the export
    clusters = op.Constant(value=ir.tensor(np.full(shape, -1, dtype=np.int64), name=f"saap_l{p.layer}_placeholder"))
    translator.exported[site] = f"attnopt:{name} (function body)"
    attrs = dict(scale=scale, is_causal=int(is_causal), probes=int(p.probes), plan=plan, site=site)
    return translator._attnopt_op(name)(q, k, v, bias, lengths, clusters, constant(index.rope.inv_freq(), "inv_freq"),
                                        *weights, **attrs)


def add_cluster_inputs(model) -> list[str]:
    """Give every SAAP node of ``model`` (an ``onnx_ir.Model``) its layer's ``saap_clusters_<layer>`` graph input
    in place of the placeholder; returns the inputs' names (one per layer, shared by that layer's nodes)."""
    import onnx_ir as ir

    from .onnx_functions import DOMAIN, SAAP_INDEX_INPUTS
    from .plan import plan_from_json

    added: dict[str, Any] = {}
    for node in list(model.graph):
        if node.domain != DOMAIN or node.op_type not in SAAP_INDEX_INPUTS:
            continue
        layer = plan_from_json(node.attributes["plan"].as_string()).layer
        name = CLUSTERS_INPUT.format(layer=layer)
        placeholder = node.inputs[_CLUSTERS_ARG]
        if name not in added:
            value = ir.Value(name=name, shape=ir.Shape(placeholder.shape), type=ir.TensorType(ir.DataType.INT64))
            model.graph.inputs.append(value)
            added[name] = value
        node.replace_input_with(_CLUSTERS_ARG, added[name])
        if placeholder.uses():
            continue
        if placeholder.is_initializer():  # the exporter lifts constants to initializers
            model.graph.initializers.pop(placeholder.name)
        elif placeholder.producer() is not None:
            model.graph.remove(placeholder.producer(), safe=True)
    return list(added)


def saap_cluster_inputs(report: Any, n_keys: int, states: dict[int, Any] | None = None) -> dict[str, np.ndarray]:
    """The ``saap_clusters_<layer>`` inputs of an exported graph: {name: (B, Hkv, n_keys) int64}.

    Parameters
    ----------
    report : PlanReport
        ``export_onnx``'s report: its SAAP sites name the index and the layers.
    n_keys : int
        The static cache's length (the graph's N).
    states : dict, optional
        layer -> ``ClusterState``; by default the clusters a prefill with ``saap_cache`` registered for the index.
    """
    from attnopt.runtime.saap.registry import get_state

    out: dict[str, np.ndarray] = {}
    for s in report.sites:
        plan = s.chosen if s.rewritten else None
        if plan is None or plan.kind != "saap":
            continue
        state = (states or {}).get(plan.layer) if states is not None else get_state(plan.index, plan.layer)
        if state is None:
            raise ValueError(f"no SAAP clusters for layer {plan.layer} of {plan.index}: run a prefill with "
                             f"attnopt.runtime.saap.registry.saap_cache({plan.index!r}, sink={plan.sink}, "
                             f"window={plan.window}) first, or pass states")
        out[CLUSTERS_INPUT.format(layer=plan.layer)] = state.cluster_of_positions(n_keys).cpu().numpy()
    return out


def export_saap_clusters(index: str, path: str, *, batch: int, max_cache_len: int, sink: int, window: int,
                         layers: Sequence[int] | None = None, opset: int = 24) -> list[str]:
    """Export the prefill's cluster assignment as its own ONNX graph (standard ops only), so that a deployment
    without PyTorch can make the ``saap_clusters_<layer>`` inputs of an exported decode step.

    The graph takes ``prompt_len`` (scalar int64: the keys [0, prompt_len) are the prompt) and ``keys_<layer>``
    (B, Hkv, max_cache_len, D) float, the static cache's rotated keys, per layer; it returns ``saap_clusters_<layer>``
    (B, Hkv, max_cache_len) int64: each key's nearest centroid (L2, de-roped, as ``runtime/saap/build.py`` assigns
    the prompt at prefill) for the indexed keys [sink, max(sink, prompt_len - window)), -1 for every other position.
    ``layers`` defaults to every layer of the index. Returns the output names.
    """
    import torch

    from attnopt.runtime.saap.registry import get_index

    loaded = get_index(index)
    _refuse_rotated(loaded, index, "export_saap_clusters")
    layers = sorted(loaded.layers) if layers is None else list(layers)
    missing = [l for l in layers if l not in loaded.layers]
    if missing:
        raise ValueError(f"layers {missing} are not in the SAAP index {index} (layers {sorted(loaded.layers)})")
    if sink < 0 or window < 0:
        raise ValueError(f"sink ({sink}) and window ({window}) must be >= 0")
    module = _assignment_module(loaded, layers, sink, window).eval()
    ident = loaded.identity
    keys = [torch.zeros(batch, ident.num_kv_heads, max_cache_len, ident.head_dim) for _ in layers]
    outputs = [CLUSTERS_INPUT.format(layer=l) for l in layers]
    program = torch.onnx.export(module, (torch.tensor(max_cache_len), *keys), dynamo=True, opset_version=opset,
                                input_names=["prompt_len", *[f"keys_{l}" for l in layers]], output_names=outputs,
                                verbose=False)
    program.save(str(path))
    import onnx

    onnx.checker.check_model(str(path), full_check=True)
    return outputs


def _refuse_rotated(index: Any, path: Any, where: str) -> None:
    """The exported graphs de-rope queries and keys and score with the index's own centroids: an index over rotated
    keys, or one whose centroids move at prefill (``refine``), would export wrong, so refuse."""
    if index.rotated:
        raise ValueError(f"{where}: the SAAP index {path} clusters rotated keys (the default of 'attnopt saap "
                         f"train'); the ONNX export supports de-roped indexes only (train with --deroped --refine 0)")
    if getattr(index, "refine", 0):
        raise ValueError(f"{where}: the SAAP index {path} refines its centroids over each prompt at prefill "
                         f"(refine={index.refine}); the ONNX export scores with the trained centroids only (train "
                         f"with --deroped --refine 0)")


def _assignment_module(index: Any, layers: list[int], sink: int, window: int):
    """``runtime/saap/build.py``'s assignment over a whole static cache as a module: every position's cluster, -1
    outside the indexed range, whose end moves with ``prompt_len`` (an input)."""
    import torch

    from attnopt.runtime.saap.build import assign_keys
    from attnopt.runtime.saap.rope import remove_rope

    class ClusterAssignment(torch.nn.Module):
        def forward(self, prompt_len, *keys):
            out = []
            for layer, k in zip(layers, keys):
                positions = torch.arange(k.shape[2], device=k.device)
                assign = assign_keys(index.layers[layer].centroids, remove_rope(k, positions, index.rope))
                end = torch.clamp(prompt_len - window, min=sink)
                indexed = (positions >= sink) & (positions < end)
                out.append(torch.where(indexed, assign, torch.full_like(assign, -1)))
            return tuple(out)

    return ClusterAssignment()


__all__ = ["CLUSTERS_INPUT", "export_saap_clusters", "check_saap", "saap_attention", "add_cluster_inputs", "saap_cluster_inputs"]
