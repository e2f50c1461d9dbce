"""Layout tracking: follow an operand through views, permutes, transposes, (un)squeezes and no-op expands by
labelling the dims of a 4-D source tensor, so that any chain of layout ops (aten's ``expand/view/bmm/view``
included) is recognised as ``X.permute(perm)`` of a (B, H, L|N, D) tensor.

Proves: the tensor a matmul operand reads is exactly ``X.permute(perm)`` (same elements, no reduction or copy
that changes values), optionally times scalar factors (``scale``).
"""
from __future__ import annotations

import math
from typing import Any

import torch.fx as fx

from .nodes import _is_call, _is_noop, _norm_dim, _self, arg, is_metadata_assert, kind, meta_shape
from .scale import _scale_factor


# ============================================================================================ layout tracking
# A tensor's dims are tracked as tuples of *labels* (the dims of a 4-D source tensor X) through views,
# permutes, transposes, (un)squeezes and no-op expands, so that e.g. the 3-D operand (B*H, D, N) of an aten
# ``bmm`` is recognised as X.permute(...) of a (B, H, N, D) K, whatever chain of layout ops aten produced.
Dims = list  # list[tuple[int, ...]]


def _is_one(s: Any) -> bool:
    return isinstance(s, int) and s == 1


def _size_eq(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return True  # unknown: do not constrain
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    try:
        from torch.fx.experimental.symbolic_shapes import statically_known_true

        return bool(statically_known_true(a == b))
    except Exception:  # noqa: BLE001
        return str(a) == str(b)


def _getitem_index(node: fx.Node) -> tuple | None:
    """The index of ``x[...]`` when it only holds full slices and None (a layout op), else None."""
    if kind(node) != "getitem" or len(node.args) < 2 or not isinstance(node.args[0], fx.Node):
        return None
    idx = node.args[1]
    idx = idx if isinstance(idx, tuple) else (idx,)
    if all(i is None or (isinstance(i, slice) and i == slice(None)) for i in idx):
        return idx
    return None


def _perm_arg(node: fx.Node) -> list | None:
    if node.op == "call_method":
        rest = node.args[1:]
        dims = rest[0] if len(rest) == 1 and isinstance(rest[0], (list, tuple)) else rest
        return list(node.kwargs.get("dims", dims))
    dims = arg(node, 1, "dims", None)
    return list(dims) if dims is not None else None


def _is_layout_op(node: Any, allow_scale: bool = False) -> bool:
    if not _is_call(node):
        return False
    if _is_noop(node) or _getitem_index(node) is not None:
        return True
    if kind(node) in ("permute", "transpose", "unsqueeze", "squeeze", "view"):
        return True
    return allow_scale and _scale_factor(node) is not None


def layout_path(node: Any, allow_scale: bool = False, limit: int = 16) -> list:
    """``[node, parent, ...]`` following layout ops (and scalar scalings when ``allow_scale``) backwards;
    the last entry is the first node that is not a layout op."""
    path = [node]
    cur = node
    for _ in range(limit):
        if not _is_layout_op(cur, allow_scale):
            break
        sf = _scale_factor(cur) if allow_scale else None
        nxt = sf[0] if sf is not None else _self(cur)
        if not isinstance(nxt, fx.Node):
            break
        path.append(nxt)
        cur = nxt
    return path


def _simulate(node: fx.Node, dims: Dims, sizes: dict) -> Dims | None:
    """The labelled dims of ``node``'s output given those of its input; None when not a tracked layout op."""
    k = kind(node)
    nd = len(dims)
    if _is_noop(node):
        return dims
    idx = _getitem_index(node)
    if idx is not None:
        out, it = [], iter(dims)
        for i in idx:
            if i is None:
                out.append(())
            else:
                nxt = next(it, None)
                if nxt is None:
                    return None
                out.append(nxt)
        return out + list(it)
    if k == "permute":
        p = _perm_arg(node)
        if p is None or len(p) != nd:
            return None
        return [dims[_norm_dim(i, nd) if isinstance(i, int) and i < 0 else i] for i in p]
    if k == "transpose":
        d0, d1 = arg(node, 1, "dim0", None), arg(node, 2, "dim1", None)
        if not isinstance(d0, int) or not isinstance(d1, int):
            return None
        d0, d1 = d0 % nd, d1 % nd
        out = list(dims)
        out[d0], out[d1] = out[d1], out[d0]
        return out
    if k == "unsqueeze":
        d = arg(node, 1, "dim", None)
        if not isinstance(d, int):
            return None
        out = list(dims)
        out.insert(d % (nd + 1), ())
        return out
    if k == "squeeze":
        d = arg(node, 1, "dim", None)
        ds = None if d is None else ([d] if isinstance(d, int) else list(d))
        ones = [i for i, g in enumerate(dims) if all(_is_one(sizes[lab]) for lab in g)]
        drop = set(ones) if ds is None else {x % nd for x in ds} & set(ones)
        return [g for i, g in enumerate(dims) if i not in drop]
    if k == "view":
        target = meta_shape(node)
        if target is None:
            return None
        labels = [lab for g in dims for lab in g if not _is_one(sizes[lab])]
        out, i = [], 0
        for t in target:
            if _is_one(t):
                out.append(())
                continue
            grp: list = []
            while i < len(labels):
                grp.append(labels[i])
                i += 1
                prod = math.prod(sizes[lab] for lab in grp) if all(isinstance(sizes[lab], int) for lab in grp) else None
                if prod is None:
                    prod = sizes[grp[0]]
                    for lab in grp[1:]:
                        prod = prod * sizes[lab]
                if _size_eq(prod, t):
                    break
                if isinstance(prod, int) and isinstance(t, int) and prod > t:
                    return None
            else:
                return None
            out.append(tuple(grp))
        if i != len(labels):
            return None
        return out
    return None


def _assign_roles(dims: Dims, sizes: dict, groups: list, expect: tuple) -> list | None:
    """Map labels to the logical roles (0, 1, 2, 3) given how roles are grouped into the operand's dims.
    Returns ``perm`` with X.permute(perm) = the logical tensor, or None."""
    if len(dims) != len(groups):
        return None
    present = [lab for g in dims for lab in g]
    if len(set(present)) != len(present):
        return None
    pool = [lab for lab in range(4) if lab not in present]
    if not all(_is_one(sizes[lab]) for lab in pool):
        return None
    role_label: list = [None] * 4
    for d, g in zip(dims, groups):
        labs = list(d)
        for role in g:
            want = expect[role]
            if labs and _size_eq(sizes[labs[0]], want) and not (_is_one(want) and not _is_one(sizes[labs[0]])):
                role_label[role] = labs.pop(0)
            elif _is_one(want) and pool:
                role_label[role] = pool.pop(0)
            elif labs and _is_one(sizes[labs[0]]) and _is_one(want):
                role_label[role] = labs.pop(0)
            else:
                return None
        if labs:
            if not all(_is_one(sizes[lab]) for lab in labs):
                return None
            pool.extend(labs)
    if sorted(x for x in role_label if x is not None) != [0, 1, 2, 3]:
        return None
    return role_label


def resolve_operand(node: Any, groups: list, expect: tuple, allow_scale: bool = False):
    """Find the 4-D tensor X behind a matmul operand and how it maps to the logical (B, H, a, b) tensor.

    Parameters
    ----------
    node : the operand (3-D for ``bmm``: (B*H, x, y); 4-D for ``matmul``/einsum).
    groups : which logical roles each operand dim holds, e.g. ``[[0, 1], [3], [2]]`` for a K^T bmm operand
        (B*H, D, N) of a logical K (B, H, N, D).
    expect : the logical sizes (None = unknown).
    allow_scale : also walk through scalar multiplications/divisions (returned as factors).

    Returns
    -------
    (X, perm, factors) with ``X.permute(perm)`` the logical tensor, or None.
    """
    if not isinstance(node, fx.Node):
        return None
    path = layout_path(node, allow_scale)
    for idx in range(len(path) - 1, -1, -1):
        x = path[idx]
        s = meta_shape(x)
        if s is None or len(s) != 4:
            continue
        dims: Dims = [(0,), (1,), (2,), (3,)]
        sizes = dict(enumerate(s))
        factors: list = []
        ok = True
        for n in reversed(path[:idx]):
            sf = _scale_factor(n) if allow_scale and kind(n) in ("mul", "div") else None
            if sf is not None:
                factors.append(sf[1])
                continue
            dims = _simulate(n, dims, sizes)
            if dims is None:
                ok = False
                break
        if not ok:
            continue
        perm = _assign_roles(dims, sizes, groups, expect)
        if perm is not None:
            return x, perm, factors
    return None


def follow_output(mm: fx.Node, dims: Dims, sizes: dict, limit: int = 8) -> fx.Node | None:
    """From a matmul whose output dims are ``dims`` (labels 0..3 = B, H, L, Dv), follow single-user layout ops
    to the first node that is the logical (B, H, L, Dv) tensor in canonical order."""
    cur = mm
    for _ in range(limit):
        if len(dims) == 4 and _assign_roles(dims, sizes, [[0], [1], [2], [3]], tuple(sizes[i] for i in range(4))) == [0, 1, 2, 3]:
            return cur
        users = [u for u in cur.users if not is_metadata_assert(u)]
        if len(users) != 1 or not _is_layout_op(users[0]) or _self(users[0]) is not cur:
            return None
        cur = users[0]
        dims = _simulate(cur, dims, sizes)
        if dims is None:
            return None
    return None
