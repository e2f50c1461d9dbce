"""SDPA and its aten forms: ``F.scaled_dot_product_attention`` / ``aten.scaled_dot_product_attention`` and the
tuple-returning fused variants (flash, flash for CPU, efficient, cuDNN, math, overrideable).

Proves: the call computes softmax(q k^T * scale + mask) v with SDPA's semantics (bool mask True = attend, float
mask additive, fully masked rows 0), with inference dropout only and only output 0 used. A fused CUDA or
backend kernel called with ``is_causal`` at q_len != kv_len is left alone where its causal alignment is not proven
to be SDPA's top-left one (``_CAUSAL_UNPROVEN``).
"""
from __future__ import annotations

import math
import operator
from typing import Any

import torch.fx as fx
import torch.nn.functional as F

from .nodes import AttentionMatch, _SDPA_FUSED, _number, _sym_eq, arg, aten, is_python_scalar, meta_shape, schema_args
from .gqa import unrepeat_kv


# ============================================================================================ SDPA patterns
def _sdpa_torch_args(node: fx.Node) -> dict[str, Any]:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    defaults = (None, None, None, None, 0.0, False, None, False)
    return {n: arg(node, i, n, d) for i, (n, d) in enumerate(zip(names, defaults))}


def _is_sdpa(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    t = node.target
    return t in _TORCH_LEVEL_SDPA or t is aten.scaled_dot_product_attention.default


#: SDPA called with torch-level argument handling: ``F.scaled_dot_product_attention`` and, in a user's function,
#: ``torch.ops.aten.scaled_dot_product_attention(...)`` (the overload packet; its argument names are the same).
_TORCH_LEVEL_SDPA = (F.scaled_dot_product_attention, aten.scaled_dot_product_attention)


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
        m.scale = 1.0 / math.sqrt(s[-1]) if s and isinstance(s[-1], int) and s[-1] > 0 else None  # D = 0: detect's
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
    a = _sdpa_torch_args(node) if node.target in _TORCH_LEVEL_SDPA else schema_args(node)
    m = AttentionMatch(site=None, output=node, q=None, k=None, v=None, pattern="sdpa", anchor=node)
    m.attn_mask = a.get("attn_mask")
    ic = a.get("is_causal")
    if isinstance(ic, fx.Node):
        m.reason = "is_causal is a run-time value"
    m.is_causal = bool(ic) if not isinstance(ic, fx.Node) else False
    _resolve_common(m, a["query"], a["key"], a["value"], a.get("scale"), a.get("dropout_p"), bool(a.get("enable_gqa")))
    return m


#: Fused kernels whose ``is_causal`` with q_len != kv_len is not proven to mean SDPA's top-left mask. (The CPU flash
#: kernel's is, checked in the tests; the efficient kernel's is CausalFromTopLeft; the math op is SDPA's own.)
_CAUSAL_UNPROVEN = ("sdpa_flash", "sdpa_cudnn", "sdpa_overrideable")


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
    qs, ks = meta_shape(a["query"]), meta_shape(a["key"])
    if m.is_causal and pattern in _CAUSAL_UNPROVEN and m.reason is None and qs and ks and not _sym_eq(qs[2], ks[2]):
        m.reason = (f"is_causal with q_len {qs[2]} != kv_len {ks[2]} in {node.target.name()}: its causal mask is not "
                    "proven to be SDPA's top-left one there (FlashAttention aligns it bottom-right; PyTorch's dispatch "
                    "sends no such call to it)")
    if pattern == "sdpa_math" and a.get("dropout_mask") is not None:
        m.reason = m.reason or "training-mode dropout (dropout_mask given)"
    if others and m.reason is None:
        what = "the attention weights" if pattern == "sdpa_math" else "the log-sum-exp"
        m.reason = f"{what} (output {others[0]} of {node.target.name()}) is used elsewhere, e.g. by a backward pass"
    # Unused getitems of the other outputs die with the fused node.
    m.nodes = [u for u in node.users if u.target is operator.getitem and not u.users and u.args[1] != 0] + out0[1:]
    return m
