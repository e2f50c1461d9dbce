"""The Hugging Face integration: a ``DynamicCache`` that keeps this rank's shard, the sharded attention function
for transformers' attention interface (the eager route), and the shard-aware wrapper of HF's own attention that
cuts the global mask to the local key columns in the traced graph (the compiler route).

::

    group = register_group(pg)                       # every rank, after init_process_group
    cache = make_sharded_cache(model, group)         # a new one per generate call
    # either the compiler route: decode sites lowered to TreePlan / RingPlan by the planner
    out = attnopt.optimize(model, process_group=pg).generate(ids, past_key_values=cache)
    # or the eager route: transformers' attention interface
    register_hf_attention(); model.set_attn_implementation("attnopt_sharded")
    out = model.generate(ids, past_key_values=cache)

The cache returns the whole prompt at prefill and only the local shard afterwards, so a decode-time attention that
was *not* rewritten would attend to the local shard alone: check ``attnopt.last_plans``.
"""
from __future__ import annotations

from typing import Any

import torch

from .cache import ShardedKVCache, adapt_mask
from .groups import DistGroup, DistributedDecodeError, current_group, register_group
from .ring import ring_decode
from .tree import tree_decode


DECODE_MAX_Q_LEN = 16
_HF_CACHE_CLASS = None


def hf_sharded_cache_class():
    """The ``ShardedDynamicCache`` class (a ``transformers.DynamicCache`` subclass), built on first use.

    Each layer keeps only its local shard (placement by a shared :class:`ShardedKVCache`). ``get_seq_length``
    and mask sizes are *global*, so position ids, RoPE and masks stay right. ``update`` returns:

    * for a prefill into an empty layer: the whole prompt's K/V (plain attention over it is exact, and the
      prompt's q_len == kv_len makes it a prefill site that attnopt leaves alone) while only the local part is
      stored;
    * for later steps of at most ``DECODE_MAX_Q_LEN`` tokens: the local shard, which the rewritten attention
      (tree or ring) consumes. A longer chunk into a non-empty cache raises (not supported).
    """
    global _HF_CACHE_CLASS
    if _HF_CACHE_CLASS is not None:
        return _HF_CACHE_CLASS
    from transformers.cache_utils import DynamicCache, DynamicLayer

    class ShardedLayer(DynamicLayer):
        def __init__(self, shards: ShardedKVCache, index: int):
            super().__init__()
            self.shards = shards
            self.index = index

        # Placement is Python bookkeeping (lists of owners); traced, it would be baked into guards and
        # recompile every step until dynamo's recompile limit falls back to eager (plain SDPA over the local
        # shard: wrong). So the update always runs eagerly, as a graph break.
        @torch._dynamo.disable
        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            start, t = self.shards.get_seq_length(self.index), key_states.shape[-2]
            if t > DECODE_MAX_Q_LEN and start > 0:
                raise DistributedDecodeError(
                    f"ShardedDynamicCache: a {t}-token chunk into a non-empty sharded cache ({start} tokens) is not "
                    f"supported; prefill once, then decode at most {DECODE_MAX_Q_LEN} tokens per step")
            self.keys, self.values = self.shards.update(self.index, key_states, value_states)
            full = start == 0  # the prompt: every rank has all of it, plain attention over it is exact
            self.shards.returned_full[self.index] = full
            if full:
                return key_states, value_states
            return self.keys, self.values

        def get_seq_length(self) -> int:
            return self.shards.get_seq_length(self.index)

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.get_seq_length() + query_length, 0

        def crop(self, tokens_to_remove: int) -> None:
            raise NotImplementedError("ShardedDynamicCache cannot be cropped")

    class ShardedDynamicCache(DynamicCache):
        """A ``DynamicCache`` holding only this rank's sequence shard (see ``hf_sharded_cache_class``)."""

        def __init__(self, num_layers: int, group: DistGroup | None = None):
            self.shards = ShardedKVCache(group)
            super().__init__()
            self.layers = [ShardedLayer(self.shards, i) for i in range(num_layers)]
            self.layer_class_to_replicate = None

        # The graph break sits here, at the cache's own update, rather than inside DynamicCache.update: the layer
        # index then reaches it as an argument, and with ``allow_unspec_int_on_nn_module`` (see
        # ``attnopt.api._never_eager_over_shards``) one compiled attention frame serves every layer instead of
        # one recompile per layer (dynamo guarded on ``self.layer_idx == i``).
        @torch._dynamo.disable
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            return self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)

    ShardedDynamicCache.__module__ = __name__
    _HF_CACHE_CLASS = ShardedDynamicCache
    return ShardedDynamicCache


def make_sharded_cache(model, group: Any = None):
    """A ``ShardedDynamicCache`` for a Hugging Face causal LM: pass it as ``past_key_values`` to ``generate``.

    ``group``: a :class:`DistGroup`, a ``ProcessGroup`` (registered here if it is not yet), or None for the
    current registered group. Make a new cache for every ``generate`` call.
    """
    if group is not None and not isinstance(group, DistGroup):
        group = register_group(group)
    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    return hf_sharded_cache_class()(cfg.num_hidden_layers, group)


def hf_sharded_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, *,
                         plan: Any = None, **kwargs):
    """A ``transformers.AttentionInterface`` function for models using ``ShardedDynamicCache``.

    Decode steps (q_len <= 16) run :func:`tree_decode` (or :func:`ring_decode` for a ``RingPlan``) over the local
    shard; prefill runs SDPA over the full prompt K/V that the cache returned. Register it with
    :func:`register_hf_attention` and load/set the model with ``attn_implementation="attnopt_sharded"``.

    Returns
    -------
    (attn_output (B, L, Hq, Dv), None), as every HF attention function.
    """
    import torch.nn.functional as F

    from attnopt.plan import RingPlan, TreePlan

    g = current_group()
    L = query.shape[2]
    layer = getattr(module, "layer_idx", None)
    full = L > DECODE_MAX_Q_LEN or (g.cache is not None and layer is not None and layer < len(g.cache.returned_full)
                                    and g.cache.returned_full[layer])
    if full:  # the prompt, over the whole prompt's K/V (the cache returned them all)
        causal = attention_mask is None and L == key.shape[2]
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                             is_causal=causal, enable_gqa=query.shape[1] != key.shape[1])
        return out.transpose(1, 2).contiguous(), None
    plan = plan or g.hf_plan or TreePlan(world=g.world)
    mask = adapt_mask(g, attention_mask, key)
    if mask is None and L > 1 and g.cache is not None:
        mask = g.cache.causal_mask(L, query.device)
    if isinstance(plan, RingPlan):
        out = ring_decode(query, key, value, g, variant=plan.variant, attn_mask=mask, scale=scaling,
                          shard_lens=g.cache.shard_lens() if g.cache is not None else None)
    else:
        out = tree_decode(query, key, value, g, collective=plan.collective, hierarchical=plan.hierarchical,
                          attn_mask=mask, scale=scaling, local=plan.local)
    return out.transpose(1, 2).contiguous(), None


def register_hf_shard_aware(model) -> str:
    """Register ``attnopt_shard_aware_<base>``: HF's ``base`` attention ("sdpa" or "eager") with the mask
    first cut to this rank's key columns when the keys are a shard (``torch.ops.attnopt.shard_mask_columns``).

    ``attnopt.optimize(model, process_group=...)`` switches the model to it. The mask HF builds follows the global
    key positions while a sharded cache hands attention the local keys; cut in the traced graph, the decode
    attention stays a well-formed SDPA over (local keys, local mask) that the pass rewrites into tree / ring
    decode. Without a shard (mask columns == keys) it is ``base`` itself, so an unsharded model is unchanged.
    """
    import sys

    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    from .. import ops  # noqa: F401  (defines torch.ops.attnopt.shard_mask_columns)

    base = model.config._attn_implementation
    if base.startswith("attnopt_shard_aware_"):
        return base
    if base == "sdpa":
        from transformers.integrations.sdpa_attention import sdpa_attention_forward as base_fn
    elif base == "eager":
        # Each HF model file has its own eager attention (some add softcapping or sinks): use the model's.
        base_fn = getattr(sys.modules[type(model).__module__], "eager_attention_forward", None)
        if base_fn is None:
            raise ValueError(f"{type(model).__name__}: no eager_attention_forward in {type(model).__module__}; "
                             "load the model with attn_implementation='sdpa' for distributed decode")
    else:
        raise ValueError(f"distributed decode through attnopt.optimize supports the 'sdpa' and 'eager' attention "
                         f"implementations, not {base!r}")
    name = f"attnopt_shard_aware_{base}" if base == "sdpa" else f"attnopt_shard_aware_eager_{type(model).__module__}"

    def shard_aware(module, query, key, value, attention_mask, *args, **kwargs):
        if attention_mask is not None and attention_mask.shape[-1] != key.shape[-2]:
            attention_mask = torch.ops.attnopt.shard_mask_columns(attention_mask, key.shape[-2])
        return base_fn(module, query, key, value, attention_mask, *args, **kwargs)

    AttentionInterface.register(name, shard_aware)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])
    return name


def register_hf_attention(name: str = "attnopt_sharded") -> str:
    """Register :func:`hf_sharded_attention` (and SDPA's mask function) with transformers under ``name``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(name, hf_sharded_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, sdpa_mask)
    return name
