"""The attention patterns that ``passes.detect`` recognises, at torch level (dynamo) and aten level
(aot_autograd, make_fx, ``torch.export``).

One module per family, each saying what it proves: ``sdpa`` (SDPA and its aten forms), ``eager`` (matmul ->
softmax -> matmul chains; ``products`` reads their score and value products), ``gqa`` (``repeat_kv`` /
``repeat_interleave``), ``masks`` (mask and bias analysis), ``scale`` (scalar factors of the scores); ``layout`` (operands through layout ops) and ``nodes``
(FX helpers, op kinds, ``AttentionMatch``) serve them, and ``passes.mutation`` proves no write interferes.
This module holds the registry (``PATTERNS``), ``find_matches`` and ``module_path``, and re-exports the public
names of the modules.

Each pattern is documented by the eager function it comes from (``PATTERNS[name].example``; the tests trace
these), and matched by a function over FX nodes that reads shapes from ``node.meta`` ("example_value" in
dynamo graphs, "val" in aten/export graphs):

``sdpa``
    ``F.scaled_dot_product_attention`` (target ``torch._C._nn.scaled_dot_product_attention``) and
    ``aten.scaled_dot_product_attention.default`` (``torch.export``; ``torch.ops.aten.scaled_dot_product_attention``
    called by hand in a function).
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
  A constant-filled tensor (``torch.ones(())``, ``torch.tensor(-inf)``) is read as its number only while nothing
  writes it in place (``mutation.written_in_place``).
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
import re

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..mutation import MutationIndex

from .nodes import (AttentionMatch, PatternInfo, _SDPA_FUSED, arg, aten, is_aten_graph, is_metadata_assert,
                    is_python_scalar, kind, meta_dtype, meta_shape, meta_val, same_size, schema_args, skip_noops,
                    sym_constant)  # noqa: F401
from .scale import Factor  # noqa: F401
from .layout import Dims, follow_output, layout_path, resolve_operand  # noqa: F401
from .gqa import unrepeat_kv  # noqa: F401
from .masks import (MaskForm, additive_is_zero_or_neginf, additive_values, classify_additive, classify_mask, mask_form,
                    mask_provenance, mask_value_is_masking, may_hide_whole_rows)  # noqa: F401
from .sdpa import match_sdpa, match_sdpa_fused  # noqa: F401
from .eager import is_empty_row_guard, match_eager, matmul_behind  # noqa: F401
from .prefix import find_shared_prefix  # noqa: F401
from .opaque import match_opaque  # noqa: F401


# ============================================================================================ module path
_MOD_RE = [
    # the traced callable's module: L['self'], or (transformers >= 5.24 wraps forward) the wrapper's L['args'][0]
    (re.compile(r"^L\['[^']+'\](\[\d+\])?\.?"), ""),
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
    # dynamo: "L['self'].model.layers[0].self_attn", getattr(L['self'].model.layers, '0').self_attn, or
    # "L['args'][0].model.layers.0.self_attn" where the module is the first argument of a traced wrapper
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


def _ex_baddbmm(q, k, v, mask=None):
    b, h, n, d = k.shape
    bias = torch.zeros(b * h, 1, n, dtype=q.dtype, device=q.device)
    s = bias.baddbmm(q.reshape(b * h, -1, d), k.reshape(b * h, n, d).transpose(1, 2), alpha=d ** -0.5)
    s = s.view(b, h, -1, n)
    if mask is not None:
        s = s + mask
    p = F.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.bmm(p.view(b * h, -1, n), v.reshape(b * h, n, d)).view(b, h, -1, d)


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
    PatternInfo("eager_baddbmm", _ex_baddbmm, "Bloom: baddbmm(bias, q, k^T, alpha=s) (+ mask) -> softmax -> bmm(p, v)"),
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
        m = match_sdpa(node) or match_sdpa_fused(node) or match_opaque(node)
        if m is None and kind(node) == "softmax":
            m = match_eager(node, writes)
        if m is not None:
            if m.reason is None and m.q is not None:
                sources = [m.q, m.k, m.v, m.attn_mask, m.score_bias] + [c for c, _ in m.scale_nodes]
                m.reason = writes.reason(sources, m.output)
                m.mask_written = writes.written_after(m.attn_mask)
                m.shared_prefix = find_shared_prefix(m, writes)
            out.append(m)
    return out


__all__ = ["AttentionMatch", "logical_shape", "resolve_operand", "layout_path", "PATTERNS", "PatternInfo", "find_matches", "match_sdpa", "match_sdpa_fused",
           "match_eager", "meta_val", "meta_shape", "meta_dtype", "module_path", "classify_mask", "mask_form", "MaskForm",
           "classify_additive", "unrepeat_kv", "is_aten_graph", "skip_noops"]
