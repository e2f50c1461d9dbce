"""``lower`` pass: replace each planned site with ``torch.ops.attnopt.decode_attention``. The only mutating
pass; it runs last.

For each match whose ``SiteReport.chosen`` is set, whose site is supported and not in
``config.skip_sites`` (node name or module path)::

    out = attnopt.decode_attention(q, k, v, mask, valid_len, scale, is_causal, plan.runtime_key(), site_key)

with the un-expanded K/V, ``valid_len = attnopt.valid_len_from_mask(mask, B)`` for valid-length and arbitrary
masks under a non-dense plan, and ``out = attnopt.check_close(out, original, ...)`` under ``config.verify``.
Variants: a softcapped site passes ``softcap=c``; a sliding-window site with a mask under a plan that reads
windows takes its ``key_start`` and ``valid_len`` from its band when the mask's graph proves one (``window.py``: two
tiny ops on the query positions; a pure band then passes no mask at all, a band AND padding passes the padding),
else from one ``attnopt.key_range_from_mask(mask, B)`` (the first key any query row may see and one past the last:
exact for any mask, so the kernels read only the band's keys); ``ctx.window_ranges`` says which and why.
The nodes that only fed the original attention (``repeat_kv`` copies, the eager chain) are then removed.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx as fx

from attnopt.plan import uses_valid_len

from . import guard
from .context import PassContext
from .lower_nodes import (_biased_mask, _meta_key, _nan_empty_rows, _ops, _set_meta, _shared_key_range,
                          _shared_valid_len, _slopes_per_head)
from .mutation import _PURE_OPERATORS, mutated_args
from .window import band_key_range
from .patterns import _SDPA_FUSED, AttentionMatch, is_aten_graph, is_metadata_assert, meta_shape, meta_val

#: Default ``verify`` tolerances per dtype: (atol, rtol).
VERIFY_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-8, 1e-8),
    torch.float32: (1e-4, 1e-4),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


def _is_impure(node: fx.Node) -> bool:
    if node.op in ("placeholder", "output", "get_attr", "call_module"):
        return True
    if node.op == "call_method" and str(node.target).endswith("_"):
        return True
    if mutated_args(node):  # F.relu(x, True), torch._foreach_mul_([x], c), out=: a write, whatever the name
        return True
    t = node.target
    name = getattr(t, "__name__", str(t))
    if node.op == "call_function" and name.endswith("_") and not name.endswith("__") \
            and node.target not in _PURE_OPERATORS:
        return True
    try:
        # Random ops (the fused SDPA variants carry the nondeterministic_seeded tag) are safe to drop unused.
        return node.is_impure(impure_random=False)
    except TypeError:  # torch without the impure_random flag
        return node.target not in _SDPA_FUSED and node.is_impure()
    except Exception:  # noqa: BLE001
        return True


def remove_dead(start: list[fx.Node]) -> int:
    """Erase ``start`` nodes and their producers that became dead (no users, pure). Returns the count."""
    graph = start[0].graph if start else None
    todo = list(start)
    removed = 0
    while todo:
        n = todo.pop()
        if getattr(n, "_erased", False) or n.graph is not graph or _is_impure(n):
            continue
        if n.users and all(is_metadata_assert(u) for u in n.users):
            for u in list(n.users):
                graph.erase_node(u)
        if n.users:
            continue
        inputs = list(n.all_input_nodes)
        graph.erase_node(n)
        removed += 1
        todo.extend(inputs)
    return removed


def _restride(graph: fx.Graph, new: fx.Node, like: Any) -> fx.Node:
    """Give ``new`` (contiguous) the stride order of ``like`` (a fake tensor) with one small output copy, so
    aten graphs that ``view`` the attention output under the original layout stay valid."""
    if not isinstance(like, torch.Tensor) or like.is_contiguous() or like.dim() != 4:
        return new
    strides = list(like.stride())
    perm = sorted(range(4), key=lambda i: (-strides[i], -i))  # outermost first
    inv = [perm.index(i) for i in range(4)]
    aten = torch.ops.aten
    p = graph.call_function(aten.permute.default, (new, perm))
    c = graph.call_function(aten.clone.default, (p,), {"memory_format": torch.contiguous_format})
    return graph.call_function(aten.permute.default, (c, inv))


def _reads_windows(plan) -> bool:
    """Whether ``plan``'s strategy reads only a window's keys given ``key_start`` (its "window" variant)."""
    from attnopt.runtime.strategies import get_strategy

    return "window" in get_strategy(plan.kind).variants


def _always_reads_windows(plan) -> bool:
    """Whether ``plan`` honours ``key_start`` on every call: every bucket of a bucketed plan reads windows (a bucket
    that does not drops ``key_start`` and relies on the mask, which a band site may no longer pass)."""
    from attnopt.plan import plan_from_json

    if plan.kind == "bucketed":
        return all(_always_reads_windows(plan_from_json(p)) for p in plan.plans)
    return _reads_windows(plan)


def runs_cascade(plan) -> bool:
    """Whether ``plan`` (or a bucket of a bucketed plan) is a shared-prefix cascade, which the cascade op runs."""
    from attnopt.plan import plan_from_json

    if plan.kind == "bucketed":
        return any(plan_from_json(p).kind == "cascade" for p in plan.plans)
    return plan.kind == "cascade"


def lower_site(gm: fx.GraphModule, ctx: PassContext, m: AttentionMatch, report, meta_key: str,
               aten_graph: bool) -> fx.Node:
    """Rewrite one site in place (the caller recompiles). Returns the node that now stands for the output."""
    ops = _ops()
    graph = gm.graph
    site = m.site
    plan = report.chosen
    plan_key = plan.runtime_key()
    if report.pending_key:  # a choice measured in the background: the op resolves the key to the winner, which lowers
        # as the fallback does (``passes.plan.without_valid_len``), whether or not the choice has ended by now
        from attnopt.tuning_defer import lowering_plan

        plan, plan_key = lowering_plan(report.pending_key), report.pending_key
    site_key = f"{ctx.graph_id}:{m.output.name if not site.node else site.node}"
    orig = m.output
    orig_val = meta_val(orig)
    new_nodes: list[fx.Node] = []
    with graph.inserting_before(orig):
        mask = m.attn_mask
        if isinstance(mask, fx.Node) and meta_shape(mask) == ():  # one value for every score (legal in eager code):
            mask = graph.call_function(torch.ops.aten.reshape.default, (mask, [1, 1, 1, 1]))  # the op reads a key dim
            _set_meta(mask, meta_key, m.attn_mask)
            new_nodes.append(mask)
        if mask is not None and m.mask_invert and m.mask_fill is not None:
            mask = graph.call_function(torch.ops.aten.where.Scalar, (mask, m.mask_fill, 0.0))
            new_nodes.append(mask)
        elif mask is not None and m.mask_invert:
            mask = graph.call_function(torch.ops.aten.logical_not.default, (mask,))
            new_nodes.append(mask)
        if m.score_bias is not None:
            mask = _biased_mask(gm, ctx, m, mask, new_nodes)
        q, k, v = m.q, m.k, m.v
        if m.perms:  # logical (B, H, L|N, D) views of tensors kept in another layout: free permutes
            def permuted(x, name):
                if name not in m.perms:
                    return x
                node = graph.call_function(torch.ops.aten.permute.default, (x, list(m.perms[name])))
                new_nodes.append(node)
                return node

            q, k, v = permuted(q, "q"), permuted(k, "k"), permuted(v, "v")
        q_dtype = getattr(torch, site.dtype, None)
        for c, is_div in m.scale_nodes:  # run-time scalar scale factors, folded into q
            c_val = meta_val(c)
            if isinstance(c_val, torch.Tensor) and isinstance(q_dtype, torch.dtype) and c_val.dtype != q_dtype:
                c = graph.call_function(torch.ops.aten._to_copy.default, (c,), {"dtype": q_dtype})  # no promotion
                new_nodes.append(c)
            q = graph.call_function(torch.ops.aten.div.Tensor if is_div else torch.ops.aten.mul.Tensor, (q, c))
            new_nodes.append(q)
        valid_len = key_start = None
        # Distributed plans get no valid_len: it would be read in the mask's columns, which may be global or this
        # rank's, and the tree/ring runtime cannot tell which; the mask alone is exact either way. Nor does a
        # split-KV plan outside a window: its programs skip the tiles the mask hides (``uses_valid_len``).
        if mask is not None and uses_valid_len(plan, site):
            if site.window is not None and _reads_windows(plan) and not (m.shared_prefix is not None
                                                                         and runs_cascade(plan)):
                drop_ok = m.empty_rows == "zero" and _always_reads_windows(plan)
                band = band_key_range(graph, ctx, m, mask, q, new_nodes, drop_ok)
                if isinstance(band, str):
                    ctx.window_ranges[site_key] = "scan: " + band
                    key_start, valid_len = _shared_key_range(graph, ctx, m, mask, q, new_nodes)
                else:
                    ctx.window_ranges[site_key] = "band"
                    key_start, valid_len, mask = band
            else:
                valid_len = _shared_valid_len(graph, ctx, m, mask, q, new_nodes)
        if m.shared_prefix is not None and runs_cascade(plan):  # the prefix and suffixes apart; the cat goes dead
            # (the cascade takes no variant: the planner refuses it softcapped and ALiBi sites, and a window's mask
            # alone is exact)
            out = graph.call_function(ops.cascade_attention.default,
                                      (q, *m.shared_prefix, mask, valid_len, float(site.scale), bool(site.is_causal),
                                       plan_key, site_key))
        else:
            variant: dict[str, Any] = {}
            if site.softcap is not None:
                variant["softcap"] = float(site.softcap)
            if m.alibi_slopes is not None:
                variant["alibi_slopes"] = _slopes_per_head(gm, ctx, m.alibi_slopes, site.q_heads, new_nodes)
            if key_start is not None:
                variant["key_start"] = key_start
            out = graph.call_function(ops.decode_attention.default,
                                      (q, k, v, mask, valid_len, float(site.scale), bool(site.is_causal),
                                       plan_key, site_key), variant)
        new_nodes.append(out)
        if m.empty_rows == "nan" and mask is not None:
            out = _nan_empty_rows(graph, out, mask, new_nodes)
        if isinstance(orig_val, torch.Tensor) and isinstance(q_dtype, torch.dtype) and orig_val.dtype != q_dtype:
            out = graph.call_function(torch.ops.aten._to_copy.default, (out,), {"dtype": orig_val.dtype})
            new_nodes.append(out)
        if aten_graph:
            restrided = _restride(graph, out, orig_val)
            if restrided is not out:
                new_nodes += [restrided.args[0].args[0], restrided.args[0], restrided]
                out = restrided
    for n in new_nodes:
        if isinstance(n, fx.Node):
            _set_meta(n, meta_key, orig)
    if ctx.config.verify:
        dt = orig_val.dtype if isinstance(orig_val, torch.Tensor) else torch.float32
        atol, rtol = VERIFY_TOLERANCES.get(dt, (2e-2, 2e-2))
        if ctx.config.verify_atol is not None:
            atol = float(ctx.config.verify_atol)
        with graph.inserting_after(orig):
            check = graph.call_function(ops.check_close.default, (out, orig, site_key, atol, rtol, ctx.config.verify_calls))
        _set_meta(check, meta_key, orig)
        orig.replace_all_uses_with(check, delete_user_cb=lambda u: u is not check)
        out = check
    else:
        orig.replace_all_uses_with(out)
        dead = [orig]
        if m.fused is not None:
            dead += [u for u in m.fused.users if not u.users] + [m.fused]
        remove_dead(dead)
    report.rewritten = True
    report.key = site_key
    ctx.rewrite_counts[m.pattern] = ctx.rewrite_counts.get(m.pattern, 0) + 1
    return out


def lower(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Rewrite every planned, supported, not-skipped site of ``gm``; then recompile."""
    if len(ctx.report.sites) != len(ctx.matches):
        raise RuntimeError(f"lower: {len(ctx.matches)} matches but {len(ctx.report.sites)} site reports; run detect "
                           "and plan first, on the same context")
    skip = set(ctx.config.skip_sites)
    meta_key = _meta_key(gm)
    aten_graph = is_aten_graph(gm)
    changed = False
    replaced: dict[fx.Node, fx.Node] = {}
    for m, report in zip(ctx.matches, ctx.report.sites):
        site = report.site
        if site.unsupported or report.chosen is None:
            continue
        if site.node in skip or (site.module_path and site.module_path in skip):
            report.site = dataclasses.replace(site, unsupported="skipped by config.skip_sites")
            continue
        m.site = site
        # An earlier rewrite may have replaced a node this site reads (attention feeding attention).
        for name in ("q", "k", "v", "attn_mask"):
            node = getattr(m, name)
            while node in replaced:
                node = replaced[node]
            setattr(m, name, node)
        orig = m.output
        before = set(gm.graph.nodes)
        try:
            replaced[orig] = lower_site(gm, ctx, m, report, meta_key, aten_graph)
        except Exception as exc:  # noqa: BLE001 - on_error: undo this site, or (raised) restore the whole graph
            if guard.reraise(ctx, exc) or not guard.undo_site(gm.graph, before, orig, ctx):
                raise
            report.site = m.site = guard.site_failed(ctx, site, "lower", exc)
            report.rewritten, report.key = False, ""
            continue
        changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()
    return gm


__all__ = ["lower", "lower_site", "remove_dead", "VERIFY_TOLERANCES"]
