"""Mask analysis: what an attention mask or additive bias provably is.

* ``classify_additive`` / ``additive_values``: the values an additive tensor can hold (0/-inf, ``finfo.min``, a
  bias); a tensor written in place anywhere proves nothing.
* ``mask_form`` / ``classify_mask``: a boolean mask as an AND of key-position bounds (causal, valid length,
  sliding window) and terms that compare no positions (padding lookups); anything else is "arbitrary", which the
  runtime still applies exactly per tile.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx

from ..mutation import MutationIndex, written_in_place
from .nodes import (_bare_name, _binary, _is_call, _is_noop, _name, _number, _self, arg, is_python_scalar, kind,
                    meta_dtype, meta_shape, same_size)
from .layout import _getitem_index, _is_one


_MASK_FILL_MIN = -1e4  # a masked_fill / where value at or below this (or -inf) is a mask, not a bias

def mask_value_is_masking(value: Any) -> bool:
    """Whether a fill value hides a position: -inf, or a very negative number such as ``finfo.min``."""
    v = _number(value)
    return v is not None and (v == -math.inf or v <= _MASK_FILL_MIN)

# ============================================================================================ mask analysis
_MASK_SOURCES = ("placeholder", "get_attr")
_BIAS = "an additive float bias that is not a 0/-inf mask (ALiBi-style position bias)"


def _const_value(x: Any) -> float | None:
    """Like ``_number``, but also reads one-element constant tensors (``get_attr``, e.g. aot's lifted
    ``torch.tensor(0.0)``). Only for classifying masks: the mask tensor itself still flows at run time."""
    n = _number(x)
    if n is not None or not isinstance(x, fx.Node) or written_in_place(x):
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

#: Comparison ops (names with underscores stripped: ``operator.le``, ``Tensor.__le__``, ``aten.le``).
_ORDER_CMP = ("lt", "le", "gt", "ge")
_ANY_CMP = _ORDER_CMP + ("eq", "ne")
_AND_NAMES = ("and", "iand", "bitwise_and", "logical_and")
_POSITION_SOURCES = ("arange", "iota")
#: Dtypes a cast of key positions may produce without breaking their order (no wrap-around, no bool).
_ORDER_KEEPING = (torch.int64, torch.float64, torch.float32)

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


#: Dtypes that hold whole numbers exactly only up to a bound: an ``arange`` in them rounds (fp16 past 2048, bf16
#: past 256) or wraps the positions beyond it.
_EXACT_UP_TO = {torch.float16: 2 ** 11, torch.bfloat16: 2 ** 8, torch.float32: 2 ** 24, torch.int8: 2 ** 7 - 1,
                torch.uint8: 2 ** 8 - 1, torch.int16: 2 ** 15 - 1}


def _holds_positions(dtype: Any, n: Any) -> bool:
    """Whether an ``arange(n)`` of ``dtype`` holds every position exactly (a static ``n`` within the dtype's bound;
    float32 is taken as exact for a symbolic ``n``, which would need more than 16M keys to round)."""
    limit = _EXACT_UP_TO.get(dtype)
    if limit is None:
        return dtype is None or dtype in (torch.int32, torch.int64, torch.float64)
    if isinstance(n, int):
        return n - 1 <= limit
    return dtype == torch.float32


def _key_positions(node: Any, depth: int = 16, seen: list | None = None) -> bool:
    """Whether ``node[..., j] == j + offset`` for an offset that is the same for every key ``j``: an
    ``arange`` (step 1) plus such offsets, moved into place by unsqueeze / None-indexing / views / expands /
    order-keeping casts that all keep the last dim. Such values increase along the last dim. ``seen`` collects the
    nodes of the chain (whose in-place writes a caller that reads the values must rule out)."""
    n = _last_dim(node)
    if n is None or (isinstance(n, int) and n == 1):  # one column broadcast over every key: no key's position
        return False
    cur = node
    for _ in range(depth):
        if not _is_call(cur) or not same_size((_last_dim(cur),), (n,)):
            return False
        if seen is not None:
            seen.append(cur)
        if _bare_name(cur) in _POSITION_SOURCES:
            step = cur.kwargs.get("step", cur.args[2] if len(cur.args) > 2 and _bare_name(cur) == "arange" else 1)
            return len(meta_shape(cur)) == 1 and not isinstance(step, fx.Node) and step == 1 \
                and _holds_positions(meta_dtype(cur), n)
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
    w, steps = 0.0, 0
    while _is_call(cur) and steps < 8:  # every constant of a chain: ``q - w - 1`` keeps w + 1 keys, not 1
        name = _bare_name(cur)
        a, b = _binary(cur)
        c = _number(b) if isinstance(a, fx.Node) else None
        if c is None or arg(cur, 2, "alpha", 1) != 1 or not (name == "sub" or kind(cur) == "add"):
            break
        w += c if name == "sub" else -c
        cur, steps = a, steps + 1
    if not steps or w != int(w) or w <= 0:
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
