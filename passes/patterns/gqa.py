"""GQA expansion: undo ``repeat_kv`` (``x[:, :, None].expand(b, hkv, g, n, d).reshape(b, hkv * g, n, d)``;
aten ``unsqueeze -> expand -> clone -> view``) and ``repeat_interleave(g, dim=1)``.

Proves: the expanded K/V equal the un-expanded cache read with query head ``h`` -> KV head ``h // g`` (the op's
convention), so the rewritten op can read the cache itself.
"""
from __future__ import annotations

from typing import Any

from .nodes import _norm_dim, _self, _sym_eq, arg, kind, meta_shape, same_size, skip_noops


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
