"""The nodes the ``lower`` pass adds beside each op call, shared between the sites of a graph where they can be: the
device valid length (or a window's key range) of a mask, Bloom's bias folded into the mask, ALiBi slopes as the op
takes them, NaN rows, and the fake values that later passes read."""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from .constants import constant_value
from .context import PassContext
from .patterns import AttentionMatch, meta_shape, meta_val


def _ops():
    import attnopt.runtime.ops  # noqa: F401  (registers torch.ops.attnopt.*)

    return torch.ops.attnopt


def _meta_key(gm: fx.GraphModule) -> str:
    for n in gm.graph.nodes:
        if "example_value" in n.meta:
            return "example_value"
    return "val"


def _fake(x: Any) -> Any:
    return meta_val(x) if isinstance(x, fx.Node) else x


def _set_meta(node: fx.Node, key: str, like: fx.Node) -> None:
    """Propagate a fake value through ``node`` (its op has a fake impl) and copy provenance from ``like``."""
    for k in ("nn_module_stack", "stack_trace", "source_fn_stack"):
        if k in like.meta:
            node.meta[k] = like.meta[k]
    args = torch.fx.node.map_arg(node.args, _fake)
    kwargs = torch.fx.node.map_arg(node.kwargs, _fake)
    vals = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
    if any(isinstance(a, fx.Node) for a in torch.utils._pytree.tree_leaves((args, kwargs))):
        return
    modes = {id(v.fake_mode): v.fake_mode for v in vals if hasattr(v, "fake_mode")}
    if len(modes) != 1:
        return
    (mode,) = modes.values()
    try:
        with mode:
            node.meta[key] = node.target(*args, **kwargs)
    except Exception:  # noqa: BLE001 - meta is a convenience for later passes; the graph is valid without it
        pass


def _shared_valid_len(graph: fx.Graph, ctx: PassContext, m: AttentionMatch, mask: fx.Node, q: fx.Node,
                      new_nodes: list, reduction: str = "valid_len_from_mask") -> fx.Node:
    """The ``valid_len_from_mask`` node of ``mask`` (or another per-row reduction of it, ``reduction``, such as
    ``key_start_from_mask``): one per graph, mask node and static batch size.

    Every layer of a decoder reads the same mask node, so one reduction per step serves all of them (it was one
    per layer: 30 launches and 30 host round trips of the op per SmolLM2 step). The shared node sits right after
    the mask's producer (after the last placeholder for an input mask), which precedes every site reading the
    mask. A symbolic batch size, or a mask made for this site alone (the ``logical_not`` of a ``masked_fill``
    spelling), gets a node of its own before the site, as before.
    """
    op = getattr(_ops(), reduction).default
    batch: Any = m.site.batch
    if batch is None or mask in new_nodes or m.mask_written:
        if batch is None:
            batch = graph.call_function(torch.ops.aten.sym_size.int, (q, 0))
            new_nodes.append(batch)
        node = graph.call_function(op, (mask, batch))
        new_nodes.append(node)
        return node
    key = (mask, int(batch), reduction)
    node = ctx.valid_lens.get(key)
    if node is None:
        anchor = mask if mask.op != "placeholder" else [n for n in graph.nodes if n.op == "placeholder"][-1]
        with graph.inserting_after(anchor):
            node = ctx.valid_lens[key] = graph.call_function(op, (mask, batch))
        new_nodes.append(node)
    return node


def _biased_mask(gm: fx.GraphModule, ctx: PassContext, m: AttentionMatch, mask: fx.Node | None,
                 new_nodes: list) -> fx.Node:
    """Bloom's baddbmm bias (``m.score_bias``, broadcast to the (B * H, L, N) scores, rows batch-major) viewed as
    (B, H, L, N) and added to the additive ``mask`` (or alone): the one mask the op takes. With a static batch it is
    made once, right after the later of the bias and the mask, for every site reading both (every Bloom layer reads
    one alibi and one mask), so that their valid length is shared too."""
    graph, site, bias = gm.graph, m.site, m.score_bias
    s = meta_shape(bias)
    full = (1,) * (3 - len(s)) + tuple(s)
    shared = site.batch is not None and (mask is None or mask not in new_nodes)
    key = ("score_bias", bias, mask)
    if shared and key in ctx.valid_lens:
        return ctx.valid_lens[key]
    aten = torch.ops.aten
    if shared:
        order = {n: i for i, n in enumerate(graph.nodes)}
        anchor = max((x for x in (bias, mask) if x is not None), key=order.__getitem__)
        if anchor.op == "placeholder":
            anchor = [n for n in graph.nodes if n.op == "placeholder"][-1]
        point = graph.inserting_after(anchor)
    else:
        point = graph.inserting_before(m.output)
    with point:
        if isinstance(full[0], int) and full[0] == 1:
            lead: list[Any] = [1, 1]
        elif site.batch is not None:
            lead = [site.batch, site.q_heads]
        else:
            lead = [graph.call_function(aten.sym_size.int, (m.q, 0)), site.q_heads]
            new_nodes.append(lead[0])
        view = graph.call_function(aten.reshape.default, (bias, lead + [1 if full[1] == 1 else site.q_len, -1]))
    with graph.inserting_after(view):
        node = view if mask is None else graph.call_function(aten.add.Tensor, (view, mask))
    meta_key = _meta_key(gm)
    for n in ((view,) if node is view else (view, node)):
        _set_meta(n, meta_key, m.output)
        if not shared:
            new_nodes.append(n)
    if shared:
        ctx.valid_lens[key] = node
    return node


def _shared_key_range(graph: fx.Graph, ctx: PassContext, m: AttentionMatch, mask: fx.Node, q: fx.Node,
                      new_nodes: list) -> tuple[fx.Node, fx.Node]:
    """(key start, valid length) of a window site: the two rows of one ``key_range_from_mask`` of ``mask`` (one scan
    of the mask for both ends), shared as ``_shared_valid_len`` shares it, the row views right after it."""
    rng = _shared_valid_len(graph, ctx, m, mask, q, new_nodes, "key_range_from_mask")
    ends = []
    for row in (0, 1):
        key = (rng, row)
        node = ctx.valid_lens.get(key)
        if node is None:
            with graph.inserting_after(rng):
                node = ctx.valid_lens[key] = graph.call_function(torch.ops.aten.select.int, (rng, 0, row))
            new_nodes.append(node)
        ends.append(node)
    return ends[0], ends[1]


def _slopes_per_head(gm: fx.GraphModule, ctx: PassContext, slopes: fx.Node, heads: int, new_nodes: list) -> fx.Node:
    """The ALiBi slopes (broadcastable to (1, H, 1, 1), H = ``heads`` or 1) as the op takes them: (Hq,) fp32,
    contiguous. One node per (slopes node, heads) for all the sites reading them (every layer of MPT reads one). Slopes
    built from constants alone (MPT's and Bloom's are) are evaluated now and read as a buffer: no launch per step
    (they were four per site: the slopes' own ``arange``/``pow`` and the cast and copy here)."""
    key = ("alibi_slopes", slopes, heads)
    node = ctx.valid_lens.get(key)
    if node is not None:
        return node
    graph = gm.graph
    value = constant_value(slopes)
    if value is not None and value.is_floating_point() and value.numel() in (1, heads):
        name = f"_attnopt_alibi_slopes_{len([k for k in ctx.valid_lens if k[0] == 'alibi_slopes'])}"
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():  # aot compilers run the passes under their fake mode
            buffer = value.reshape(-1).to(torch.float32).expand(heads).contiguous()
        gm.register_buffer(name, buffer)
        sources = getattr(gm, "_param_name_to_source", None)
        if sources is not None:  # a dynamo graph: aot autograd wants a source for every parameter and buffer
            from torch._dynamo.source import ConstantSource

            sources[name] = ConstantSource(f"attnopt:{name}")
        with graph.inserting_before(_first_user_position(graph)):
            node = graph.get_attr(name)
        mode = getattr(meta_val(slopes), "fake_mode", None)
        if mode is not None:  # the fake value later passes and the op's fake implementation read
            node.meta[_meta_key(gm)] = mode.from_tensor(buffer)
    else:
        aten = torch.ops.aten
        anchor = slopes if slopes.op != "placeholder" else [n for n in graph.nodes if n.op == "placeholder"][-1]
        with graph.inserting_after(anchor):
            flat = graph.call_function(aten.reshape.default, (slopes, [-1]))
        with graph.inserting_after(flat):
            f32 = graph.call_function(aten._to_copy.default, (flat,), {"dtype": torch.float32})
        with graph.inserting_after(f32):
            full = graph.call_function(aten.expand.default, (f32, [heads]))
        with graph.inserting_after(full):
            node = graph.call_function(aten.clone.default, (full,), {"memory_format": torch.contiguous_format})
        new_nodes += [flat, f32, full]
    ctx.valid_lens[key] = node
    new_nodes.append(node)
    return node


def _first_user_position(graph: fx.Graph) -> fx.Node:
    """The first node after the placeholders: where a constant's ``get_attr`` goes, before every reader."""
    return next(n for n in graph.nodes if n.op != "placeholder")


def _nan_empty_rows(graph: fx.Graph, out: fx.Node, mask: fx.Node, new_nodes: list) -> fx.Node:
    """NaN in the rows that ``mask`` (bool, True = attend; or additive) leaves without a visible key, as a plain
    softmax over a row of -inf gives (``AttentionMatch.empty_rows == "nan"``); the op gives 0 there."""
    aten = torch.ops.aten
    if mask.target is torch.ops.aten.logical_not.default or getattr(meta_val(mask), "dtype", None) == torch.bool:
        seen = graph.call_function(aten.any.dim, (mask, -1, True))
        empty = graph.call_function(aten.logical_not.default, (seen,))
        new_nodes += [seen, empty]
    else:
        hidden = graph.call_function(aten.isneginf.default, (mask,))
        empty = graph.call_function(aten.all.dim, (hidden, -1, True))
        new_nodes += [hidden, empty]
    out = graph.call_function(aten.where.ScalarSelf, (empty, float("nan"), out))
    new_nodes.append(out)
    return out
