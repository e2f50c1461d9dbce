"""Shared prefix: K/V whose first P keys are one tensor that every batch row shares.

Proves: ``k = cat([x.expand(B, Hkv, P, D), s], dim=2)`` (torch ``cat``/``concat``/``concatenate`` or
``aten.cat``; the broadcast as ``expand``, ``expand_as`` or ``broadcast_to``) with ``x`` of batch 1, and the same for
``v``, means row ``b`` of K/V is ``x[0]`` followed by ``s[b]``: the rows share keys [0, P) exactly. The cascade plan
then reads ``x`` once for every row instead of the B copies ``cat`` makes. It is the form that
``attnopt.runtime.shared_prefix.SharedPrefixCache`` returns to a Hugging Face attention, and the one a user writes
by hand for parallel sampling.

Anything else (a prefix repeated by ``repeat``/``index_select``, equal rows that no broadcast proves, more than two
parts, a cat along another dim, a K/V seen through a permutation) is not a shared prefix: the site keeps the plain
plans, and the cascade's rejection says why. A write to a part between the ``cat`` and the attention makes the
rewrite unprovable (``MutationIndex.reason``), and the site then keeps the plain plans too.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from .nodes import AttentionMatch, _norm_dim, _self, arg, aten, kind, meta_shape, same_size, skip_noops

_CAT_TARGETS = tuple(t for t in (torch.cat, getattr(torch, "concat", None), getattr(torch, "concatenate", None),
                                 aten.cat.default) if t is not None)
_BROADCAST_TARGETS = (torch.broadcast_to, aten.expand.default)


def _cat_parts(node: Any) -> list[Any] | None:
    """The two parts of a ``cat`` along dim 2 of 4-D tensors, or None."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or node.target not in _CAT_TARGETS:
        return None
    parts = arg(node, 0, "tensors", None)
    dim = _norm_dim(arg(node, 1, "dim", 0), 4)
    if not isinstance(parts, (list, tuple)) or len(parts) != 2 or dim != 2:
        return None
    return list(parts)


def batch_broadcast_source(node: Any) -> Any:
    """``x`` when ``node`` is a 4-D ``x`` of batch 1 broadcast over the batch (other sizes unchanged), else None."""
    if not isinstance(node, fx.Node):
        return None
    is_broadcast = kind(node) == "expand" or (node.op == "call_function" and node.target in _BROADCAST_TARGETS)
    if not is_broadcast:
        return None
    src = skip_noops(_self(node))
    out_shape, src_shape = meta_shape(node), meta_shape(src)
    if out_shape is None or src_shape is None or len(out_shape) != 4 or len(src_shape) != 4:
        return None
    if not (isinstance(src_shape[0], int) and src_shape[0] == 1) or not same_size(src_shape[1:], out_shape[1:]):
        return None
    return src


def _differ(a: Any, b: Any) -> bool:
    """Two lengths that are static and unequal. Symbolic ones (a growing cache's K and V are separate inputs with
    separate symbols) are taken as equal: were they not, the original attention raises at run time, as does the op."""
    return isinstance(a, int) and isinstance(b, int) and a != b


def find_shared_prefix(m: AttentionMatch, writes) -> tuple[fx.Node, fx.Node, fx.Node, fx.Node] | None:
    """(k_prefix (1, Hkv, P, D), v_prefix (1, Hkv, P, Dv), k_suffix (B, Hkv, S, D), v_suffix (B, Hkv, S, Dv)) when
    the match's K and V provably are a shared prefix plus per-row suffixes (module docstring), else None."""
    if m.perms.get("k") or m.perms.get("v"):
        return None
    k_parts, v_parts = _cat_parts(skip_noops(m.k)), _cat_parts(skip_noops(m.v))
    if k_parts is None or v_parts is None:
        return None
    kp, vp = batch_broadcast_source(k_parts[0]), batch_broadcast_source(v_parts[0])
    if kp is None or vp is None:
        return None
    shapes = [meta_shape(x) for x in (kp, vp, k_parts[1], v_parts[1])]
    if any(s is None or len(s) != 4 for s in shapes) or _differ(shapes[0][2], shapes[1][2]) \
            or _differ(shapes[2][2], shapes[3][2]):
        return None
    parts = (kp, vp, k_parts[1], v_parts[1])
    if writes.reason(list(parts), m.output) is not None:
        return None
    return parts
