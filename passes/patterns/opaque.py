"""Attention the passes see only as one opaque call: reported as a site left alone, with the reason, so that
``attnopt explain`` / ``last_plans`` show it instead of nothing.

``nn.MultiheadAttention``: dynamo keeps ``F.multi_head_attention_forward`` as one call (and eager's fast path is
``aten._native_multi_head_attention``): the input projections, the attention and the output projection in one node,
whose query, keys and values the graph never holds apart. Rewriting it would mean re-deriving all of that from the
module's weights and flags (``batch_first``, ``need_weights`` with its head-averaged weights, ``key_padding_mask``
merged with ``attn_mask``, bias_k / add_zero_attn, packed or separate projections): more to prove than the
attention itself, for a module that keeps no KV cache (every call attends to the keys it is given), so decode-time
attention over a cache is not what it computes. It is left alone. At aten level (aot_autograd, ``torch.export``)
the same module is decomposed into ops the other patterns read, and its SDPA is matched as any other.
"""
from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

from .nodes import AttentionMatch

#: The pattern name the site reports (not a key of ``PATTERNS``: it is never rewritten, so never counted).
MHA_PATTERN = "nn_multihead_attention"

MHA_REASON = ("nn.MultiheadAttention is left alone: the graph holds it as one call (projections, attention and output "
              "projection together, F.multi_head_attention_forward), and the module keeps no KV cache; write the "
              "attention with F.scaled_dot_product_attention (or an eager softmax chain) over a cache to have it "
              "rewritten")


def _targets() -> tuple:
    out = [F.multi_head_attention_forward]
    native = getattr(torch.ops.aten, "_native_multi_head_attention", None)
    if native is not None:
        out.append(native.default)
    out.append(getattr(torch, "_native_multi_head_attention", None))
    return tuple(t for t in out if t is not None)


def match_opaque(node: fx.Node) -> AttentionMatch | None:
    """A site left alone for an opaque ``nn.MultiheadAttention`` call, else None."""
    if node.op != "call_function" or node.target not in _targets():
        return None
    return AttentionMatch(site=None, output=node, q=None, k=None, v=None, pattern=MHA_PATTERN, anchor=node,
                          reason=MHA_REASON)


__all__ = ["MHA_PATTERN", "MHA_REASON", "match_opaque"]
