"""The score and value products of an eager attention chain: ``matmul``, aten ``bmm``, ``einsum`` and Bloom's
``baddbmm``, and which operand dimension plays which role (batch, heads, query, key, head dim).

``eager.match_eager`` reads them: ``matmul_behind`` finds a product through layout ops, ``_operand_groups`` gives
its operands' role groups (or the reason it is not a (B, H, L, D) score / value product), ``_baddbmm_terms`` the
bias and scale that ``baddbmm`` folds in (see ``eager``'s docstring for why that is exact).
"""
from __future__ import annotations

import re
from typing import Any

import torch
import torch.fx as fx

from .layout import Dims, layout_path
from .nodes import _binary, _dtype_name, _is_call, _ndim, _number, _self, _sym_eq, arg, kind, meta_dtype, meta_shape


def matmul_behind(node: Any) -> tuple[fx.Node, list] | None:
    """(matmul/bmm/einsum, layout path from it to ``node``) when ``node`` is a matmul result seen through
    layout ops only (aten: ``view(bmm(...))``), else None."""
    if not isinstance(node, fx.Node):
        return None
    path = layout_path(node)
    if kind(path[-1]) in ("matmul", "bmm", "einsum", "baddbmm"):
        return path[-1], path[:-1]
    return None


def _is_matmul_like(node: Any) -> bool:
    return matmul_behind(node) is not None


def _leads_to_matmul(node: Any, depth: int = 8) -> bool:
    """Whether ``node`` is (after a few elementwise ops on its first tensor argument) a matmul result."""
    cur = node
    for _ in range(depth):
        if not isinstance(cur, fx.Node):
            return False
        if _is_matmul_like(cur):
            return True
        k = kind(cur)
        if k in ("add", "mul", "div"):
            a, b = cur.args[0] if cur.args else None, cur.args[1] if len(cur.args) > 1 else None
            if isinstance(b, fx.Node) and not isinstance(a, fx.Node):
                cur = b
                continue
            if isinstance(a, fx.Node) and isinstance(b, fx.Node) and _leads_to_matmul(b, depth - 1) and not _leads_to_matmul(a, depth - 1):
                cur = b
                continue
        cur = _self(cur) if k is not None or _is_call(cur) else None
    return False

_EINSUM_RE = re.compile(r"^\s*([a-zA-Z.]+)\s*,\s*([a-zA-Z.]+)\s*->\s*([a-zA-Z.]+)\s*$")


def _einsum_operands(node: fx.Node) -> tuple[str | None, list[Any]]:
    if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        eq, ops = node.args[0], list(node.args[1])
    else:
        eq = node.args[0]
        ops = list(node.args[1]) if len(node.args) == 2 and isinstance(node.args[1], (list, tuple)) else list(node.args[1:])
    return (eq if isinstance(eq, str) else None), ops


def _parse_einsum(eq: str | None) -> tuple[str, str, str] | None:
    m = _EINSUM_RE.match(eq or "")
    return (m.group(1), m.group(2), m.group(3)) if m else None


_ID = [[0], [1], [2], [3]]


def _einsum_groups(mm: fx.Node, which: str) -> tuple[list | None, list | None, list, str | None]:
    """Operand role groups of a 4-D einsum score product (``bhqd,bhkd->bhqk``, any operand letter order) or
    value product (``bhqk,bhkd->bhqd``), its operands in either order: an einsum's operands commute, and the
    output's letters say which is which (``bhkd,bhqk->bhqd`` is the value product with V first). Returns (groups of
    the query / probabilities operand, groups of the key / value operand, those two operands in that order (as
    written where the equation is no such product), reason)."""
    eq, ops = _einsum_operands(mm)
    p = _parse_einsum(eq)
    if p is None or len(ops) != 2:
        return None, None, ops, f"einsum {eq!r} is not understood"
    a, b, o = p
    contracted = (set(a) & set(b)) - set(o)
    what = "(b h q d, b h k d -> b h q k) score" if which == "qk" else "(b h q k, b h k d -> b h q d) value"
    if not (len(a) == len(b) == len(o) == 4 and len(set(o)) == 4 and len(contracted) == 1):
        return None, None, ops, f"einsum {eq!r} is not a {what} product"
    c = contracted.pop()
    B, H, I, J = o
    if set(b) == {B, H, I, c} and set(a) == {B, H, J, c}:  # the operands swapped
        a, b, ops = b, a, [ops[1], ops[0]]
    if set(a) != {B, H, I, c} or set(b) != {B, H, J, c}:
        return None, None, ops, f"einsum {eq!r} is not a {what} product"
    if which == "qk":  # q (b, h, i, d); K logical (b, h, n, d) with n = J
        r0, r1 = {B: 0, H: 1, I: 2, c: 3}, {B: 0, H: 1, J: 2, c: 3}
    else:  # p (b, h, i, n) with n = c; V logical (b, h, n, dv) with dv = J
        r0, r1 = {B: 0, H: 1, I: 2, c: 3}, {B: 0, H: 1, c: 2, J: 3}
    return [[r0[x]] for x in a], [[r1[x]] for x in b], ops, None


def _operand_groups(mm: fx.Node, which: str) -> tuple[list | None, list | None, list, str | None]:
    """(groups of operand 0, groups of operand 1, the two operands, reason) for a score ("qk") or value ("pv")
    product given as matmul, bmm or einsum."""
    k = kind(mm)
    if k == "einsum":
        return _einsum_groups(mm, which)
    ops = [arg(mm, 1, "batch1", None), arg(mm, 2, "batch2", None)] if k == "baddbmm" else list(_binary(mm))
    nd = _ndim(mm)
    if k == "bmm" or nd == 3:
        g0 = [[0, 1], [2], [3]]
        g1 = [[0, 1], [3], [2]] if which == "qk" else [[0, 1], [2], [3]]
        return g0, g1, ops, None
    if nd == 4:
        return _ID, ([[0], [1], [3], [2]] if which == "qk" else _ID), ops, None
    return None, None, ops, f"{nd}-D attention (expects (B, H, L, D) tensors)"


def _sizes_of(x: fx.Node, perm: list) -> tuple:
    s = meta_shape(x)
    return tuple(s[i] for i in perm)


def _mm_dims(mm: fx.Node) -> Dims:
    return [(0, 1), (2,), (3,)] if (kind(mm) == "bmm" or _ndim(mm) == 3) else [(0,), (1,), (2,), (3,)]


def _baddbmm_terms(mm: fx.Node, scores: tuple) -> tuple[Any, float | None, str | None]:
    """(bias, alpha, reason) of Bloom's ``baddbmm(bias, q, k^T, beta=1, alpha=a)`` = ``a * (q @ k^T) + bias``:
    ``scores`` is the (B * H or None, L, N) shape of the product. The bias must broadcast to it, be a float of the
    scores' dtype, and ``beta`` be 1 and ``alpha`` a compile-time number; reason says why not."""
    bias = arg(mm, 0, "input", None)
    beta, alpha = _number(mm.kwargs.get("beta", 1)), _number(mm.kwargs.get("alpha", 1))
    if beta != 1:
        return None, None, f"baddbmm with beta={mm.kwargs.get('beta')!r} (the bias scaled)"
    if alpha is None:
        return None, None, "baddbmm with a run-time alpha"
    dt, s = meta_dtype(bias), meta_shape(bias)
    if not isinstance(bias, fx.Node) or s is None or dt is None or not dt.is_floating_point or len(s) > 3:
        return None, None, "baddbmm's bias is not a float tensor of rank <= 3"
    if dt != meta_dtype(mm) or dt in (torch.float16, torch.bfloat16):
        return None, None, (f"baddbmm sums its bias with the scores in {_dtype_name(meta_dtype(mm))}: the original's "
                            "rounding there cannot be reproduced")
    full = (1,) * (3 - len(s)) + tuple(s)
    for have, want in zip(full, scores):
        if not (isinstance(have, int) and have == 1) and (want is None or not _sym_eq(have, want)):
            return None, None, f"baddbmm's bias of shape {tuple(s)} is not broadcast from (B * H, L, N) or 1s"
    return bias, float(alpha), None
