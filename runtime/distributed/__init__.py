"""Sequence-parallel decode attention over a process group: the sharded KV cache, tree decode, ring decode.

The KV cache of one sequence batch is sharded along the sequence: every rank keeps a contiguous tensor of *its*
keys and values plus their global positions. A decode step computes, on every rank, the softmax state (o, lse) of
the (replicated) query over the local shard, then combines the states with a tree collective or around a ring.
Every variant returns the exact state over the whole sequence, so the result equals single-device attention up to
fp32 rounding.

One module per job, in dependency order (each imports only those above it):

=============  =================================================================================================
``groups``     the group registry, collectives with a timeout (``ATTNOPT_DIST_TIMEOUT_S``)
``checks``     cross-rank checks of world size, shapes and dtypes before a call's first collective
``watchdog``   timeouts of collectives replayed from a CUDA graph
``local``      local attention states over the shard, the merge of packed states
``graphs``     step graphs: the tree's combine, or its whole step, captured in a CUDA graph and replayed
``tree``       tree decode (all-gather, all-reduce, the paper's three all-reduces; hierarchical)
``ring``       ring decode (pass-KV, pass-Q)
``cache``      the sharded KV cache (growing storage) and global-to-local masks
``hf``         Hugging Face: the sharded ``DynamicCache``, the sharded attention, the shard-aware mask cut
=============  =================================================================================================

This package's names are importable from here (``attnopt.runtime.distributed.tree_decode``); code inside
``runtime/`` imports the module that owns a name (``from ..distributed.tree import tree_step``), so that the
strategies, which sit above ``tree``/``ring`` and below ``hf``, do not depend on this whole package.

Shapes
------
Q is (B, Hq, L, D) with L <= 16, K/V are the local shard (B, Hkv, n, D) / (B, Hkv, n, Dv), Hq = G * Hkv (query head
h reads KV head h // G). Masks and valid lengths are in *local* coordinates (columns = local keys);
:class:`ShardedKVCache` converts global ones (``local_mask``, ``local_valid_len``).
"""
from __future__ import annotations

from .cache import GrowingTensor, ShardedKVCache, adapt_mask, balanced_bounds, localize
from .graphs import MAX_STEP_GRAPHS, _graph_entry, graph_combine_enabled, step_graph_reason
from .checks import (CHECKED_CALLS, DTYPE_CODES, check_decode_shapes, check_same_across_ranks, check_shapes_once,
                     check_world, decode_signature)
from .groups import (_CURRENT, _GROUPS, DEFAULT_TIMEOUT_S, TIMEOUT_ENV, CollectiveError, DistGroup,
                     DistributedDecodeError, current_group, default_timeout_s, get_group, register_group,
                     unregister_group, use_group)
from .hf import (DECODE_MAX_Q_LEN, hf_sharded_attention, hf_sharded_cache_class, make_sharded_cache,
                 register_hf_attention, register_hf_shard_aware)
from .local import LOCAL_KINDS, PACKED_EXTRA, _merge_parts, _pack, local_states, merge_packed, merge_packed_triton
from .ring import RING_VARIANTS, ring_decode, ring_pass_kv, ring_pass_q
from .tree import TREE_COLLECTIVES, combine_tree, tree_decode, tree_step
from .watchdog import _ReplayWatchdog, thread_local_capture_mode

__all__ = [
    "TREE_COLLECTIVES", "RING_VARIANTS", "LOCAL_KINDS", "DistributedDecodeError", "CollectiveError", "DistGroup",
    "register_group", "unregister_group", "get_group", "current_group", "use_group", "local_states",
    "combine_tree", "tree_decode", "ring_decode", "ring_pass_kv", "ring_pass_q", "merge_packed",
    "ShardedKVCache", "GrowingTensor", "balanced_bounds", "adapt_mask", "hf_sharded_cache_class",
    "make_sharded_cache", "hf_sharded_attention", "register_hf_attention", "register_hf_shard_aware",
    "check_decode_shapes", "check_shapes_once", "check_world", "localize", "tree_step", "step_graph_reason",
    "default_timeout_s",
]
