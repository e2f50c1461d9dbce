"""ALiBi biases: an additive score bias that provably is a per-head slope times the key position.

Proves: the bias is ``S * P`` (through layout ops that keep the last three dims (head, query, key), slices of the
query and key dims with step 1, fp32/fp64 casts: MPT's ``alibi.squeeze(0)[:, qi:, ki:]``) where ``P`` holds key
positions (``arange`` with step 1 along the last dim plus offsets that are the same for every key, as
``masks._key_positions`` proves) and ``S`` depends on nothing but the head: its query and key dims have size 1 and
so has its batch dim (where it has one). Then ``S * P = S * j + S * offset``, and the second term is the same for
every key of a row, so the softmax is that of ``S * j`` (the op's ``alibi_slopes``): MPT-style and Bloom-style
(``slopes[:, None, None] * arange(n)``) biases built in the graph.

Anything else (a chain any node of which is written in place, such as the positions' ``arange`` edited before use;
a bias read from memory, rounded to fp16/bf16 on the way (the original's rounding of ``S * j`` could not be
reproduced); positions that are not an ``arange`` of the keys, or one in a dtype that rounds them, such as bf16 past
256 keys) is not ALiBi here; the eager pattern then applies it exactly as a general additive mask.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from ..mutation import MutationIndex
from .layout import _getitem_index, _is_one
from .masks import _key_positions
from .nodes import _binary, _is_call, _is_noop, _self, arg, kind, meta_dtype, meta_shape

_WIDE = (torch.float32, torch.float64)


def _trailing(node: Any) -> tuple | None:
    """The sizes of the last three dims (head, query, key) of ``node``, padded with 1 on the left."""
    s = meta_shape(node)
    return None if s is None else ((1, 1, 1) + tuple(s))[-3:]


def _slices_query_or_keys(node: fx.Node) -> bool:
    """A slice that cuts only the query and key dims (the last two), with step 1: the key positions shift by a
    constant and each head keeps its slope."""
    nd = len(meta_shape(node) or ())
    if kind(node) == "slice":  # aten.slice.Tensor(x, dim, start, end, step)
        dim, step = arg(node, 1, "dim", 0), arg(node, 4, "step", 1)
        return isinstance(dim, int) and (dim % max(nd, 1)) >= nd - 2 and step == 1
    if kind(node) != "getitem" or len(node.args) < 2:
        return False
    idx = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
    if any(i is None or i is Ellipsis or not isinstance(i, slice) for i in idx) or len(idx) > nd:
        return False
    full = tuple(idx) + (slice(None),) * (nd - len(idx))  # an index names the leading dims: x[:, 1:] cuts the heads
    return all(i == slice(None) for i in full[:-2]) and all(i.step in (None, 1) for i in full[-2:])


def _keeps_values(node: fx.Node) -> bool:
    """An op after which every (head, query, key) element still holds its value, or a value of the same head in the
    same row shifted along the keys: a widening float cast, a layout op that keeps the last three dims (a size 1
    may be broadcast), a slice of the query or key dims."""
    src = _self(node)
    if kind(node) == "cast":
        return meta_dtype(node) in _WIDE and meta_dtype(src) in _WIDE
    if _slices_query_or_keys(node):
        return True
    if not (kind(node) in ("unsqueeze", "squeeze", "view", "expand", "clone") or _is_noop(node)
            or _getitem_index(node) is not None):
        return False
    a, b = _trailing(src), _trailing(node)
    return a is not None and b is not None and all(x == y or _is_one(x) for x, y in zip(a, b))


def _peel(node: Any, seen: list, depth: int = 12) -> Any:
    """``node`` through the ops of :func:`_keeps_values` (each one appended to ``seen``)."""
    cur = node
    for _ in range(depth):
        if not (_is_call(cur) and _keeps_values(cur)):
            break
        seen.append(cur)
        cur = _self(cur)
    return cur


def _per_head(node: Any) -> bool:
    """Whether ``node`` (the slopes side) is a float tensor of rank <= 4 that varies along the head dim at most:
    batch (where present), query and key dims of size 1."""
    if not isinstance(node, fx.Node) or meta_dtype(node) not in _WIDE:
        return False
    s = meta_shape(node)
    if s is None or len(s) > 4:
        return False
    full = (1,) * (4 - len(s)) + tuple(s)
    return _is_one(full[0]) and _is_one(full[2]) and _is_one(full[3])


def alibi_slopes_of(bias: Any, writes: MutationIndex | None = None) -> fx.Node | None:
    """The slopes node ``S`` (broadcastable to (1, H, 1, 1)) when the additive score bias ``bias`` provably is
    ``S * key_position`` plus a per-row constant (see the module docstring), else None. With ``writes``, a chain
    any node of which is written in place (the positions' ``arange`` edited before use) is no ALiBi either."""
    if not isinstance(bias, fx.Node) or meta_dtype(bias) not in _WIDE:
        return None
    s = meta_shape(bias)
    if s is None or not 1 <= len(s) <= 4:
        return None
    seen: list = []
    cur = _peel(bias, seen)
    if kind(cur) != "mul" or meta_dtype(cur) not in _WIDE:
        return None
    a, b = _binary(cur)
    for slopes, positions in ((a, b), (b, a)):
        walked = seen + [cur, slopes]
        if _per_head(slopes) and _key_positions(positions, seen=walked):
            if writes is not None and any(writes.written(node) for node in walked):
                return None
            return slopes
    return None


__all__ = ["alibi_slopes_of"]
