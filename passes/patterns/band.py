"""Sliding-window bands read off the mask's own graph: the key range of each batch row without scanning the mask.

``band_of(mask, batch, writes)`` proves that a boolean mask (or ``where(mask, 0, -inf)``) is

    AND(key <= u  (or key < u),  key > l  (or key >= l),  *rest)

where ``key`` is ``arange(N) + c`` (start 0, step 1, integer dtype, ``N`` the key dim, a number ``c``) broadcast
along the key axis only, ``u`` and ``l`` are integer per-row values (a tensor whose last dim is 1: the query
positions, ``qp - W``) and ``rest`` compares no positions (Hugging Face's padding lookup, ``new_ones``). Every
spelling of the bound is turned around (``u >= key`` is ``key <= u``). Then row ``b`` sees exactly the keys
``[start, end)`` with ``end = clamp(u - c + 1, 0, N)`` and ``start = clamp(l - c + 1, 0, N)`` (the ``+ 1`` only for
the inclusive/strict spellings that need it), two tiny device ops on the positions, instead of a scan of the
N-long mask (``key_range_from_mask``). When the bounds are the same for every head and query row of a batch row
(``per_row``: q_len 1, or one position per batch row), the band factors may be dropped from the mask: what
remains is ``rest`` (or no mask at all). Otherwise the range is the outermost one (min start, max end over the
rows) and the whole mask stays.

Anything not proven (another key source, a float position, a slice of the keys, an in-place write anywhere on
the chain) gives a reason and the caller keeps the scan.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from ..mutation import MutationIndex, mutated_args
from .layout import _getitem_index
from .masks import _AND_NAMES, _ORDER_CMP, _compares_positions, _const_value
from .nodes import _bare_name, _binary, _is_call, _is_noop, _number, _self, arg, kind, meta_dtype, meta_shape, same_size

_INTEGER = (torch.int64, torch.int32)


@dataclass(frozen=True)
class Bound:
    """One end of a row's keys, normalised: the keys ``j`` (0-based) satisfy ``j < value + shift`` (an upper
    bound) or ``j >= value + shift`` (a lower one). ``value``: the per-row node (integer, last dim 1 or 0-d)."""

    value: fx.Node
    shift: int


@dataclass(frozen=True)
class Band:
    """A mask proven to be ``keys in [lower, upper)`` AND ``rest``. ``per_row``: the bounds are the same for every
    head and query row of a batch row, so the band factors can be dropped and ``rest`` alone kept."""

    upper: Bound
    lower: Bound
    rest: tuple[fx.Node, ...]
    per_row: bool
    nodes: tuple[fx.Node, ...]  # every node the proof walked (for the mutation check)


def _int_const(x: Any) -> int | None:
    v = _number(x)
    return int(v) if v is not None and float(v).is_integer() and not isinstance(x, bool) else None


def _key_arange(node: Any, n: Any, seen: list) -> int | None:
    """``c`` when ``node[..., j] == j + c`` for every leading index: an integer ``arange(0, N, 1)`` plus numbers,
    moved into place by unsqueeze / None-indexing / expand / integer casts (every dim but the last of size 1 or
    broadcast). None otherwise."""
    offset = 0
    cur = node
    for _ in range(16):
        if not _is_call(cur):
            return None
        s = meta_shape(cur)
        if s is None or not s or not same_size((s[-1],), (n,)) or meta_dtype(cur) not in _INTEGER:
            return None
        seen.append(cur)
        if _bare_name(cur) == "arange":
            if len(s) != 1:
                return None
            args = list(cur.args)
            if len(args) == 1 and not any(k in cur.kwargs for k in ("start", "step")):
                start, step = 0, 1
            else:
                start = cur.kwargs.get("start", args[0] if args else 0)
                step = cur.kwargs.get("step", args[2] if len(args) > 2 else 1)
            return offset if _int_const(start) == 0 and _int_const(step) == 1 else None
        k = _bare_name(cur)
        if k in ("add", "sub") and (mutated_args(cur) or meta_dtype(cur) != torch.int64):
            return None  # int32 sums may wrap where the int64 range arithmetic would not
        if k == "add" and arg(cur, 2, "alpha", 1) == 1:
            a, b = _binary(cur)
            c = _int_const(b) if isinstance(a, fx.Node) else _int_const(a)
            if c is None:
                return None
            offset += c
            cur = a if isinstance(a, fx.Node) else b
            continue
        if k == "sub" and arg(cur, 2, "alpha", 1) == 1:
            a, b = _binary(cur)
            c = _int_const(b)
            if c is None or not isinstance(a, fx.Node):
                return None
            offset -= c
            cur = a
            continue
        if kind(cur) == "cast" and meta_dtype(cur) not in (torch.int64, meta_dtype(_self(cur))):
            return None  # a narrowing cast may wrap
        if kind(cur) in ("unsqueeze", "expand", "cast") or _is_noop(cur) or _getitem_index(cur) is not None:
            cur = _self(cur)
            continue
        return None
    return None


def _row_value(x: Any) -> bool:
    """An integer tensor with one value per row (last dim 1, or 0-d)."""
    if not isinstance(x, fx.Node):
        return False
    s = meta_shape(x)
    return s is not None and meta_dtype(x) in _INTEGER and (len(s) == 0 or (isinstance(s[-1], int) and s[-1] == 1))


def _linear(x: Any, n: Any, seen: list, sign: int, acc: dict, depth: int = 8) -> bool:
    """Add ``sign * x`` to ``acc`` (``keys``: the sum of key coefficients, ``rows``: [(sign, per-row node)],
    ``const``: a number) when ``x`` is a sum of key positions, per-row values and numbers. Only int64 sums are
    taken apart (an int32 ``qp - w`` stays one per-row value: its wrap-around is the original's)."""
    c = _int_const(x)
    if c is not None:
        acc["const"] += sign * c
        return True
    if not isinstance(x, fx.Node) or depth <= 0:
        return False
    off = _key_arange(x, n, seen)
    if off is not None:
        acc["keys"] += sign
        acc["const"] += sign * off
        return True
    k = _bare_name(x)
    if k in ("add", "sub") and not mutated_args(x) and arg(x, 2, "alpha", 1) == 1 and meta_dtype(x) == torch.int64:
        a, b = _binary(x)
        part = dict(keys=0, rows=[], const=0)
        if _linear(a, n, seen, sign, part, depth - 1) and _linear(b, n, seen, sign if k == "add" else -sign, part,
                                                                  depth - 1):
            seen.append(x)
            acc["keys"] += part["keys"]
            acc["rows"] += part["rows"]
            acc["const"] += part["const"]
            return True
    if _row_value(x):
        acc["rows"].append((sign, x))
        seen.append(x)
        return True
    return False


_FLIP = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le"}


def _bound(cmp: fx.Node, n: Any, seen: list) -> tuple[str, Bound] | None:
    """("upper" | "lower", bound) of a comparison ``a op b`` with ``a - b = k * key - u + c`` (k = +-1, ``u`` one
    per-row value, ``c`` a number), else None."""
    op = _bare_name(cmp)
    a, b = _binary(cmp)
    acc: dict = dict(keys=0, rows=[], const=0)
    if not (_linear(a, n, seen, 1, acc) and _linear(b, n, seen, -1, acc)):
        return None
    if acc["keys"] not in (1, -1) or len(acc["rows"]) != 1:
        return None
    (s, value), c = acc["rows"][0], acc["const"]
    if acc["keys"] == -1:  # -key + s u + c op 0  <=>  key - s u - c flip(op) 0
        s, c, op = -s, -c, _FLIP[op]
    if s != -1:  # key + u + c op 0 would bound the key by -u: not a position
        return None
    # key - u + c op 0  <=>  key op u - c: end (or start) = u - c, plus 1 where the bound itself is included
    shift = (1 if op in ("le", "gt") else 0) - c
    return ("upper" if op in ("lt", "le") else "lower"), Bound(value, shift)


def _padded(s: tuple) -> tuple:
    return (1,) * (4 - len(s)) + tuple(s)


def _and_of_bounds(mask: Any, writes: MutationIndex) -> tuple[dict, list, list] | str:
    """({"upper": [Bound], "lower": [Bound]}, rest, every node walked) of a boolean mask (or ``where(mask, 0, -inf)``)
    that is an AND of key bounds and other factors, none written in place; else the reason it is not."""
    if not isinstance(mask, fx.Node):
        return "the mask is not a tensor"
    shape = meta_shape(mask)
    seen: list[fx.Node] = [mask]
    if meta_dtype(mask) != torch.bool:  # aten's SDPA decompositions: where(bool, 0, -inf) hides the same keys
        if kind(mask) != "where" or len(mask.args) != 3 or _const_value(mask.args[1]) != 0.0 \
                or _const_value(mask.args[2]) != -math.inf or meta_dtype(mask.args[0]) != torch.bool \
                or not same_size(meta_shape(mask.args[0]), shape):
            return "the mask is neither boolean nor where(boolean, 0, -inf)"
        mask = mask.args[0]
    if shape is None or not 1 <= len(shape) <= 4:
        return "the mask's shape is unknown or not 1-D to 4-D"
    n = shape[-1]
    if isinstance(n, int) and n == 1:  # arange(1) broadcast over every key: its one position is no key's
        return "the mask has one key column, broadcast over every key (its positions are not the keys')"
    cur = mask
    while _is_call(cur) and (kind(cur) == "expand" or _is_noop(cur)):  # right-aligned broadcasts keep the dims
        cur = _self(cur)
        seen.append(cur)
    if not isinstance(cur, fx.Node) or meta_shape(cur) is None or len(meta_shape(cur)) > 4:
        return "the mask is not an AND of comparisons"
    todo, bounds, rest = [cur], {"upper": [], "lower": []}, []
    while todo:
        t = todo.pop()
        if not isinstance(t, fx.Node):
            if t is True:
                continue
            return f"an AND factor {t!r} is not a tensor"
        if meta_dtype(t) != torch.bool:
            return f"factor {t.name} is not boolean"
        if _is_call(t) and kind(t) == "cast" and meta_dtype(_self(t)) == torch.bool and same_size(
                meta_shape(t), meta_shape(_self(t))):  # ``.to(device)`` of a bool
            seen.append(t)
            todo.append(_self(t))
            continue
        name = _bare_name(t)
        if name in _AND_NAMES and name != "iand":
            seen.append(t)
            todo.extend(_binary(t))
            continue
        if name in _ORDER_CMP:
            hit = _bound(t, n, seen)
            if hit is not None:
                seen.append(t)
                bounds[hit[0]].append(hit[1])
                continue
        if meta_dtype(t) == torch.bool and (_number(t) == 1.0 or _bare_name(t) in ("new_ones", "ones", "ones_like")):
            seen.append(t)
            continue
        if _compares_positions(t):
            return f"factor {t.name} compares positions in a form the band match does not know"
        rest.append(t)
    for node in seen + rest:
        if writes.written(node):
            return f"{node.name} is written in place: the band read off the graph may not hold"
    return bounds, rest, seen


def _one_per_batch_row(b: Bound, batch: Any) -> tuple[str, bool]:
    """("" or why the position is not per batch row, whether it is the same for every head and query row)."""
    s = _padded(meta_shape(b.value))
    if not (s[0] == 1 or same_size((s[0],), (batch,))):
        return f"position {b.value.name} of shape {tuple(meta_shape(b.value))} is not per batch row", False
    return "", all(isinstance(x, int) and x == 1 for x in s[1:])


def band_of(mask: Any, batch: Any, writes: MutationIndex) -> tuple[Band | None, str]:
    """The ``Band`` of a boolean attention mask (True = attend) over ``N`` keys, or (None, why not)."""
    walked = _and_of_bounds(mask, writes)
    if isinstance(walked, str):
        return None, walked
    bounds, rest, seen = walked
    if len(bounds["upper"]) != 1 or len(bounds["lower"]) != 1:
        return None, (f"{len(bounds['upper'])} upper and {len(bounds['lower'])} lower key bounds (the band needs one "
                      "of each)")
    upper, lower = bounds["upper"][0], bounds["lower"][0]
    per_row = True
    for b in (upper, lower):
        why, same = _one_per_batch_row(b, batch)
        if why:
            return None, why
        per_row = per_row and same
    return Band(upper, lower, tuple(rest), per_row, tuple(seen)), ""


def prefix_reason(mask: Any, batch: Any, writes: MutationIndex) -> str | None:
    """None when the boolean ``mask`` provably keeps exactly the keys ``j < end[b]`` of batch row ``b`` (one upper
    bound on the key position, one value per batch row, and nothing else: no lower bound, no padding lookup), the
    same for every head and query row: then the last visible key + 1 (``valid_len_from_mask``) says the whole mask.
    Else why not."""
    walked = _and_of_bounds(mask, writes)
    if isinstance(walked, str):
        return walked
    bounds, rest, _ = walked
    if len(bounds["upper"]) != 1 or bounds["lower"] or rest:
        return (f"{len(bounds['upper'])} upper and {len(bounds['lower'])} lower key bounds and {len(rest)} other "
                "factors (a padding lookup, an input, ...): not one prefix of the keys")
    why, same = _one_per_batch_row(bounds["upper"][0], batch)
    return why or (None if same else "the key bound differs between the heads or query rows of a batch row")


def band_window(mask: fx.Node, batch: Any) -> int | None:
    """The keys per row of a band whose two bounds read the same position (``W``), else None."""
    band, _ = band_of(mask, batch, MutationIndex(mask.graph))
    if band is None or band.upper.value is not band.lower.value:
        return None
    w = band.upper.shift - band.lower.shift
    return w if w > 0 else None


__all__ = ["Band", "Bound", "band_of", "band_window", "prefix_reason"]
