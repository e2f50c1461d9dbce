"""FX node helpers shared by every pattern: the match type (``AttentionMatch``), fake values from ``node.meta``,
the folded op kinds (torch-level and aten-level spellings of one op map to one kind), argument access, and the
compile-time numbers a pattern may rely on (literals, specialised symbolic numbers, constant-filled tensors).

Proves nothing by itself; every other module reads the graph through these helpers.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn.functional as F

from attnopt.site import AttentionSite

from ..mutation import written_in_place


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
    #: c when the scores are capped as ``c * tanh(s)`` before the mask (Gemma 2's logit softcapping; the inner
    #: ``1 / cap`` is part of ``scale``), else None.
    softcap: float | None = None
    #: ALiBi: the slopes node (broadcastable to (1, H, 1, 1)) of a bias ``slope[h] * key position`` the op adds
    #: itself (lower passes it as ``alibi_slopes`` (Hq,)), else None.
    alibi_slopes: fx.Node | None = None
    #: Bloom's ``baddbmm(bias, q, k^T)``: the bias (rank <= 3, broadcastable to the (B * H, L, N) scores, batch-major
    #: rows) that ``lower`` views as (B, H, L, N) and adds to the mask (an additive float mask or none), else None.
    score_bias: fx.Node | None = None
    #: With ``mask_invert``: the finite value ``masked_fill`` writes (finfo.min), applied as the additive mask
    #: ``where(mask, value, 0)`` (a row hidden whole then gives the mean of V, as in the original); None for -inf.
    mask_fill: float | None = None
    #: What the original gives for a query row with no visible key (every score -inf): "zero" (SDPA, PyTorch's
    #: safe softmax, or the ``where(row_fully_masked, 0, p)`` guard) or "nan" (a plain softmax over -inf only).
    #: The op gives zeros; lower sets such rows to NaN for "nan" when the mask can hide a whole row.
    empty_rows: str = "zero"
    #: The mask's storage is written in place after the mask node (``lower`` then computes its ``valid_len`` at
    #: the site, not once right after the mask's producer).
    mask_written: bool = False
    #: (k_prefix, v_prefix, k_suffix, v_suffix) when K/V provably are one batch-1 prefix broadcast over the rows
    #: plus per-row suffixes (``patterns.prefix``); the cascade plan reads these instead of ``k``/``v``.
    shared_prefix: tuple | None = None


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
    if isinstance(x, fx.Node) and x.op == "call_function" and written_in_place(x):
        return None  # a constant-filled tensor edited in place (``c = torch.ones(()); c.mul_(0.5)``) holds no constant
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

def _binary(node: fx.Node) -> tuple[Any, Any]:
    a = node.args[0] if node.args else node.kwargs.get("input", node.kwargs.get("self"))
    b = node.args[1] if len(node.args) > 1 else node.kwargs.get("other")
    return a, b

def _name(node: fx.Node) -> str:
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return t.overloadpacket.__name__
    return t if isinstance(t, str) else getattr(t, "__name__", str(t))


def _bare_name(node: Any) -> str:
    """``_name`` without leading/trailing underscores (``__le__`` -> ``le``, ``and_`` -> ``and``)."""
    return _name(node).strip("_") if _is_call(node) else ""

def _dtype_name(dt: Any) -> str:
    return str(dt).removeprefix("torch.") if dt is not None else "unknown"
