"""In-place mutation and aliasing in FX graphs: what a rewrite must prove before it replaces a chain of nodes.

A rewrite replaces the nodes between an attention site's operands (q, k, v, mask, scale factors) and its output
with one op call placed just before the output. That is only equal to the original when no tensor the chain
reads changes while the chain runs: a mutation that happens between the first node of the chain and the
output is seen by some of the original's reads and not by others (or by the op and not by the original). Such
mutations are dropped edits of the scores (``s.div_(2)`` between the score product and the softmax), writes into
a copy that the matcher looked through (``k = k_cache.clone(); k[..., pos] = new``), or writes into an operand
after part of the chain has read it.

What counts as a mutation (anywhere in the graph): a method or function whose name ends in one underscore
(``mul_``, ``index_copy_``, ``copy_``, ``masked_fill_``), the in-place operators (``operator.iadd`` ...),
``operator.setitem``, any ``out=`` argument, an ``inplace`` flag given by keyword or by position
(``F.relu(x, True)``), every tensor of a ``torch._foreach_*_`` list, and every argument an op's schema marks as
written (an aten or custom op's, called as an overload or, ``torch.ops.ns.op(...)``, through its packet: then any
overload's). Its target's storage is found by walking back through every op that may return a view or alias of its
input (views, reshapes, ``contiguous``, same-dtype casts, in-place ops themselves, dropout, which returns its input
in eval mode, an einsum of one operand, and any op not known to allocate); two nodes alias when those walks meet. Unknown ops are taken as aliasing, so the analysis errs
towards leaving a site alone.

A write is fine when no node of the chain read the written storage before it and it edits no tensor the chain
made: the original's reads and the op's read then both see it. So Hugging Face's StaticCache, which writes K/V
with ``index_copy_`` and then reads the cache (while the query's transposes, mere views, come before), is
rewritten. ``lower``
computes one ``valid_len`` per mask node right after the mask's producer; for a mask written after it is
produced (``m = zeros(...); m[..., :n] = True``) ``written_after`` tells it to compute one per site instead.
"""
from __future__ import annotations

import functools
import inspect
import operator
from typing import Any, Iterable

import torch
import torch.fx as fx

#: Ops that always return a fresh tensor (never a view or alias of an input), by bare name.
_FRESH = frozenset({
    "matmul", "bmm", "baddbmm", "einsum", "mm", "addmm", "softmax", "_softmax", "_safe_softmax", "log_softmax", "mul",
    "div", "add", "sub", "rsub", "neg", "exp", "log", "tanh", "sigmoid", "where", "masked_fill", "clone", "cat",
    "stack", "full", "full_like", "zeros", "zeros_like", "ones", "ones_like", "empty", "empty_like", "new_zeros",
    "new_ones", "new_full", "new_empty", "arange", "tensor", "scalar_tensor", "repeat_interleave", "repeat",
    "scaled_dot_product_attention", "_to_copy", "eq", "ne", "lt", "le", "gt", "ge", "logical_not", "logical_and",
    "logical_or", "bitwise_and", "bitwise_or", "bitwise_not", "and", "or", "invert", "any", "all", "amax", "sum",
    "mean", "isneginf", "isinf", "pow", "sqrt", "rsqrt", "truediv", "floordiv", "clamp", "index_select", "gather",
    "linear", "embedding", "iota", "lift_fresh_copy", "tril", "triu", "matmul", "native_dropout",
    "relu", "gelu", "silu", "index_copy", "index_put", "scatter", "copy", "fill", "abs", "square", "cumsum",
})
#: Ops that only re-label their input's storage (no data read): a view made before a write reads nothing.
_PURE_VIEWS = frozenset({
    "view", "_unsafe_view", "transpose", "permute", "expand", "expand_as", "unsqueeze", "squeeze", "t", "alias",
    "slice", "select", "narrow", "as_strided", "view_as", "detach", "swapaxes", "swapdims", "movedim", "unflatten",
})
#: ``operator`` functions whose trailing underscore only avoids a keyword: pure, not in place.
_PURE_OPERATORS = (operator.and_, operator.or_, operator.not_, operator.is_)
_INPLACE_OPERATORS = (operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
                      operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift, operator.irshift,
                      operator.imod, operator.imatmul)


def _name(node: fx.Node) -> str:
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return t._schema.name.split("::")[-1]
    return t if isinstance(t, str) else getattr(t, "__name__", str(t))


def _is_inplace_name(name: str) -> bool:
    return name.endswith("_") and not name.endswith("__")


@functools.lru_cache(maxsize=None)
def _signature(target: Any) -> inspect.Signature | None:
    try:
        return inspect.signature(target)
    except (TypeError, ValueError):  # a builtin without a signature
        return None


def _schemas(target: Any) -> list:
    """The schemas of an aten or custom op: an ``OpOverload``'s own, or every overload's of an ``OpOverloadPacket``
    (``torch.ops.ns.op(...)`` in a user's function keeps the packet as the node's target), else none."""
    if isinstance(target, torch._ops.OpOverload):
        return [target._schema]
    if isinstance(target, torch._ops.OpOverloadPacket):
        try:
            return [getattr(target, name)._schema for name in target.overloads()]
        except (AttributeError, RuntimeError):  # an overload that does not resolve: no schema to read
            return []
    return []


def _inplace_flag(node: fx.Node) -> bool:
    """Whether a call passes ``inplace`` other than False, by keyword or by position (``F.relu(x, True)``,
    ``F.hardtanh(x, -1, 1, True)``, ``F.dropout(x, p, training, True)``: dynamo keeps the call as written). A flag
    that is not a literal (a graph value) counts as a write."""
    if "inplace" in node.kwargs:
        return node.kwargs["inplace"] is not False
    if node.op != "call_function" or not callable(node.target):
        return False
    try:
        sig = _signature(node.target)
    except TypeError:  # an unhashable target
        sig = None
    if sig is None or "inplace" not in sig.parameters:
        return False
    try:
        bound = sig.bind_partial(*node.args, **node.kwargs)
    except TypeError:
        return True  # the call does not bind: take the flag as given
    return "inplace" in bound.arguments and bound.arguments["inplace"] is not False


def mutated_args(node: fx.Node) -> list[fx.Node]:
    """The tensors ``node`` writes in place (empty for a pure node)."""
    if node.op not in ("call_function", "call_method"):
        return []
    out: list[Any] = []
    t = node.target
    schemas = _schemas(t)
    if schemas:
        for schema in schemas:  # an overload packet: what any of its overloads writes (the call binds one of them)
            for i, a in enumerate(schema.arguments):
                if a.alias_info is not None and a.alias_info.is_write:
                    if a.name in node.kwargs:
                        out.append(node.kwargs[a.name])
                    elif i < len(node.args) and not a.kwarg_only:
                        out.append(node.args[i])
    if not isinstance(t, torch._ops.OpOverload):
        name = _name(node)
        if t in _PURE_OPERATORS:
            return []
        if t is operator.setitem or t in _INPLACE_OPERATORS or _is_inplace_name(name) \
                or name in ("__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__iand__", "__ior__"):
            out.append(node.args[0] if node.args else node.kwargs.get("input", node.kwargs.get("self")))
        if _inplace_flag(node):
            out.append(node.args[0] if node.args else node.kwargs.get("input"))
    outs = node.kwargs.get("out")
    out.extend(outs if isinstance(outs, (list, tuple)) else [outs])
    flat = [y for x in out for y in (x if isinstance(x, (list, tuple)) else [x])]  # ``Tensor(a!)[]``: a list
    return [x for x in flat if isinstance(x, fx.Node)]


#: Ops whose schema promises a fresh tensor but that return their input itself: dropout in eval mode or with p=0
#: (``F.dropout``, ``torch.dropout``, ``aten.dropout``), and their feature / alpha variants.
_RETURN_INPUT = frozenset({"dropout", "feature_dropout", "alpha_dropout", "feature_alpha_dropout"})


def _may_alias_input(node: fx.Node) -> bool:
    """Whether ``node``'s result may share storage with one of its tensor inputs."""
    if node.op not in ("call_function", "call_method"):
        return False
    if mutated_args(node):
        return True  # an in-place op returns (an alias of) its target
    name = _name(node).strip("_")
    if name in _RETURN_INPUT:
        return True
    if name == "einsum":  # one operand: a permutation, a diagonal or the identity is a view of it
        operands = [a for a in node.all_input_nodes]
        return len(operands) < 2
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        # functional aten ops allocate their results; views and in-place ops declare the alias in the schema
        return any(r.alias_info is not None for r in t._schema.returns)
    if t is operator.getitem:
        return True
    return _name(node) not in _FRESH and _name(node).strip("_") not in _FRESH


def storage_roots(node: Any, cache: dict) -> frozenset:
    """The nodes whose storage ``node`` may share: itself when it allocates, else its inputs' roots."""
    if not isinstance(node, fx.Node):
        return frozenset()
    hit = cache.get(node)
    if hit is not None:
        return hit
    cache[node] = frozenset({node})  # cycles cannot happen in a DAG; this also bounds recursion on revisits
    todo = [node]
    order: list[fx.Node] = []
    seen = {node}
    while todo:  # iterative post-order, to stay clear of the recursion limit on long view chains
        n = todo.pop()
        order.append(n)
        if _may_alias_input(n):
            for a in n.all_input_nodes:
                if a not in seen and a not in cache:
                    seen.add(a)
                    todo.append(a)
    for n in reversed(order):
        roots = {n}
        if _may_alias_input(n):
            for a in n.all_input_nodes:
                roots |= cache.get(a, frozenset({a}))
        cache[n] = frozenset(roots)
    return cache[node]


def written_in_place(node: Any, limit: int = 256) -> bool:
    """Whether ``node``'s result is written in place anywhere in the graph, through itself or an alias made from it.
    Local (a walk over the users), so the patterns may ask it of any node without a ``MutationIndex``: an alias of
    a node's storage can only be made downstream of it. Conservatively True when the walk is cut off."""
    if not isinstance(node, fx.Node):
        return False
    seen = {node}
    todo = [node]
    while todo:
        if len(seen) > limit:
            return True
        n = todo.pop()
        for u in n.users:
            if n in mutated_args(u):
                return True
            if u not in seen and _may_alias_input(u):
                seen.add(u)
                todo.append(u)
    return False


def input_alias_groups(graph: fx.Graph) -> dict[fx.Node, frozenset]:
    """For each tensor input (placeholder) of ``graph``, every input that shares its storage: the caller may pass
    views of one tensor as separate arguments (``f(q, k, k.view(...))``), and a write through one is then a write to
    the others. The fake values in ``node.meta`` keep the real inputs' storage sharing. An input without a fake
    value is taken to alias every other such input."""
    from torch.multiprocessing.reductions import StorageWeakRef

    by_storage: dict[Any, list[fx.Node]] = {}
    unknown: list[fx.Node] = []
    for n in graph.nodes:
        if n.op != "placeholder":
            continue
        val = n.meta.get("val", n.meta.get("example_value"))
        if isinstance(val, torch.Tensor):
            try:
                by_storage.setdefault(StorageWeakRef(val.untyped_storage()), []).append(n)
                continue
            except (RuntimeError, NotImplementedError):  # a tensor subclass without a storage
                pass
        if val is None or isinstance(val, torch.Tensor):
            unknown.append(n)
    groups = {n: frozenset(group) for group in by_storage.values() for n in group}
    groups.update({n: frozenset(unknown) for n in unknown})
    return groups


class MutationIndex:
    """Every in-place write of one graph: (position, storage roots written), with node positions."""

    def __init__(self, graph: fx.Graph):
        self.position = {n: i for i, n in enumerate(graph.nodes)}
        self.roots: dict = dict(input_alias_groups(graph))  # storage_roots starts from the inputs' shared storage
        self.writes: list[tuple[int, fx.Node, frozenset]] = []
        for n in graph.nodes:
            for target in mutated_args(n):
                self.writes.append((self.position[n], n, storage_roots(target, self.roots)))

    def chain(self, sources: Iterable[Any], output: fx.Node) -> list[fx.Node]:
        """The nodes on a path from one of ``sources`` to ``output`` (sources excluded, output included)."""
        srcs = {s for s in sources if isinstance(s, fx.Node)}
        back: set[fx.Node] = set()
        todo = [output]
        while todo:
            n = todo.pop()
            if n in back or n in srcs:
                continue
            back.add(n)
            todo.extend(n.all_input_nodes)
        fwd: set[fx.Node] = set()
        todo = list(srcs)
        while todo:
            n = todo.pop()
            for u in n.users:
                if u in back and u not in fwd:
                    fwd.add(u)
                    todo.append(u)
        return [n for n in back if n in fwd]

    def written_after(self, node: Any) -> bool:
        """Whether any write to ``node``'s storage comes after ``node`` in the graph."""
        if not isinstance(node, fx.Node) or not self.writes:
            return False
        roots = storage_roots(node, self.roots)
        start = self.position[node]
        return any(pos > start and roots & written for pos, _, written in self.writes)

    def written(self, node: Any) -> bool:
        """Whether ``node``'s storage is written in place anywhere in the graph."""
        if not isinstance(node, fx.Node) or not self.writes:
            return False
        roots = storage_roots(node, self.roots)
        return any(roots & written for _, _, written in self.writes)

    def reason(self, sources: Iterable[Any], output: fx.Node) -> str | None:
        """Why replacing the chain from ``sources`` to ``output`` by one op before ``output`` is not provably
        equal to the original, or None. A write at position p (before the output) breaks it when

        * it writes a tensor that a chain node allocated before p (an intermediate, or a copy the matcher looked
          through): the op never computes that tensor, so the write is lost; or
        * a chain node before p read the written storage (so the original used the old values, and the op,
          placed at the output, reads the new ones). Views only re-label storage; they read nothing.
        """
        if not self.writes:
            return None
        sources = [s for s in sources if isinstance(s, fx.Node)]
        chain = self.chain(sources, output)
        end = self.position[output]
        for pos, writer, roots in self.writes:
            if pos >= end:
                continue
            hit = None
            for n in chain:
                if self.position[n] >= pos or n is writer:
                    continue
                if n in roots and not _may_alias_input(n):
                    hit = n  # an intermediate (or looked-through copy) edited after it was made
                    break
                if _name(n) not in _PURE_VIEWS and any(storage_roots(a, self.roots) & roots for a in n.all_input_nodes):
                    hit = n  # read before the write
                    break
            if hit is not None:
                what = writer.target if writer.op == "call_method" else _name(writer)
                return (f"in-place write {what} ({writer.name}) to a tensor the attention reads ({hit.name} used it "
                        "before the write): the rewrite could not prove the result unchanged")
        return None


__all__ = ["MutationIndex", "input_alias_groups", "mutated_args", "storage_roots", "written_in_place"]
