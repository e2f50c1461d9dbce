"""Eager attention chains: ``matmul(q, k^T)`` (scale, additive or boolean mask) -> ``softmax(-1)`` (fp32 upcast,
cast back, inference dropout, PyTorch's fully-masked-row guard) -> ``matmul(p, v)``, also as ``einsum`` and as
aten ``bmm`` chains.

Proves: every op between the score product and the softmax is a scalar scale or one mask/bias the op applies
exactly (see the package docstring for the rules), and every op between the softmax and the value product
leaves the probabilities unchanged; anything else becomes the site's reason.

Logit softcapping (Gemma 2: ``tanh(s * scaling / cap) * cap``): one ``tanh`` whose result is multiplied only by
constants (their product is the cap ``c``) before any mask or bias is added, and whose argument is the scaled
score product alone (no mask, bias or constant inside). The match then carries ``softcap = c`` and the scale of
the argument (``scaling / cap``); the op computes ``c * tanh(qk * scale)``. A run-time cap, a second ``tanh`` or
anything inside it is a reason.

Bloom's ``baddbmm(bias, q, k^T, beta=1, alpha=a)`` is ``a * (q @ k^T) + bias``: the score product with the scale
``a`` and a float bias of the scores' dtype (fp32: in half precision the original rounds the sum) broadcast to the
(B * H, L, N) scores. The bias becomes ``score_bias``, which lower views as (B, H, L, N) and adds to the additive
mask (one mask for the op: ``(s + bias) + mask`` and ``s + (bias + mask)`` agree where the mask is 0 and both
give the mask's value where it is -inf or finfo.min); with a boolean mask or a softcap it is a reason.

ALiBi: an additive bias that ``alibi.alibi_slopes_of`` proves to be a per-head slope times the key position (built
in the graph from ``arange``, not written in place) becomes the match's ``alibi_slopes`` instead of a mask, so the
op adds ``slope[h] * j`` itself and reads no bias tensor; at most one such term, outside any softcap.

The score and value products themselves (matmul, bmm, einsum, baddbmm: their operands' roles) are read in
``products``.
"""
from __future__ import annotations

import math
import operator
from typing import Any

import torch
import torch.fx as fx

from ..mutation import MutationIndex
from .nodes import (AttentionMatch, _bare_name, _binary, _dtype_name, _is_call, _is_noop, _name, _ndim, _norm_dim,
                    _number, _self, _sym_eq, arg, aten, is_metadata_assert, kind, meta_dtype, meta_shape, skip_noops)
from .scale import Factor, _scale_factor
from .layout import Dims, _assign_roles, _is_layout_op, _simulate, follow_output, resolve_operand
from .gqa import unrepeat_kv
from .masks import additive_is_zero_or_neginf, additive_values, mask_value_is_masking, may_hide_whole_rows
from .alibi import alibi_slopes_of
from .products import (_ID, _baddbmm_terms, _einsum_groups, _leads_to_matmul, _mm_dims, _operand_groups,
                       _sizes_of, matmul_behind)

#: A ``masked_fill`` value at or below this hides scores as an additive mask does: next to it fp32 absorbs any
#: finite score (|s| < 1e22), so the hidden scores of a row tie, as the original's filled ones do.
ABSORBING_FILL = -1e30


# ============================================================================================ eager chains

def _narrowing_reason(mm: fx.Node, nodes: list[fx.Node]) -> str | None:
    """Why the chain cannot be rewritten when one of its ``nodes`` (between the score product ``mm`` and the value
    product, inclusive) holds an integer or bool dtype (``p.to(torch.int32).float()``: truncated), or a float dtype
    less precise than the scores (``softmax(s, dtype=float16)`` or
    ``p.half()`` in an fp32 model): the original rounds there, and the kernels (which keep the scores and
    probabilities in fp32) would not reproduce that rounding. Casts to the scores' dtype or wider are exact."""
    base = meta_dtype(mm)
    if base is None or not base.is_floating_point:
        return None
    eps = torch.finfo(base).eps
    for n in nodes:
        dt = meta_dtype(n)
        if dt is not None and not dt.is_floating_point:
            return (f"the attention is cast to {_dtype_name(dt)} between the score and value products: the original "
                    "truncates the scores or probabilities there, the rewrite would not")
        if dt is not None and torch.finfo(dt).eps > eps:
            return (f"the attention is rounded to {_dtype_name(dt)} between the score and value products (the scores "
                    f"are {_dtype_name(base)}): the rewrite would not reproduce that rounding")
    return None


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
            # an einsum's operands come back probabilities first where its equation is a value product (in either
            # order), as written otherwise
            first = _binary(u)[0] if k != "einsum" else _einsum_groups(u, "pv")[2][0]
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
            zero = _number(a) == 0.0  # zeros_like / full_like(p, 0) / 0; not empty_like (uninitialised)
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
    softcap: float | None = None
    m_alibi: fx.Node | None = None  # the slopes of an ALiBi bias (see the module docstring)
    fill_values: dict[Any, float] = {}  # masked_fill conditions with a finite (absorbing) fill value
    masks_outside_cap = 0  # masks found before the tanh (walking back): added after the cap, as the op does
    for _ in range(16):
        if not isinstance(cur, fx.Node):
            break
        mb = matmul_behind(cur)
        if mb is not None:
            mm, spath = mb
            break
        chain.append(cur)
        k = kind(cur)
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
                if softcap is not None:  # inside tanh a constant is not softmax-invariant
                    reasons.append("a constant added to the scores inside the softcap's tanh")
                const = _number(b if isinstance(a, fx.Node) else a)
                if const is not None and not math.isfinite(const):  # s + inf, s + nan: every score inf/NaN
                    reasons.append(f"the constant {const!r} added to the scores")
                cur = a if isinstance(a, fx.Node) else b  # + constant: softmax-invariant
                continue
            scores, other = (a, b) if _leads_to_matmul(a) else (b, a)
            if factors:
                reasons.append("the scores are scaled after the mask is added")
            odt = meta_dtype(other)
            if odt is not None and not odt.is_floating_point:
                reasons.append(f"a {_dtype_name(odt)} tensor added to the scores (a 0/1 bias in eager, not a mask)")
            elif odt == torch.float64 and meta_dtype(scores) != torch.float64:
                reasons.append(f"a float64 mask or bias added to {_dtype_name(meta_dtype(scores))} scores: the original "
                               "sums in float64, where the op reads the mask as float32 (float64's finfo.min, which "
                               "keeps a hidden row's keys tied, would become -inf)")
            elif (slopes := alibi_slopes_of(other, writes)) is not None and m_alibi is None and softcap is None:
                m_alibi = slopes  # a per-head slope times the key position: the op adds it itself
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
            if _number(value) is not None and meta_dtype(cur) is not None and meta_dtype(cur).is_floating_point:
                value = float(torch.tensor(_number(value), dtype=meta_dtype(cur)))  # as the scores hold it
            if _number(value) == -math.inf:
                masks.append((cond, True))
                if factors:
                    reasons.append("the scores are scaled after the mask is applied")
            elif mask_value_is_masking(value) and _number(value) <= ABSORBING_FILL:
                # fp32 absorbs any finite score next to such a value, so replacing the hidden scores by it (a row
                # hidden whole: the mean of V) equals adding it, which the op does for an additive mask
                masks.append((cond, True))
                fill_values[cond] = float(_number(value))
                if factors:
                    reasons.append("the scores are scaled after the mask is applied")
            elif mask_value_is_masking(value):
                reasons.append(f"masked_fill with the finite value {value!r}: a fully masked row gives the mean of V "
                               "in the original, and next to a value this small the rewrite's scores would not tie")
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
            cap = math.prod(f[0] for f in factors) if all(f[0] is not None for f in factors) else None
            if softcap is not None:
                reasons.append("more than one tanh between the scores and the softmax")
            elif cap is None:
                reasons.append("logit softcapping with a run-time cap (the factor after tanh is not a constant)")
            elif cap == 0 or not math.isfinite(cap):
                reasons.append(f"logit softcapping with the cap {cap!r}")
            else:
                softcap, masks_outside_cap = float(cap), len(masks)
                factors = []  # the cap; the factors inside tanh are the scores' scale
            cur = _self(cur)
            continue
        target = cur.target if cur.op == "call_function" else f".{cur.target}()"
        reasons.append(f"unrecognised op {getattr(target, '__name__', target)} between the scores and the softmax")
        cur = _self(cur)
    if mm is None:
        return None
    # -------- operands
    pattern = {"matmul": "eager_matmul", "einsum": "eager_einsum", "bmm": "eager_bmm",
               "baddbmm": "eager_baddbmm"}[kind(mm)]
    scores = spath[0] if spath else mm
    m = AttentionMatch(site=None, output=pv, q=None, k=None, v=None, pattern=pattern, anchor=sm)
    m.nodes = [mm] + list(reversed(spath)) + list(reversed(chain)) + fchain

    def fail(why: str) -> AttentionMatch:
        m.reason = reasons[0] if reasons else why
        return m

    narrowed = _narrowing_reason(mm, chain + fchain)
    if narrowed is not None:
        reasons.append(narrowed)

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
    if kind(mm) == "baddbmm":
        bias, alpha, why = _baddbmm_terms(mm, (B * H if isinstance(B, int) and isinstance(H, int) else None, L, N))
        if why is not None:
            reasons.append(why)
        elif softcap is not None:
            reasons.append("a bias inside the softcap's tanh (baddbmm's)")
        elif any(invert or meta_dtype(node) == torch.bool for node, invert in masks):
            reasons.append("a boolean mask with baddbmm's bias (only an additive mask is summed with it)")
        else:
            factors.append((alpha, alpha, False))
            m.score_bias = bias
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
    m.alibi_slopes = m_alibi
    if softcap is not None:
        if len(masks) > masks_outside_cap:
            reasons.append("a mask or bias applied inside the softcap's tanh")
        m.softcap = softcap
    # mask
    plain_softmax = not guarded and _name(sm) != "_safe_softmax"  # gives NaN for a row of -inf scores
    if len(masks) > 1:
        reasons.append("more than one mask between the scores and the softmax")
    elif masks:
        node, invert = masks[0]
        if meta_dtype(node) is not None and meta_dtype(node) != torch.bool and invert:
            reasons.append("masked_fill with a non-boolean mask")
        m.attn_mask, m.mask_invert = node, invert
        m.mask_fill = fill_values.get(node)
        if m.mask_fill is None and plain_softmax and may_hide_whole_rows(node, writes):
            m.empty_rows = "nan"
    if m.score_bias is not None and plain_softmax and not _provably_finite(m.score_bias, writes):
        m.empty_rows = "nan"  # a bias of unknown values may hold -inf and hide a whole row
    for r in reasons:
        m.reason = m.reason or r
    return m


def _provably_finite(bias: fx.Node, writes: MutationIndex | None) -> bool:
    """Whether ``bias`` provably holds no -inf (its values are known and finite)."""
    values = additive_values(bias, writes)
    return values is not None and -math.inf not in values
