"""The attention patterns that ``passes.detect`` recognises, at torch level (dynamo) and aten level
(aot_autograd, make_fx, ``torch.export``).

Each pattern is documented by the eager function it comes from (``PATTERNS[name].example``; the tests trace
these), and matched by a function over FX nodes that reads shapes from ``node.meta`` ("example_value" in
dynamo graphs, "val" in aten/export graphs):

``sdpa``
    ``F.scaled_dot_product_attention`` (target ``torch._C._nn.scaled_dot_product_attention``) and
    ``aten.scaled_dot_product_attention.default`` (``torch.export``).
``sdpa_flash_cpu``, ``sdpa_flash``, ``sdpa_efficient``, ``sdpa_cudnn``, ``sdpa_math``, ``sdpa_overrideable``
    The fused aten variants that return a tuple; only output 0 may be used.
``eager_matmul``, ``eager_bmm``, ``eager_einsum``
    ``matmul(q, k^T)`` (scale, additive or boolean mask) -> ``softmax(-1)`` (fp32 upcast, cast back, inference
    dropout) -> ``matmul(p, v)``; at aten level the matmuls are ``expand/view/bmm/view`` chains.

Operands are followed through layout ops (view/reshape/_unsafe_view, permute, transpose, (un)squeeze, no-op
expand/clone) by tracking dims as labels of a 4-D source tensor (``resolve_operand``), so the aten-level chains
of ``matmul``/``einsum`` decompositions and caches kept as (B, N, H, D) are recognised; a non-identity layout
becomes a free ``permute`` view in ``lower``.

K/V reach every pattern either directly, or expanded to the query heads by ``repeat_kv``
(``x[:, :, None].expand(b, hkv, g, n, d).reshape(b, hkv * g, n, d)``) or ``repeat_interleave(g, dim=1)``;
``AttentionMatch.k``/``v`` are then the *un-expanded* tensors, so the rewritten op reads the cache itself.

What a rewrite proves (anything else is left alone, with the reason in ``site.unsupported``):

* **No write while the chain runs** (``passes.mutation``): an in-place op, ``out=`` or setitem on any tensor
  the chain reads (or an alias of its storage) between the chain's first node and its output makes the site
  unprovable; writes before it (a StaticCache's ``index_copy_``) are seen by the op as by the original.
* **Masks and biases.** The kernels add any float ``attn_mask`` exactly per tile and hide False / -inf keys,
  so the rule is one for SDPA and eager code alike: an additive float tensor (0/-inf mask, ``finfo.min`` mask,
  or an arbitrary bias such as ALiBi) broadcastable to (B, Hq, L, N) is rewritten exactly. A bool or integer
  tensor *added* to the scores is a 0/1 bias in eager and is left alone. ``masked_fill``/``where`` hide keys
  only with -inf; a finite fill (``finfo.min``, -1e9) replaces scores, so a row it hides whole gives the mean
  of V, which the op does not reproduce: left alone.
* **Fully masked rows** (no key visible): the op gives 0, as SDPA and PyTorch's safe softmax do; a plain eager
  softmax gives NaN (``AttentionMatch.empty_rows = "nan"``; lower sets those rows to NaN when the mask can hide
  a whole row). A row whose keys all carry ``finfo.min`` keeps its keys tied (fp32 absorbs the scores) and gives
  the mean of V, as the original in fp32/fp64. In fp16/bf16 an eager chain rounds ``scores + finfo.min`` in that
  dtype, so an additive mask that is not provably 0/-inf is left alone there.
* **Post-softmax ops**: casts, inference dropout, and ``where(cond, 0, p)`` only when ``cond`` provably is "every
  score of the row is -inf" (``is_empty_row_guard``); a head-pruning ``where`` or ``softmax * c`` is left alone.
"""
from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn.functional as F

from attnopt.site import AttentionSite

from .mutation import MutationIndex

aten = torch.ops.aten


# ============================================================================================ the match
@dataclass
class AttentionMatch:
    """One attention site found in a graph.

    ``site`` is filled by ``passes.detect``. ``q`` is (B, Hq, L, D); ``k``/``v`` are (B, Hkv, N, D/Dv), the
    un-expanded cache when GQA comes through ``repeat_kv`` or ``repeat_interleave``. ``output`` is the node
    whose uses the rewritten op's (B, Hq, L, Dv) result replaces.
    """

    site: AttentionSite | None
    #: Node whose uses are replaced by the op's result.
    output: fx.Node
    q: fx.Node | None
    k: fx.Node | None
    v: fx.Node | None
    attn_mask: fx.Node | None = None
    #: Resolved softmax scale (SDPA's default is 1/sqrt(q.size(-1))); ``None`` until resolved.
    scale: float | None = None
    is_causal: bool = False
    #: Pattern name (a key of ``PATTERNS``); ``rewrite_counts`` counts under it.
    pattern: str = ""
    #: The node the pattern was anchored on: the SDPA call, or the softmax of an eager chain.
    anchor: fx.Node | None = None
    #: "mha", "enable_gqa", "repeat_kv" or "repeat_interleave".
    gqa_source: str = "mha"
    #: The mask is boolean with True = masked *out* (``masked_fill(mask, -inf)``): lower inserts ``logical_not``.
    mask_invert: bool = False
    #: Why the pattern cannot be rewritten (``None`` = the pattern itself is fine; detect adds shape rules).
    reason: str | None = None
    #: The nodes of an eager chain (scores matmul .. output), for reporting and tests.
    nodes: list[fx.Node] = field(default_factory=list)
    #: For tuple-returning aten variants: the fused node whose output 0 is ``output``.
    fused: fx.Node | None = None
    #: Run-time scalars that scale the scores: (node, is_div), the node a one-element tensor or a symbolic
    #: Python number (``.item()`` of a float attribute under ``dynamic=True``). ``lower`` folds them into q
    #: (``q * c`` / ``q / c``); ``scale`` holds only the constant part.
    scale_nodes: list[tuple[fx.Node, bool]] = field(default_factory=list)
    #: Permutations that turn ``q``/``k``/``v`` into the logical (B, H, L|N, D) tensors, when not the identity
    #: (e.g. a K kept as (B, N, H, D) and permuted in the graph); lower inserts the (free) permute views.
    perms: dict[str, list[int]] = field(default_factory=dict)
    #: What the original gives for a query row with no visible key (every score -inf): "zero" (SDPA, PyTorch's
    #: safe softmax, or the ``where(row_fully_masked, 0, p)`` guard) or "nan" (a plain softmax over -inf only).
    #: The op gives zeros; lower sets such rows to NaN for "nan" when the mask can hide a whole row.
    empty_rows: str = "zero"
    #: The mask's storage is written in place after the mask node (``lower`` then computes its ``valid_len`` at
    #: the site, not once right after the mask's producer).
    mask_written: bool = False


@dataclass(frozen=True)
class PatternInfo:
    """A pattern: its name, the eager function it comes from, and a one-line description."""

    name: str
    example: Callable[..., torch.Tensor]
    description: str


# ============================================================================================ node helpers
def meta_val(node: Any) -> Any:
    """The fake value of ``node`` ("val" in aten/export graphs, "example_value" in dynamo graphs), or None."""
    if not isinstance(node, fx.Node):
        return None
    val = node.meta.get("val")
    if val is None:
        val = node.meta.get("example_value")
    return val


def meta_shape(node: Any) -> tuple | None:
    val = meta_val(node)
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def meta_dtype(node: Any) -> torch.dtype | None:
    val = meta_val(node)
    return val.dtype if isinstance(val, torch.Tensor) else None


def is_aten_graph(gm: fx.GraphModule) -> bool:
    """True when the graph's calls are ``OpOverload``s (aot_autograd, make_fx, export), not torch-level."""
    for n in gm.graph.nodes:
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload):
            return True
    return False


def same_size(a: Any, b: Any) -> bool:
    """Sizes equal, comparing SymInts structurally (no guards)."""
    if a is None or b is None or len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if isinstance(x, int) and isinstance(y, int):
            if x != y:
                return False
        elif x is not y and str(x) != str(y):
            return False
    return True


def _sym_eq(x: Any, y: Any) -> bool:
    return same_size((x,), (y,))


def arg(node: fx.Node, pos: int, name: str, default: Any = None) -> Any:
    """Argument ``name`` of ``node``: from kwargs, else positional ``pos`` (``pos < 0`` = keyword-only)."""
    if name in node.kwargs:
        return node.kwargs[name]
    if 0 <= pos < len(node.args):
        return node.args[pos]
    return default


def schema_args(node: fx.Node) -> dict[str, Any]:
    """All arguments of an ``OpOverload`` call by schema name, with defaults filled in."""
    schema = node.target._schema
    out: dict[str, Any] = {}
    for i, a in enumerate(schema.arguments):
        if a.name in node.kwargs:
            out[a.name] = node.kwargs[a.name]
        elif i < len(node.args) and not a.kwarg_only:
            out[a.name] = node.args[i]
        elif a.has_default_value():
            out[a.name] = a.default_value
        else:
            out[a.name] = None
    return out


def is_metadata_assert(node: fx.Node) -> bool:
    """``aten._assert_tensor_metadata`` and friends: checks that export adds, with no users of their own."""
    name = getattr(node.target, "__name__", str(node.target))
    return node.op == "call_function" and "_assert_tensor_metadata" in name and not node.users


def _is_call(node: Any) -> bool:
    return isinstance(node, fx.Node) and node.op in ("call_function", "call_method")


def _method(node: fx.Node) -> str | None:
    return node.target if node.op == "call_method" else None


# Torch-level and aten-level spellings of the ops the patterns walk through. ``kind(node)`` folds them.
_KINDS: dict[Any, str] = {}


def _reg(kind: str, *targets: Any) -> None:
    for t in targets:
        _KINDS[t] = kind


_reg("matmul", torch.matmul, operator.matmul, aten.matmul)
_reg("bmm", torch.bmm, aten.bmm)
_reg("baddbmm", torch.baddbmm, aten.baddbmm)
_reg("einsum", torch.einsum, aten.einsum)
_reg("softmax", torch.softmax, F.softmax, torch.Tensor.softmax, torch._C._nn.softmax if hasattr(torch._C._nn, "softmax") else F.softmax,
     aten._softmax, aten.softmax, aten._safe_softmax)
_reg("mul", operator.mul, operator.imul, torch.mul, aten.mul)
_reg("div", operator.truediv, operator.itruediv, torch.div, torch.true_divide, aten.div)
_reg("add", operator.add, operator.iadd, torch.add, aten.add)
_reg("cast", aten._to_copy, aten.to, aten.type_as, torch.Tensor.to, torch.Tensor.type_as)
_reg("dropout", F.dropout, torch.dropout, aten.dropout)
_reg("train_dropout", aten.native_dropout, torch.nn.functional.alpha_dropout)
_reg("transpose", torch.transpose, aten.transpose, torch.swapaxes, torch.swapdims, aten.swapaxes, aten.swapdims)
_reg("permute", torch.permute, aten.permute)
_reg("expand", aten.expand)
_reg("view", aten.view, aten._unsafe_view, aten.reshape, torch.reshape, aten.alias)
_reg("clone", aten.clone, torch.clone, aten.contiguous if hasattr(aten, "contiguous") else aten.clone)
_reg("unsqueeze", torch.unsqueeze, aten.unsqueeze)
_reg("squeeze", torch.squeeze, aten.squeeze)
_reg("slice", aten.slice)
_reg("masked_fill", torch.masked_fill, aten.masked_fill)
_reg("where", torch.where, aten.where)
_reg("tanh", torch.tanh, aten.tanh, F.tanh)
_reg("repeat_interleave", torch.repeat_interleave, aten.repeat_interleave)
_reg("full_like", torch.full_like, torch.zeros_like, torch.empty_like, aten.full_like, aten.zeros_like, aten.empty_like)
_reg("sdpa", F.scaled_dot_product_attention, aten.scaled_dot_product_attention)

_METHOD_KINDS = {
    "matmul": "matmul", "__matmul__": "matmul", "bmm": "bmm", "softmax": "softmax", "mul": "mul", "mul_": "mul",
    "__mul__": "mul", "baddbmm": "baddbmm", "div": "div", "div_": "div", "__truediv__": "div", "add": "add", "add_": "add",
    "__add__": "add", "to": "cast", "type_as": "cast", "type": "cast", "float": "cast", "half": "cast", "bfloat16": "cast",
    "double": "cast", "transpose": "transpose", "swapaxes": "transpose", "permute": "permute",
    "expand": "expand", "expand_as": "expand", "view": "view", "reshape": "view", "contiguous": "clone",
    "clone": "clone", "unsqueeze": "unsqueeze", "squeeze": "squeeze", "masked_fill": "masked_fill", "tanh": "tanh",
    "repeat_interleave": "repeat_interleave",
}

_SDPA_FUSED: dict[Any, str] = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: "sdpa_flash_cpu",
    aten._scaled_dot_product_flash_attention.default: "sdpa_flash",
    aten._scaled_dot_product_efficient_attention.default: "sdpa_efficient",
    aten._scaled_dot_product_cudnn_attention.default: "sdpa_cudnn",
    aten._scaled_dot_product_attention_math.default: "sdpa_math",
    aten._scaled_dot_product_fused_attention_overrideable.default: "sdpa_overrideable",
}


def kind(node: Any) -> str | None:
    """The folded op kind of ``node`` ("matmul", "softmax", "mul", ...), or None."""
    if not _is_call(node):
        return None
    if node.op == "call_method":
        return _METHOD_KINDS.get(node.target)
    t = node.target
    if t is operator.getitem:
        return "getitem"
    k = _KINDS.get(t)
    if k is None and isinstance(t, torch._ops.OpOverload):
        k = _KINDS.get(t.overloadpacket)
    return k


def _self(node: fx.Node) -> Any:
    """The tensor an op/method acts on (first argument, or the ``input``/``self`` keyword)."""
    if node.args:
        return node.args[0]
    return node.kwargs.get("input", node.kwargs.get("self"))


def sym_constant(x: Any) -> float | None:
    """The value of a ``SymInt``/``SymFloat`` whose expression is a number, else None.

    Under ``dynamic=True`` dynamo passes Python float attributes (HF's ``self.scaling``) into the graph as 0-d
    float64 inputs read back with ``.item()``. When something needed the value (SDPA's ``scale`` argument does),
    the shape environment has specialised the symbol to a number and dynamo guards on it, so the number is as
    constant as a literal for this graph.
    """
    if isinstance(x, (torch.SymInt, torch.SymFloat)):
        expr = getattr(x.node, "expr", None)
        if expr is not None and getattr(expr, "is_number", False):
            try:
                return float(expr)
            except (TypeError, ValueError):  # e.g. a complex or infinite sympy number
                return None
    return None


def is_python_scalar(node: Any) -> bool:
    """Whether ``node`` produces a Python int/float (maybe symbolic: ``.item()`` of a 0-d input, SymInt
    arithmetic) rather than a tensor."""
    val = meta_val(node)
    return isinstance(val, (int, float, torch.SymInt, torch.SymFloat)) and not isinstance(val, bool)


def _number(x: Any) -> float | None:
    """``x`` as a Python float when it is a compile-time constant (number, or a ``scalar_tensor`` node, or a
    node whose fake value is a specialised symbolic number)."""
    if isinstance(x, bool):
        return None
    if isinstance(x, (int, float)):
        return float(x)
    if isinstance(x, fx.Node) and is_python_scalar(x):
        val = meta_val(x)
        return float(val) if isinstance(val, (int, float)) else sym_constant(val)
    if isinstance(x, fx.Node) and x.op == "call_function" and x.target in (aten.scalar_tensor.default,):
        return _number(x.args[0])
    if isinstance(x, fx.Node) and x.op == "call_function":
        # Constant-filled tensors: torch.zeros/ones/full (also aten.*), whose every entry is one number.
        name = _name(x)
        if name in ("tensor", "as_tensor", "scalar_tensor") and x.args and isinstance(x.args[0], (int, float)):
            return _number(x.args[0])  # torch.tensor(0.0)
        if name in ("zeros", "new_zeros", "zeros_like"):
            return 0.0
        if name in ("ones", "new_ones", "ones_like"):
            return 1.0
        if name in ("full", "new_full", "full_like"):
            return _number(arg(x, 1, "fill_value", None))
    return None


def _ndim(node: Any) -> int | None:
    s = meta_shape(node)
    return len(s) if s is not None else None


def _norm_dim(d: Any, ndim: int | None) -> Any:
    if isinstance(d, int) and d < 0 and ndim is not None:
        return d + ndim
    return d


def _is_noop(node: fx.Node) -> bool:
    """A node that returns its input's values with the same shape (clone, contiguous, no-op expand/view/cast)."""
    k = kind(node)
    src = _self(node)
    if not isinstance(src, fx.Node):
        return False
    if k == "clone":
        return True
    if k in ("expand", "view"):
        return same_size(meta_shape(node), meta_shape(src))
    if k == "cast":
        return meta_dtype(node) is not None and meta_dtype(node) == meta_dtype(src) and same_size(meta_shape(node), meta_shape(src))
    if k == "slice":
        dim, start, end = arg(node, 1, "dim", 0), arg(node, 2, "start", None), arg(node, 3, "end", None)
        return (start in (None, 0)) and same_size(meta_shape(node), meta_shape(src))
    if k == "getitem":
        idx = node.args[1] if len(node.args) > 1 else None
        if isinstance(idx, tuple) and all(isinstance(i, slice) and i == slice(None) for i in idx):
            return True
        if isinstance(idx, slice) and idx == slice(None):
            return True
    return False


# ============================================================================================ view walking
def skip_noops(node: Any) -> Any:
    while isinstance(node, fx.Node) and _is_noop(node):
        node = _self(node)
    return node


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


def unrepeat_kv(node: Any) -> tuple[Any, str | None]:
    """Undo a GQA head expansion of a 4-D K/V: returns (un-expanded node, "repeat_kv"|"repeat_interleave")
    or (node, None) when ``node`` is not such an expansion.

    Recognises ``x[:, :, None, :, :].expand(b, hkv, g, n, d).reshape(b, hkv * g, n, d)`` (torch level; at aten
    level ``unsqueeze -> expand -> clone -> view``) and ``repeat_interleave(g, dim=1)``.
    """
    out = skip_noops(node)
    s4 = meta_shape(out)
    if s4 is None or len(s4) != 4:
        return node, None
    k = kind(out)
    if k == "repeat_interleave":
        src = _self(out)
        reps = arg(out, 1, "repeats", None)
        dim = _norm_dim(arg(out, 2, "dim", None), 4)
        ss = meta_shape(src)
        if isinstance(reps, int) and dim == 1 and ss is not None and len(ss) == 4 and _sym_eq(ss[1] * reps, s4[1]):
            return src, "repeat_interleave"
        return node, None
    if k != "view":
        return node, None
    cur = skip_noops(_self(out))
    s5 = meta_shape(cur)
    if s5 is None or len(s5) != 5 or kind(cur) != "expand":
        return node, None
    src = skip_noops(_self(cur))
    ss = meta_shape(src)
    if ss is None or len(ss) != 5 or ss[2] != 1:
        return node, None
    # (B, Hkv, 1, N, D) from (B, Hkv, N, D): unsqueeze(2), x[:, :, None], or a view.
    ks = kind(src)
    base = None
    if ks == "unsqueeze" and _norm_dim(arg(src, 1, "dim", None), 5) == 2:
        base = _self(src)
    elif ks == "getitem":
        idx = src.args[1]
        if isinstance(idx, tuple) and len(idx) >= 3 and idx[0] == slice(None) and idx[1] == slice(None) and idx[2] is None \
                and all(i == slice(None) for i in idx[3:]):
            base = src.args[0]
    elif ks == "view":
        base = _self(src)
    base = skip_noops(base)
    bs = meta_shape(base)
    if bs is None or len(bs) != 4 or not same_size((bs[0], bs[1], bs[2], bs[3]), (s5[0], s5[1], s5[3], s5[4])):
        return node, None
    if not same_size((s5[0], s5[1] * s5[2], s5[3], s5[4]), s4):
        return node, None
    return base, "repeat_kv"


# ============================================================================================ SDPA patterns
def _sdpa_torch_args(node: fx.Node) -> dict[str, Any]:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    defaults = (None, None, None, None, 0.0, False, None, False)
    return {n: arg(node, i, n, d) for i, (n, d) in enumerate(zip(names, defaults))}


def _is_sdpa(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    t = node.target
    return t is F.scaled_dot_product_attention or t is aten.scaled_dot_product_attention.default


def _resolve_common(m: AttentionMatch, q: Any, k: Any, v: Any, scale: Any, dropout_p: Any, enable_gqa: bool) -> None:
    """Fill q/k/v (un-expanding GQA), scale and the dropout reason of an SDPA-like match."""
    m.q = q
    if enable_gqa and meta_shape(k) and meta_shape(q) and not _sym_eq(meta_shape(k)[1], meta_shape(q)[1]):
        m.k, m.v, m.gqa_source = k, v, "enable_gqa"
    else:
        k0, ks = unrepeat_kv(k)
        v0, vs = unrepeat_kv(v)
        if ks is not None and ks == vs and _sym_eq(meta_shape(k0)[1], meta_shape(v0)[1]):
            m.k, m.v, m.gqa_source = k0, v0, ks
        else:
            m.k, m.v = k, v
            if meta_shape(k) and meta_shape(q) and not _sym_eq(meta_shape(k)[1], meta_shape(q)[1]):
                m.gqa_source = "enable_gqa"  # fused aten variants take un-expanded K/V directly
    if isinstance(dropout_p, fx.Node):
        m.reason = "dropout_p is a run-time value (training-mode dropout?)"
    elif dropout_p not in (None, 0, 0.0):
        m.reason = f"training-mode dropout (dropout_p={dropout_p})"
    if scale is None:
        s = meta_shape(q)
        m.scale = 1.0 / math.sqrt(s[-1]) if s and isinstance(s[-1], int) else None
    else:
        m.scale = _number(scale)
        if m.scale is None and is_python_scalar(scale):
            # A symbolic Python float (dynamic=True): passed on at run time, folded into q by lower.
            m.scale, m.scale_nodes = 1.0, [(scale, False)]
        if m.scale is None and m.reason is None:
            m.reason = "the softmax scale is a run-time value of unknown type (no number in node.meta)"


def match_sdpa(node: fx.Node) -> AttentionMatch | None:
    """``F.scaled_dot_product_attention`` / ``aten.scaled_dot_product_attention.default``."""
    if not _is_sdpa(node):
        return None
    a = _sdpa_torch_args(node) if node.target is F.scaled_dot_product_attention else schema_args(node)
    m = AttentionMatch(site=None, output=node, q=None, k=None, v=None, pattern="sdpa", anchor=node)
    m.attn_mask = a.get("attn_mask")
    ic = a.get("is_causal")
    if isinstance(ic, fx.Node):
        m.reason = "is_causal is a run-time value"
    m.is_causal = bool(ic) if not isinstance(ic, fx.Node) else False
    _resolve_common(m, a["query"], a["key"], a["value"], a.get("scale"), a.get("dropout_p"), bool(a.get("enable_gqa")))
    return m


def match_sdpa_fused(node: fx.Node) -> AttentionMatch | None:
    """The tuple-returning aten SDPA variants (flash / flash_for_cpu / efficient / cudnn / math / overrideable)."""
    if node.op != "call_function" or node.target not in _SDPA_FUSED:
        return None
    a = schema_args(node)
    pattern = _SDPA_FUSED[node.target]
    out0 = [u for u in node.users if u.op == "call_function" and u.target is operator.getitem and u.args[1] == 0]
    others = sorted({u.args[1] if u.target is operator.getitem else -1 for u in node.users
                     if u.users or u.target is not operator.getitem} - {0})
    if not out0:
        return None  # output unused: nothing to rewrite and nothing to report
    m = AttentionMatch(site=None, output=out0[0], q=None, k=None, v=None, pattern=pattern, anchor=node, fused=node)
    m.attn_mask = a.get("attn_mask", a.get("attn_bias"))
    m.is_causal = bool(a.get("is_causal"))
    _resolve_common(m, a["query"], a["key"], a["value"], a.get("scale"), a.get("dropout_p"), bool(a.get("enable_gqa")))
    if pattern == "sdpa_math" and a.get("dropout_mask") is not None:
        m.reason = m.reason or "training-mode dropout (dropout_mask given)"
    if others and m.reason is None:
        what = "the attention weights" if pattern == "sdpa_math" else "the log-sum-exp"
        m.reason = f"{what} (output {others[0]} of {node.target.name()}) is used elsewhere, e.g. by a backward pass"
    # Unused getitems of the other outputs die with the fused node.
    m.nodes = [u for u in node.users if u.target is operator.getitem and not u.users and u.args[1] != 0] + out0[1:]
    return m


# ============================================================================================ eager chains
_MASK_FILL_MIN = -1e4  # a masked_fill / where value at or below this (or -inf) is a mask, not a bias


def matmul_behind(node: Any) -> tuple[fx.Node, list] | None:
    """(matmul/bmm/einsum, layout path from it to ``node``) when ``node`` is a matmul result seen through
    layout ops only (aten: ``view(bmm(...))``), else None."""
    if not isinstance(node, fx.Node):
        return None
    path = layout_path(node)
    if kind(path[-1]) in ("matmul", "bmm", "einsum"):
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


def _binary(node: fx.Node) -> tuple[Any, Any]:
    a = node.args[0] if node.args else node.kwargs.get("input", node.kwargs.get("self"))
    b = node.args[1] if len(node.args) > 1 else node.kwargs.get("other")
    return a, b


#: One scale factor of an eager chain: (constant value, or None for a run-time 0-d tensor; that tensor; is_div).
Factor = tuple


def _scale_factor(node: fx.Node) -> tuple[Any, Factor] | None:
    """For ``x * c``, ``c * x`` or ``x / c`` with ``c`` a scalar (a constant, a run-time tensor of one
    element, or a symbolic Python number): ``(x, (value or None, c, is_div))``; None when ``node`` is not such
    a scaling."""
    k = kind(node)
    if k not in ("mul", "div"):
        return None
    a, b = _binary(node)
    if node.kwargs.get("rounding_mode") is not None:
        return None

    def scalar_like(c: Any) -> bool:
        if not isinstance(c, fx.Node):
            return isinstance(c, (int, float)) and not isinstance(c, bool)
        if is_python_scalar(c):
            return True
        cs = meta_shape(c)
        return cs is not None and all(isinstance(d, int) and d == 1 for d in cs) and \
            (meta_dtype(c) is None or meta_dtype(c).is_floating_point)

    if k == "mul":
        for x, c in ((a, b), (b, a)):
            if isinstance(x, fx.Node) and (_ndim(x) or 0) >= 2 and scalar_like(c):
                return x, (_number(c), c, False)
        return None
    if isinstance(a, fx.Node) and (_ndim(a) or 0) >= 2 and scalar_like(b):
        n = _number(b)
        if n == 0:
            return None
        return a, ((1.0 / n) if n is not None else None, b, True)
    return None


def mask_value_is_masking(value: Any) -> bool:
    """Whether a fill value hides a position: -inf, or a very negative number such as ``finfo.min``."""
    v = _number(value)
    return v is not None and (v == -math.inf or v <= _MASK_FILL_MIN)


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
    value product (``bhqk,bhkd->bhqd``). Returns (groups of operand 0, groups of operand 1, operands, reason)."""
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
    ops = list(_binary(mm))
    nd = _ndim(mm)
    if k == "bmm" or nd == 3:
        g0 = [[0, 1], [2], [3]]
        g1 = [[0, 1], [3], [2]] if which == "qk" else [[0, 1], [2], [3]]
        return g0, g1, ops, None
    if nd == 4:
        return _ID, ([[0], [1], [3], [2]] if which == "qk" else _ID), ops, None
    return None, None, ops, f"{nd}-D attention (expects (B, H, L, D) tensors)"


def _softmax_dim_ok(node: fx.Node) -> bool:
    src = _self(node)
    nd = _ndim(src)
    d = arg(node, 1, "dim", None)
    return nd is not None and _norm_dim(d, nd) == nd - 1


def _forward_to_pv(sm: fx.Node) -> tuple[fx.Node | None, str | None, list[fx.Node], bool]:
    """Follow the softmax output through casts, inference dropout, the safe-softmax guard and layout ops to the
    value product (whose first operand it must be). Returns (matmul/bmm/einsum node, reason, chain nodes, whether
    the fully-masked-row guard was passed)."""
    pv, reason, chain, guarded = _forward_walk(sm)
    return pv, reason, chain, guarded


def _forward_walk(sm: fx.Node):
    cur = sm
    chain: list[fx.Node] = []
    reason = None
    guarded = False
    for _ in range(16):
        users = [u for u in cur.users if kind(u) != "full_like" and not is_metadata_assert(u)]
        if len(users) != 1:
            if not users:
                return None, None, chain, guarded
            # Several consumers: the probabilities escape (e.g. output_attentions) unless one is the matmul.
            mms = [u for u in users if kind(u) in ("matmul", "bmm", "einsum") or _is_layout_op(u)]
            if len(mms) != 1:
                return None, None, chain, guarded
            reason = reason or "the attention probabilities are also used elsewhere (output_attentions?)"
            users = mms
        u = users[0]
        k = kind(u)
        chain.append(u)
        if k in ("matmul", "bmm", "einsum"):
            first = _einsum_operands(u)[1][0] if k == "einsum" else _binary(u)[0]
            if first is not cur:
                return None, None, chain, guarded  # probabilities on the right: not attention as we know it
            return u, reason, chain, guarded
        if _is_layout_op(u) or k == "cast":
            cur = u
            continue
        if k == "dropout":
            p = arg(u, 1, "p", 0.5)
            training = arg(u, 2, "train", True) if isinstance(u.target, torch._ops.OpOverload) else arg(u, 2, "training", True)
            if isinstance(p, fx.Node) or isinstance(training, fx.Node):
                reason = reason or "dropout with a run-time probability or training flag"
            elif training and p != 0:
                reason = reason or f"training-mode dropout (p={p})"
            cur = u
            continue
        if k == "train_dropout":
            reason = reason or "training-mode dropout"
            outs = ([x for x in u.users if x.target is operator.getitem and x.args[1] == 0]
                    if u.target is aten.native_dropout.default else [u])
            if not outs:
                return None, None, chain, guarded
            cur = outs[0]
            continue
        if k == "where":
            # PyTorch's safe softmax: where(row_fully_masked, 0, p), with row_fully_masked provably "every score of
            # this row is -inf" (the op gives 0 there too). Any other condition (a head-pruning mask, ...) is not.
            c, a, b = (tuple(u.args) + (None, None, None))[:3]
            zero = _number(a) == 0.0 or (isinstance(a, fx.Node) and kind(a) == "full_like"
                                         and _number(arg(a, 1, "fill_value", 0)) == 0.0)
            if b is cur and zero and is_empty_row_guard(c, _self(sm)):
                guarded = True
                cur = u
                continue
            reason = reason or "a where() on the attention probabilities that is not PyTorch's fully-masked-row guard"
            if b is not cur:
                return None, None, chain, guarded
            cur = u
            continue
        if _scale_factor(u) is not None and _scale_factor(u)[0] is cur:
            reason = reason or "the attention probabilities are scaled (softmax * c) before the value product"
            cur = u
            continue
        return None, None, chain, guarded
    return None, None, chain, guarded


def _neginf_test(node: Any) -> tuple[fx.Node, bool] | None:
    """``(x, True)`` for ``x == -inf`` / ``isneginf(x)``; ``(x, False)`` for ``x != -inf``; else None."""
    if not _is_call(node):
        return None
    name = _bare_name(node)
    if name == "isneginf":
        return (_self(node), True) if isinstance(_self(node), fx.Node) else None
    if name in ("eq", "ne"):
        a, b = _binary(node)
        for x, c in ((a, b), (b, a)):
            if isinstance(x, fx.Node) and _number(c) == -math.inf:
                return x, name == "eq"
    return None


def is_empty_row_guard(cond: Any, scores: Any) -> bool:
    """Whether the boolean ``cond`` provably is "every entry of this row of ``scores`` is -inf", reduced over the
    last dim with keepdim: ``all(scores == -inf, -1, keepdim=True)`` or its negated forms, as PyTorch's safe
    softmax decomposition writes it (``logical_not(any(logical_not(eq(x, -inf)), -1, True))``)."""
    negate = False
    cur = cond
    for _ in range(8):  # peel negations around the reduction
        if _is_call(cur) and _bare_name(cur) in ("logical_not", "bitwise_not", "invert"):
            negate, cur = not negate, _self(cur)
            continue
        break
    if not _is_call(cur) or _bare_name(cur) not in ("all", "any"):
        return False
    red = _bare_name(cur)
    nd = _ndim(_self(cur))
    dim = arg(cur, 1, "dim", None)
    if isinstance(dim, (list, tuple)) and len(dim) == 1:
        dim = dim[0]
    keepdim = arg(cur, 2, "keepdim", False)
    if nd is None or _norm_dim(dim, nd) != nd - 1 or keepdim is not True:
        return False
    inner = _self(cur)
    pos = True
    for _ in range(8):
        if _is_call(inner) and _bare_name(inner) in ("logical_not", "bitwise_not", "invert"):
            pos, inner = not pos, _self(inner)
            continue
        break
    test = _neginf_test(inner)
    if test is None or skip_noops(test[0]) is not skip_noops(scores):
        return False
    pos = pos == test[1]  # the reduced predicate is (x == -inf) when pos, else (x != -inf)
    # all(x == -inf), or not any(x != -inf); all(x != -inf) and any(x == -inf) are other conditions
    return (red == "all" and pos and not negate) or (red == "any" and not pos and negate)


def _sizes_of(x: fx.Node, perm: list) -> tuple:
    s = meta_shape(x)
    return tuple(s[i] for i in perm)


def _mm_dims(mm: fx.Node) -> Dims:
    return [(0, 1), (2,), (3,)] if (kind(mm) == "bmm" or _ndim(mm) == 3) else [(0,), (1,), (2,), (3,)]


def match_eager(sm: fx.Node, writes: MutationIndex | None = None) -> AttentionMatch | None:
    """An eager attention chain anchored on its softmax. Returns None when ``sm`` is not attention's softmax
    (no score matmul before it, or no value matmul after it)."""
    if kind(sm) != "softmax" or not _softmax_dim_ok(sm):
        return None
    # -------- forward: probabilities -> value matmul
    pv, reason, fchain, guarded = _forward_to_pv(sm)
    if pv is None:
        return None
    # -------- backward: scores -> softmax
    reasons: list[str] = []
    if reason:
        reasons.append(reason)
    factors: list[Factor] = []
    masks: list[tuple[fx.Node, bool]] = []  # (mask node, invert)
    chain: list[fx.Node] = [sm]
    cur = _self(sm)
    mm = None
    spath: list = []
    for _ in range(16):
        if not isinstance(cur, fx.Node):
            break
        mb = matmul_behind(cur)
        if mb is not None:
            mm, spath = mb
            break
        chain.append(cur)
        k = kind(cur)
        if k == "baddbmm":
            # Bloom: baddbmm(alibi, q, k^T, beta, alpha) folds the bias into the score product; not matched as
            # attention's operands, so reported rather than rewritten.
            m = AttentionMatch(site=None, output=pv, q=None, k=None, v=None, pattern="eager_baddbmm", anchor=sm)
            m.reason = "Bloom-style baddbmm scores (bias and scale folded into the score product): not matched"
            m.nodes = list(reversed(chain)) + fchain
            return m
        if _is_noop(cur) or k == "cast":
            cur = _self(cur)
            continue
        sf = _scale_factor(cur)
        if sf is not None:
            cur, f = sf
            factors.append(f)
            continue
        if k == "add":
            a, b = _binary(cur)
            if cur.kwargs.get("alpha", 1) != 1:
                reasons.append("add with alpha")
            if not isinstance(a, fx.Node) or not isinstance(b, fx.Node):
                cur = a if isinstance(a, fx.Node) else b  # + constant: softmax-invariant
                continue
            scores, other = (a, b) if _leads_to_matmul(a) else (b, a)
            if factors:
                reasons.append("the scores are scaled after the mask is added")
            odt = meta_dtype(other)
            if odt is not None and not odt.is_floating_point:
                reasons.append(f"a {_dtype_name(odt)} tensor added to the scores (a 0/1 bias in eager, not a mask)")
            elif meta_dtype(cur) in (torch.float16, torch.bfloat16) and not additive_is_zero_or_neginf(other, writes):
                reasons.append(f"an additive mask or bias summed with the scores in {_dtype_name(meta_dtype(cur))}: "
                               "where it hides a whole row with large finite values (finfo.min), the original's "
                               "result depends on that dtype's rounding and cannot be reproduced")
            else:
                masks.append((other, False))  # any float bias is applied exactly per tile (see ``classify_additive``)
            cur = scores
            continue
        if k == "masked_fill":
            x, cond = _self(cur), arg(cur, 1, "mask", None)
            value = arg(cur, 2, "value", None)
            if _number(value) == -math.inf:
                masks.append((cond, True))
                if factors:
                    reasons.append("the scores are scaled after the mask is applied")
            elif mask_value_is_masking(value):
                reasons.append(f"masked_fill with the finite value {value!r}: a fully masked row gives the mean of V "
                               "in the original, which the rewrite cannot reproduce")
            else:
                reasons.append(f"masked_fill with value {value!r} (not a masking value)")
            cur = x
            continue
        if k == "where":
            c, a, b = (list(cur.args) + [None, None, None])[:3]
            if isinstance(a, fx.Node) and _leads_to_matmul(a) and _number(b) == -math.inf:
                masks.append((c, False))
                cur = a
                continue
            if isinstance(b, fx.Node) and _leads_to_matmul(b) and _number(a) == -math.inf:
                masks.append((c, True))
                cur = b
                continue
            if mask_value_is_masking(a) or mask_value_is_masking(b):
                reasons.append("where() with a finite masking value: a fully masked row gives the mean of V in the "
                               "original, which the rewrite cannot reproduce")
                cur = a if isinstance(a, fx.Node) and _leads_to_matmul(a) else b
                continue
            reasons.append("a where() between the scores and the softmax that is not a mask")
            cur = a if isinstance(a, fx.Node) and _leads_to_matmul(a) else b
            continue
        if k == "tanh":
            reasons.append("logit softcapping (tanh between the scores and the softmax)")
            cur = _self(cur)
            continue
        target = cur.target if cur.op == "call_function" else f".{cur.target}()"
        reasons.append(f"unrecognised op {getattr(target, '__name__', target)} between the scores and the softmax")
        cur = _self(cur)
    if mm is None:
        return None
    # -------- operands
    pattern = {"matmul": "eager_matmul", "einsum": "eager_einsum", "bmm": "eager_bmm"}[kind(mm)]
    scores = spath[0] if spath else mm
    m = AttentionMatch(site=None, output=pv, q=None, k=None, v=None, pattern=pattern, anchor=sm)
    m.nodes = [mm] + list(reversed(spath)) + list(reversed(chain)) + fchain

    def fail(why: str) -> AttentionMatch:
        m.reason = reasons[0] if reasons else why
        return m

    g0, g1, ops, why = _operand_groups(mm, "qk")
    if why is not None:
        return fail(why)
    ss = meta_shape(scores)
    if ss is None or len(ss) != 4:
        return fail("the attention scores are not a 4-D (B, H, L, N) tensor")
    B, H, L, N = ss
    d_q = meta_shape(ops[0])[-1] if meta_shape(ops[0]) else None
    rq = resolve_operand(ops[0], g0, (B, H, L, d_q), allow_scale=True)
    rk = resolve_operand(ops[1], g1, (B, H, N, d_q), allow_scale=True)
    if rq is None or rk is None:
        return fail("the score product's operands are not (B, H, L, D) / (B, H, N, D) tensors in a recognised layout")
    (xq, pq, fq), (xk, pk, fk) = rq, rk
    factors = fq + fk + factors
    lab = _sizes_of(xq, pq)
    sizes = {0: lab[0], 1: lab[1], 2: L, 3: N}
    dims: Dims | None = _mm_dims(mm)
    for n in reversed(spath):
        dims = _simulate(n, dims, sizes) if dims is not None else None
    if dims is None or _assign_roles(dims, sizes, _ID, (B, H, L, N)) != [0, 1, 2, 3]:
        return fail("the attention scores are not laid out as (B, H, L, N)")
    g0, g1, ops, why = _operand_groups(pv, "pv")
    if why is not None:
        return fail(why)
    dv = meta_shape(pv)[-1] if meta_shape(pv) else None
    rp = resolve_operand(ops[0], g0, (B, H, L, N))
    rv = resolve_operand(ops[1], g1, (B, H, N, dv))
    if rp is None or rp[1] != [0, 1, 2, 3] or rv is None:
        return fail("the value product's operands are not (B, H, L, N) / (B, H, N, Dv) tensors in a recognised layout")
    xv, pvm, _ = rv
    out = follow_output(pv, _mm_dims(pv), {0: B, 1: H, 2: L, 3: dv})
    if out is None:
        return fail("the attention output is not laid out as (B, H, L, Dv)")
    m.output = out
    m.q = xq
    if pq != [0, 1, 2, 3]:
        m.perms["q"] = pq
    k0, ks = unrepeat_kv(xk) if pk == [0, 1, 2, 3] else (xk, None)
    v0, vs = unrepeat_kv(xv) if pvm == [0, 1, 2, 3] else (xv, None)
    if ks is not None and ks == vs and _sym_eq(meta_shape(k0)[1], meta_shape(v0)[1]):
        m.k, m.v, m.gqa_source = k0, v0, ks
    else:
        m.k, m.v = xk, xv
        if pk != [0, 1, 2, 3]:
            m.perms["k"] = pk
        if pvm != [0, 1, 2, 3]:
            m.perms["v"] = pvm
    # scale: constants multiply into ``scale``; run-time scalar tensors are folded into q by lower.
    m.scale = math.prod(f[0] for f in factors if f[0] is not None)
    m.scale_nodes = [(f[1], f[2]) for f in factors if f[0] is None]
    # mask
    plain_softmax = not guarded and _name(sm) != "_safe_softmax"  # gives NaN for a row of -inf scores
    if len(masks) > 1:
        reasons.append("more than one mask between the scores and the softmax")
    elif masks:
        node, invert = masks[0]
        if meta_dtype(node) is not None and meta_dtype(node) != torch.bool and invert:
            reasons.append("masked_fill with a non-boolean mask")
        m.attn_mask, m.mask_invert = node, invert
        if plain_softmax and may_hide_whole_rows(node, writes):
            m.empty_rows = "nan"
    for r in reasons:
        m.reason = m.reason or r
    return m


# ============================================================================================ mask analysis
_MASK_SOURCES = ("placeholder", "get_attr")
_BIAS = "an additive float bias that is not a 0/-inf mask (ALiBi-style position bias)"


def _const_value(x: Any) -> float | None:
    """Like ``_number``, but also reads one-element constant tensors (``get_attr``, e.g. aot's lifted
    ``torch.tensor(0.0)``). Only for classifying masks: the mask tensor itself still flows at run time."""
    n = _number(x)
    if n is not None or not isinstance(x, fx.Node):
        return n
    if x.op == "call_function" and _name(x) in ("lift_fresh_copy", "lift_fresh", "detach", "clone", "_to_copy"):
        return _const_value(_self(x))
    if x.op == "get_attr":
        obj = x.graph.owning_module
        try:
            for part in str(x.target).split("."):
                obj = getattr(obj, part)
        except AttributeError:
            return None
        if isinstance(obj, torch.Tensor) and obj.numel() == 1 and obj.device.type != "meta" \
                and not isinstance(obj, torch._subclasses.FakeTensor):
            from torch._subclasses.fake_tensor import unset_fake_temporarily

            with unset_fake_temporarily():  # aot compilers run under the fake mode
                return float(obj.item())
    return None


def _masking_const(x: Any) -> bool:
    v = _const_value(x)
    return v is not None and (v == -math.inf or v <= _MASK_FILL_MIN)


def classify_additive(node: Any, depth: int = 12) -> str:
    """Classify a float tensor added to the scores: "mask" (0 / -inf / very negative entries, built by a
    boolean select or fill, or a graph input we must take as given) or a reason string naming a bias."""
    cur = node
    for _ in range(depth):
        if not isinstance(cur, fx.Node):
            return "mask" if _number(cur) is not None else _BIAS
        if cur.op in _MASK_SOURCES:
            return "mask"
        k = kind(cur)
        if _is_noop(cur) or k in ("view", "expand", "slice", "getitem", "clone", "unsqueeze", "cast"):
            if k == "cast" and meta_dtype(_self(cur)) == torch.bool:
                return _BIAS  # bool -> float gives 0/1, a bias
            cur = _self(cur)
            continue
        if k == "where":
            c, a, b = (list(cur.args) + [None, None, None])[:3]
            va, vb = _const_value(a), _const_value(b)
            if (va == 0.0 and _masking_const(b)) or (vb == 0.0 and _masking_const(a)):
                return "mask"
            if va is not None and va == 0.0 and isinstance(b, fx.Node):
                cur = b
                continue
            if vb is not None and vb == 0.0 and isinstance(a, fx.Node):
                cur = a
                continue
            return _BIAS
        if k == "masked_fill":
            if _masking_const(arg(cur, 2, "value", None)):
                base = _self(cur)
                if _const_value(base) == 0.0:
                    return "mask"
                cur = base
                continue
            return _BIAS
        if k == "mul":
            a, b = _binary(cur)
            if _masking_const(a) or _masking_const(b):
                return "mask"  # (1 - m) * finfo.min
            return _BIAS
        if k == "add":
            a, b = _binary(cur)
            ca = classify_additive(a, depth - 1) if isinstance(a, fx.Node) else "mask"
            cb = classify_additive(b, depth - 1) if isinstance(b, fx.Node) else "mask"
            return "mask" if ca == cb == "mask" else _BIAS
        v = _const_value(cur)
        if v is not None and (v == 0.0 or _masking_const(cur)):
            return "mask"
        return _BIAS
    return _BIAS


def additive_values(node: Any, writes: MutationIndex | None = None, depth: int = 12) -> frozenset | None:
    """The values an additive mask can hold when the graph proves them (a number, ``where(c, a, b)`` or
    ``masked_fill(x, c, v)`` of numbers, through layout ops and casts that keep 0 and -inf), else None. A tensor
    written in place anywhere in the graph (``writes``) proves nothing."""
    cur = node
    for _ in range(depth):
        if writes is not None and writes.written(cur):
            return None
        v = _const_value(cur)
        if v is not None:
            return frozenset({v})
        if not isinstance(cur, fx.Node):
            return None
        k = kind(cur)
        if k == "cast":
            return _zero_neginf(additive_values(_self(cur), writes, depth - 1))  # a narrowing cast may round finite values
        if _is_noop(cur) or k in ("view", "expand", "slice", "getitem", "clone", "unsqueeze", "squeeze", "permute",
                                  "transpose"):
            cur = _self(cur)
            continue
        if k == "where":
            c, a, b = (list(cur.args) + [None, None, None])[:3]
            va, vb = additive_values(a, writes, depth - 1), additive_values(b, writes, depth - 1)
            return va | vb if va is not None and vb is not None else None
        if k == "masked_fill":
            base, value = additive_values(_self(cur), writes, depth - 1), _const_value(arg(cur, 2, "value", None))
            return base | {value} if base is not None and value is not None else None
        return None
    return None


def _zero_neginf(values: frozenset | None) -> frozenset | None:
    return values if values is not None and values <= {0.0, -math.inf} else None


def additive_is_zero_or_neginf(node: Any, writes: MutationIndex | None = None) -> bool:
    """Whether an additive mask provably holds only 0 and -inf (it hides keys, and adds nothing else)."""
    return _zero_neginf(additive_values(node, writes)) is not None


def may_hide_whole_rows(mask: Any, writes: MutationIndex | None = None) -> bool:
    """Whether a mask may leave a query row with no visible key: a boolean mask may; an additive one only when it
    can hold -inf (``where(c, 0, finfo.min)`` cannot: its rows keep every key at a finite score)."""
    if not isinstance(mask, fx.Node) or meta_dtype(mask) == torch.bool:
        return True
    values = additive_values(mask, writes)
    return values is None or -math.inf in values


def _dtype_name(dt: Any) -> str:
    return str(dt).removeprefix("torch.") if dt is not None else "unknown"


#: Comparison ops (names with underscores stripped: ``operator.le``, ``Tensor.__le__``, ``aten.le``).
_ORDER_CMP = ("lt", "le", "gt", "ge")
_ANY_CMP = _ORDER_CMP + ("eq", "ne")
_AND_NAMES = ("and", "iand", "bitwise_and", "logical_and")
_POSITION_SOURCES = ("arange", "iota")
#: Dtypes a cast of key positions may produce without breaking their order (no wrap-around, no bool).
_ORDER_KEEPING = (torch.int64, torch.float64, torch.float32)


def _name(node: fx.Node) -> str:
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return t.overloadpacket.__name__
    return t if isinstance(t, str) else getattr(t, "__name__", str(t))


def _bare_name(node: Any) -> str:
    """``_name`` without leading/trailing underscores (``__le__`` -> ``le``, ``and_`` -> ``and``)."""
    return _name(node).strip("_") if _is_call(node) else ""


def mask_provenance(node: fx.Node, limit: int = 200) -> set[str]:
    """Names of the ops that produce ``node`` (a breadth-first walk over its inputs, at most ``limit`` nodes)."""
    seen: set[fx.Node] = set()
    names: set[str] = set()
    todo = [node]
    while todo and len(seen) < limit:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op in ("placeholder", "get_attr"):
            names.add(n.op)
            continue
        if n.op not in ("call_function", "call_method"):
            continue
        names.add(_name(n))
        todo.extend(n.all_input_nodes)
    return names


def _last_dim(x: Any) -> Any:
    s = meta_shape(x)
    return s[-1] if s else None


def _same_along_keys(x: Any) -> bool:
    """Whether ``x`` has one value per row, the same for every key: a number, or a tensor whose last dim is 1."""
    if isinstance(x, (int, float, torch.SymInt, torch.SymFloat)) and not isinstance(x, bool):
        return True
    if not isinstance(x, fx.Node):
        return False
    s = meta_shape(x)
    if s is None:
        return is_python_scalar(x)
    return len(s) == 0 or _is_one(s[-1])


def _key_positions(node: Any, depth: int = 16) -> bool:
    """Whether ``node[..., j] == j + offset`` for an offset that is the same for every key ``j``: an
    ``arange`` (step 1) plus such offsets, moved into place by unsqueeze / None-indexing / views / expands /
    order-keeping casts that all keep the last dim. Such values increase along the last dim."""
    n = _last_dim(node)
    if n is None:
        return False
    cur = node
    for _ in range(depth):
        if not _is_call(cur) or not same_size((_last_dim(cur),), (n,)):
            return False
        if _bare_name(cur) in _POSITION_SOURCES:
            step = cur.kwargs.get("step", cur.args[2] if len(cur.args) > 2 and _bare_name(cur) == "arange" else 1)
            return len(meta_shape(cur)) == 1 and not isinstance(step, fx.Node) and step == 1
        k = kind(cur)
        if k == "add" and cur.kwargs.get("alpha", 1) == 1:
            a, b = _binary(cur)
            if _same_along_keys(b):
                cur = a
            elif _same_along_keys(a):
                cur = b
            else:
                return False
            continue
        if k == "cast":
            src_dt, dt = meta_dtype(_self(cur)), meta_dtype(cur)
            if dt != src_dt and dt not in _ORDER_KEEPING:
                return False
            cur = _self(cur)
            continue
        if k in ("unsqueeze", "expand", "view", "clone") or _is_noop(cur) or _getitem_index(cur) is not None:
            cur = _self(cur)
            continue
        return False
    return False


def _window_of(bound: Any, strict: bool) -> int | None:
    """``w`` (keys attended per row) when a lower bound ``key > bound`` (``strict``) or ``key >= bound`` is
    ``query - c`` with a constant ``c`` (Hugging Face's ``sliding_window_overlay``: ``kv > q - w``)."""
    cur = bound
    for _ in range(8):
        if not isinstance(cur, fx.Node) or not (_is_noop(cur) or kind(cur) in ("unsqueeze", "expand", "view", "cast")
                                                or _getitem_index(cur) is not None):
            break
        cur = _self(cur)
    if not _is_call(cur):
        return None
    name = _bare_name(cur)
    a, b = _binary(cur)
    c = _number(b) if isinstance(a, fx.Node) else None
    if name == "sub" and c is not None:
        w = c
    elif kind(cur) == "add" and c is not None:
        w = -c
    else:
        return None
    if w != int(w) or w <= 0:
        return None
    return int(w) if strict else int(w) + 1


@dataclass(frozen=True)
class MaskForm:
    """What a boolean mask provably is: the AND of bounds on the key position against per-row values (the
    query positions) and of terms that compare no positions (padding lookups, inputs, constants).

    ``upper``: a term ``key <= v`` or ``key < v`` (causal / valid length: every row keeps a prefix of the keys).
    ``lower``: a term ``key > v`` or ``key >= v`` (the start of a band). ``window``: the keys a row keeps when
    that term is ``key > query - w`` (a sliding window), else None.
    """

    upper: bool = False
    lower: bool = False
    window: int | None = None

    def __and__(self, other: "MaskForm") -> "MaskForm":
        return MaskForm(self.upper or other.upper, self.lower or other.lower, self.window or other.window)

    @property
    def sliding_window(self) -> bool:
        return self.upper and self.lower


def _compares_positions(node: fx.Node, limit: int = 200) -> bool:
    """Whether any comparison that produces ``node`` involves positions from ``arange`` (conservatively True when
    the walk is cut off)."""
    seen: set[fx.Node] = set()
    todo = [node]
    while todo:
        if len(seen) >= limit:
            return True
        n = todo.pop()
        if n in seen or not isinstance(n, fx.Node):
            continue
        seen.add(n)
        if _is_call(n) and _bare_name(n) in _ANY_CMP and mask_provenance(n) & set(_POSITION_SOURCES):
            return True
        todo.extend(n.all_input_nodes)
    return False


def _is_slicing(node: Any) -> bool:
    """``aten.slice`` or ``x[...]`` with only slices, None and Ellipsis: it keeps, in order, a subsequence of
    every row's keys (so a prefix stays a prefix)."""
    if kind(node) == "slice":
        return True
    if kind(node) != "getitem" or len(node.args) < 2 or not isinstance(node.args[0], fx.Node):
        return False
    idx = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
    return all(i is None or i is Ellipsis or isinstance(i, slice) for i in idx)


def _keeps_key_order(node: Any, dtype_ok: Callable[[Any], bool]) -> bool:
    """Whether ``node`` only moves rows around (broadcast, reshape of the leading dims, a no-op cast) or slices
    keys, so that every output row is an in-order subsequence of an input row. ``dtype_ok(src)`` vets casts."""
    if not _is_call(node):
        return False
    src = _self(node)
    if not isinstance(src, fx.Node):
        return False
    if _is_slicing(node):
        return True
    k = kind(node)
    moves_rows = _is_noop(node) or k in ("expand", "view", "unsqueeze", "clone") or _getitem_index(node) is not None \
        or (k == "cast" and dtype_ok(src))
    return moves_rows and same_size((_last_dim(node),), (_last_dim(src),))


def _bool_form(node: Any, depth: int = 24) -> MaskForm | None:
    """The ``MaskForm`` of a boolean mask expression, or None when it is not an AND of recognised terms."""
    if not isinstance(node, fx.Node):
        return MaskForm() if node is True or _number(node) == 1.0 else None
    cur = node
    for _ in range(depth):
        if not _keeps_key_order(cur, lambda src: meta_dtype(src) == torch.bool):
            break
        cur = _self(cur)
    if not isinstance(cur, fx.Node):
        return None
    name = _bare_name(cur)
    if name in _AND_NAMES:
        a, b = _binary(cur)
        fa, fb = _bool_form(a, depth - 1), _bool_form(b, depth - 1)
        return fa & fb if fa is not None and fb is not None else None
    if name in _ORDER_CMP:
        a, b = _binary(cur)
        if _key_positions(a) and _same_along_keys(b):
            key_left, value = True, b
        elif _key_positions(b) and _same_along_keys(a):
            key_left, value = False, a
        else:
            return None if _compares_positions(cur) else MaskForm()
        if (name in ("lt", "le")) == key_left:
            return MaskForm(upper=True)
        return MaskForm(lower=True, window=_window_of(value, strict=name in ("lt", "gt")))
    if _number(cur) == 1.0:  # new_ones / ones / full(True)
        return MaskForm()
    return None if _compares_positions(cur) else MaskForm()


def _boolean_source(mask: fx.Node, depth: int = 12) -> fx.Node | None:
    """The boolean mask behind ``mask``: itself, or ``c`` of an additive ``where(c, 0, finfo.min)`` (through
    layout ops and float casts)."""
    cur = mask
    for _ in range(depth):
        if not isinstance(cur, fx.Node):
            return None
        dt = meta_dtype(cur)
        if dt == torch.bool:
            return cur
        if dt is None or not dt.is_floating_point:
            return None
        k = kind(cur)
        if k == "where":
            c, a, b = (list(cur.args) + [None, None, None])[:3]
            return c if _const_value(a) == 0.0 and _masking_const(b) else None
        if _keeps_key_order(cur, lambda src: meta_dtype(src) is not None and meta_dtype(src).is_floating_point):
            cur = _self(cur)
            continue
        return None
    return None


def mask_form(mask: fx.Node, invert: bool = False) -> MaskForm | None:
    """The provable form of an attention mask (boolean, True = attend; or additive ``where(c, 0, min)``), or
    None when it is not an AND of recognised terms (graph inputs alone, ORs, negations, arithmetic, ...).
    ``invert``: the mask is True where masked *out* (``masked_fill(mask, -inf)``); never analysed."""
    if invert:
        return None
    src = _boolean_source(mask)
    return _bool_form(src) if src is not None else None


def classify_mask(mask: fx.Node, q_len: Any, invert: bool = False) -> str:
    """"valid_length" when the mask provably keeps a prefix of the keys in every row, the same for every head:
    one head, and an AND of ``key_position <= query_position`` with terms that compare no positions (Hugging
    Face's padding lookup, constants); else "arbitrary".

    Key positions are ``arange`` plus a per-row offset along the last dim; a lower bound (``key > query - w``, a
    sliding window) or anything unrecognised makes it "arbitrary", which is still exact: the runtime applies any
    mask per tile. A mask that is a graph input (``generate()`` builds static-cache masks outside the compiled
    forward) cannot be proved anything and is "arbitrary".
    """
    s = meta_shape(mask)
    if s is None or len(s) != 4 or not _is_one(s[1]):
        return "arbitrary"
    form = mask_form(mask, invert)
    return "valid_length" if form is not None and form.upper and not form.lower else "arbitrary"


# ============================================================================================ module path
_MOD_RE = [
    (re.compile(r"^L\['[^']+'\]\.?"), ""),
    (re.compile(r"^L__self___"), ""),
    (re.compile(r"\[(\d+)\]"), r".\1"),
    (re.compile(r"\['([^']+)'\]"), r".\1"),
    (re.compile(r"_modules\."), ""),
]


def module_path(node: fx.Node) -> str:
    """The innermost module of ``node`` as a dotted path (``model.layers.0.self_attn``), or "" if unknown."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    last = list(stack.values())[-1]
    path = last[0] if isinstance(last, tuple) else str(last)
    # dynamo: "L['self'].model.layers[0].self_attn" or getattr(L['self'].model.layers, '0').self_attn
    path = re.sub(r"getattr\(([^,]+),\s*'([^']+)'\)", r"\1.\2", path)
    for rx, rep in _MOD_RE:
        path = rx.sub(rep, path)
    return path.strip(".")


# ============================================================================================ registry
def _ex_sdpa(q, k, v, mask=None):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


def _ex_eager(q, k, v, mask=None):
    scores = torch.matmul(q, k.transpose(2, 3)) * (q.shape[-1] ** -0.5)
    if mask is not None:
        scores = scores + mask
    p = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    p = F.dropout(p, p=0.0, training=False)
    return torch.matmul(p, v)


def _ex_einsum(q, k, v, mask=None):
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(q.shape[-1])
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.einsum("bhqk,bhkd->bhqd", s.softmax(-1), v)


def _ex_flash_cpu(q, k, v, mask=None):
    return aten._scaled_dot_product_flash_attention_for_cpu.default(q, k, v, attn_mask=mask)[0]


PATTERNS: dict[str, PatternInfo] = {p.name: p for p in (
    PatternInfo("sdpa", _ex_sdpa, "F.scaled_dot_product_attention / aten.scaled_dot_product_attention"),
    PatternInfo("sdpa_flash_cpu", _ex_flash_cpu, "aten._scaled_dot_product_flash_attention_for_cpu (out, lse)[0]"),
    PatternInfo("sdpa_flash", _ex_sdpa, "aten._scaled_dot_product_flash_attention (CUDA) output 0"),
    PatternInfo("sdpa_efficient", _ex_sdpa, "aten._scaled_dot_product_efficient_attention (CUDA) output 0"),
    PatternInfo("sdpa_cudnn", _ex_sdpa, "aten._scaled_dot_product_cudnn_attention (CUDA) output 0"),
    PatternInfo("sdpa_math", _ex_sdpa, "aten._scaled_dot_product_attention_math output 0"),
    PatternInfo("sdpa_overrideable", _ex_sdpa, "aten._scaled_dot_product_fused_attention_overrideable output 0"),
    PatternInfo("eager_matmul", _ex_eager, "matmul(q, k^T) * s (+ mask) -> softmax(-1) -> matmul(p, v), torch level"),
    PatternInfo("eager_bmm", _ex_eager, "the same chain at aten level: expand/view/bmm/view, _softmax"),
    PatternInfo("eager_einsum", _ex_einsum, "einsum('bhqd,bhkd->bhqk') -> softmax -> einsum('bhqk,bhkd->bhqd')"),
)}


def logical_shape(m: AttentionMatch, name: str) -> tuple | None:
    """Shape of ``m.q``/``m.k``/``m.v`` after the match's permutation (the (B, H, L|N, D) the op sees)."""
    s = meta_shape(getattr(m, name))
    perm = m.perms.get(name)
    if s is None or perm is None:
        return s
    return tuple(s[i] for i in perm)


def find_matches(gm: fx.GraphModule) -> list[AttentionMatch]:
    """Every attention site of ``gm`` in graph order (of the anchor node), including unsupported ones."""
    out: list[AttentionMatch] = []
    writes = MutationIndex(gm.graph)
    for node in gm.graph.nodes:
        if node.op != "call_function" and node.op != "call_method":
            continue
        m = match_sdpa(node) or match_sdpa_fused(node)
        if m is None and kind(node) == "softmax":
            m = match_eager(node, writes)
        if m is not None:
            if m.reason is None and m.q is not None:
                sources = [m.q, m.k, m.v, m.attn_mask] + [c for c, _ in m.scale_nodes]
                m.reason = writes.reason(sources, m.output)
                m.mask_written = writes.written_after(m.attn_mask)
            out.append(m)
    return out


__all__ = ["AttentionMatch", "logical_shape", "resolve_operand", "layout_path", "PATTERNS", "PatternInfo", "find_matches", "match_sdpa", "match_sdpa_fused",
           "match_eager", "meta_val", "meta_shape", "meta_dtype", "module_path", "classify_mask", "mask_form", "MaskForm",
           "classify_additive", "unrepeat_kv", "is_aten_graph", "skip_noops"]
