"""Tree decode (Tree Attention, arXiv:2408.04093): local attention over this rank's shard, one tree collective of
the softmax states, and a local merge. The collective is one of ``TREE_COLLECTIVES``:

- ``all_gather``: one all-gather of the packed [o | m | log l] state, then a local merge;
- ``all_reduce``: an all-reduce(MAX) of the row max m, then one all-reduce(SUM) of the packed [num | den]
  (num = o * w, den = w with w = exp(m - max + log l));
- ``all_reduce3``: the paper's baseline, all-reduce(MAX), all-reduce(SUM) of num, all-reduce(SUM) of den;

The row max and log l travel apart (see ``local.py``): next to a row max near -3.4e38 (a row that finfo.min hides)
a whole LSE loses log l and would weigh every rank alike instead of by its key count.

and a hierarchical form (the same collective inside each node, then across nodes) for multi-node groups. Each
returns the exact state over the whole sequence. On NCCL the flat all-gather form replays from a CUDA graph
(``graphs.py``).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from .graphs import _replayed_combine, _replayed_step, step_graph_reason
from .checks import DTYPE_CODES, check_shapes_once, decode_signature
from .groups import DistGroup, DistributedDecodeError, current_group
from .local import PACKED_EXTRA, _merge_parts, _pack, local_states, merge_packed

#: Tree collective variants (``TreePlan.collective``).
TREE_COLLECTIVES = ("all_gather", "all_reduce", "all_reduce3")


def _packed_buffer(g: DistGroup, key, o: Tensor) -> Tensor:
    return g.buffer(key, o.shape[:-1] + (o.shape[-1] + PACKED_EXTRA,), torch.float32, o.device)


def _tree_all_gather(g: DistGroup, o: Tensor, m: Tensor, log_l: Tensor, pg, size: int, tag: str,
                     out_dtype: torch.dtype | None = None, with_lse: bool = True, split_lse: bool = False):
    """All-gather of the packed states and their merge: (o, lse or None), or with ``split_lse`` (o fp32, m, log l)
    for a later stage."""
    # the pack converts o (any float dtype) to fp32 on the way: no separate conversion op
    packed = _pack(o, m, log_l, _packed_buffer(g, ("pack", tag), o))
    parts = g.buffer(("gather", tag), (size,) + tuple(packed.shape), torch.float32, o.device)
    g.all_gather(parts, packed, pg=pg, what=f"tree all_gather[{tag}]")
    if split_lse:
        return merge_packed(parts, split_lse=True)
    return _merge_parts(parts, out_dtype, with_lse)


def _num_den(o: Tensor, m: Tensor, log_l: Tensor, m_max: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Scale a state to the global max: (safe max, num = o * w, den = w) with w = exp(m - max + log l): the
    difference of the maxima first, so that log l is not lost next to a huge max."""
    safe = torch.where(torch.isneginf(m_max), torch.zeros_like(m_max), m_max)
    w = torch.exp((m - safe) + log_l)
    return safe, o * w.unsqueeze(-1), w


def _finish(num: Tensor, den: Tensor, safe_max: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(o, m, log l) of the summed state: empty rows give (0, -inf, -inf)."""
    empty = den == 0
    o = num / torch.where(empty, torch.ones_like(den), den).unsqueeze(-1)
    m = torch.where(empty, torch.full_like(den, float("-inf")), safe_max)
    return o, m, torch.log(den)


def _tree_all_reduce(g: DistGroup, o: Tensor, m: Tensor, log_l: Tensor, pg, tag: str):
    m_max = g.buffer(("max", tag), m.shape, torch.float32, m.device)
    m_max.copy_(m)
    g.all_reduce(m_max, dist.ReduceOp.MAX, pg=pg, what=f"tree all_reduce(max)[{tag}]")
    safe, num, den = _num_den(o, m, log_l, m_max)
    packed = g.buffer(("numden", tag), o.shape[:-1] + (o.shape[-1] + 1,), torch.float32, o.device)
    packed[..., :-1].copy_(num)
    packed[..., -1].copy_(den)
    g.all_reduce(packed, dist.ReduceOp.SUM, pg=pg, what=f"tree all_reduce(sum [num|den])[{tag}]")
    return _finish(packed[..., :-1], packed[..., -1], safe)


def _tree_all_reduce3(g: DistGroup, o: Tensor, m: Tensor, log_l: Tensor, pg, tag: str):
    m_max = m.clone()
    g.all_reduce(m_max, dist.ReduceOp.MAX, pg=pg, what=f"tree all_reduce(max)[{tag}]")
    safe, num, den = _num_den(o, m, log_l, m_max)
    num = num.contiguous()
    den = den.contiguous()
    g.all_reduce(num, dist.ReduceOp.SUM, pg=pg, what=f"tree all_reduce(sum num)[{tag}]")
    g.all_reduce(den, dist.ReduceOp.SUM, pg=pg, what=f"tree all_reduce(sum den)[{tag}]")
    return _finish(num, den, safe)


def combine_tree(o: Tensor, lse: Tensor, group: DistGroup, collective: str = "all_gather",
                 hierarchical: bool = False, *, log_l: Tensor | None = None, out_dtype: torch.dtype | None = None,
                 with_lse: bool = True, check_shapes: bool = True) -> tuple[Tensor, Tensor | None]:
    """Combine every rank's local state into the global one with a tree collective.

    Parameters
    ----------
    o : (B, Hq, L, Dv) local output (float32, or any float dtype); lse : (B, Hq, L) float32 local LSE (-inf
        for an empty shard), or with ``log_l`` the local row max m.
    log_l : (B, Hq, L) float32 local log l (lse = m + log l; -inf for an empty shard), or None. Pass it (from
        ``local_states(..., split_lse=True)``) for exact weights where a row's max is huge (a row that finfo.min
        hides); without it, lse is taken as m with log l = 0.
    collective : one of ``TREE_COLLECTIVES``.
    hierarchical : reduce inside each node first, then across nodes (needs a multi-node group).
    out_dtype : dtype of the returned o (default float32); the single-stage all-gather merge writes it directly.
    with_lse : False skips the merged LSE (returned as None) where the merge can skip it.
    check_shapes : compare the shapes, dtype and collective across ranks before the first collective of a new
        signature (``checks.check_shapes_once``); :func:`tree_step` passes False (its caller checked).

    Returns
    -------
    (o (B, Hq, L, Dv), lse (B, Hq, L) float32 or None) of the whole sequence, identical on every rank.
    """
    if collective not in TREE_COLLECTIVES:
        raise ValueError(f"unknown tree collective {collective!r}; valid: {', '.join(TREE_COLLECTIVES)}")
    if hierarchical and group.nodes <= 1:
        raise DistributedDecodeError(f"hierarchical tree decode needs more than one node; {group.describe()}")
    if check_shapes:
        dims = list(o.shape) if o.dim() == 4 else [-1] * 4
        check_shapes_once(group, "combine_tree", dims + [list(lse.shape) == list(o.shape[:-1]),
                                                         DTYPE_CODES.get(o.dtype, 0), TREE_COLLECTIVES.index(collective),
                                                         hierarchical])
    if collective == "all_gather" and group.world > 1 and not (hierarchical and group.ranks_per_node > 1):
        # the decode hot path: pack (converting o), one all-gather, one merge launch writing out_dtype; on NCCL
        # the all-gather and merge are replayed from a CUDA graph
        log_l = torch.zeros_like(lse) if log_l is None else log_l
        replayed = _replayed_combine(group, o, lse, log_l, out_dtype, with_lse)
        if replayed is not None:
            return replayed
        return _tree_all_gather(group, o, lse, log_l, group.pg, group.world, "world", out_dtype, with_lse)
    o = o.float().contiguous()
    m = lse.float().contiguous()
    log_l = torch.zeros_like(m) if log_l is None else log_l.float().contiguous()
    if group.world == 1:
        return (o.to(out_dtype) if out_dtype is not None else o), m + log_l
    if hierarchical and group.ranks_per_node > 1:
        stages = [(group.intra, group.ranks_per_node, "intra"), (group.inter, group.nodes, "inter")]
    else:
        stages = [(group.pg, group.world, "world")]
    for pg, size, tag in stages:
        if collective == "all_gather":
            o, m, log_l = _tree_all_gather(group, o, m, log_l, pg, size, tag, split_lse=True)
        elif collective == "all_reduce":
            o, m, log_l = _tree_all_reduce(group, o, m, log_l, pg, tag)
        else:
            o, m, log_l = _tree_all_reduce3(group, o, m, log_l, pg, tag)
    return (o.to(out_dtype) if out_dtype is not None else o), m + log_l


def tree_decode(q: Tensor, k: Tensor, v: Tensor, group: DistGroup | None = None, *, collective: str = "all_gather",
                hierarchical: bool = False, attn_mask: Tensor | None = None, valid_len: Tensor | None = None,
                scale: float | None = None, is_causal: bool = False, local: str = "auto",
                return_lse: bool = False, check_shapes: bool = True):
    """Tree decode: local attention over this rank's shard, one tree collective, local merge.

    Parameters
    ----------
    q : (B, Hq, L, D), the same on every rank. k : (B, Hkv, n, D), v : (B, Hkv, n, Dv): the local shard
        (n may differ across ranks, 0 included).
    attn_mask, valid_len : local coordinates (see module docstring).
    is_causal : top-left causal over *local* key indices; for global positions pass a mask from
        :meth:`ShardedKVCache.local_mask` instead.
    check_shapes : before the first collective of a new shape, the ranks compare their shapes, dtypes and
        collective (one small all-gather with the group's timeout) and raise :class:`DistributedDecodeError` on
        every rank on a mismatch.

    Returns
    -------
    (B, Hq, L, Dv) in ``q.dtype`` (and the fp32 LSE (B, Hq, L) when ``return_lse``).
    """
    g = group or current_group()
    if check_shapes:
        if collective not in TREE_COLLECTIVES:
            raise ValueError(f"unknown tree collective {collective!r}; valid: {', '.join(TREE_COLLECTIVES)}")
        check_shapes_once(g, "tree_decode", decode_signature(q, k, v) + [TREE_COLLECTIVES.index(collective),
                                                                          hierarchical])
    out, lse = tree_step(g, q, k, v, collective=collective, hierarchical=hierarchical, attn_mask=attn_mask,
                         valid_len=valid_len, scale=scale, is_causal=is_causal, local=local, out_dtype=q.dtype,
                         with_lse=return_lse)
    return (out, lse) if return_lse else out


def tree_step(g: DistGroup, q: Tensor, k: Tensor, v: Tensor, *, collective: str, hierarchical: bool,
              attn_mask: Tensor | None, valid_len: Tensor | None, scale: float | None, is_causal: bool, local: str,
              out_dtype: torch.dtype, with_lse: bool) -> tuple[Tensor, Tensor | None]:
    """Local attention and the tree combine (arguments as :func:`tree_decode`, masks already local): one replayed
    graph (:class:`_StepGraph`) where ``step_graph_reason`` allows it and this step's key was seen before, else
    the ops one by one. Returns (o in ``out_dtype``, fp32 LSE or None)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if step_graph_reason(g, q, k, v, collective=collective, hierarchical=hierarchical, local=local,
                         attn_mask=attn_mask, is_causal=is_causal, valid_len=valid_len) is None:
        sk, sv, svalid, smask = k, v, valid_len, attn_mask
        if valid_len is None and g.cache is not None:
            # A sharded cache's shard grows by one token per step: the graph reads its storage with the length
            # on the device (and the mask from a buffer with the storage's columns), so one capture serves every
            # step until the storage regrows.
            sk, sv, svalid, smask = g.cache.storage_of(k, v, attn_mask) or (k, v, None, attn_mask)
        replayed = _replayed_step(g, q, sk, sv, valid_len=svalid, attn_mask=smask, is_causal=is_causal,
                                  scale=scale, out_dtype=out_dtype, with_lse=with_lse)
        if replayed is not None:
            return replayed
    o, m, log_l = local_states(q, k, v, attn_mask=attn_mask, valid_len=valid_len, scale=scale,
                               is_causal=is_causal, local=local, fp32=False, split_lse=True)
    return combine_tree(o, m, g, collective, hierarchical, log_l=log_l, out_dtype=out_dtype, with_lse=with_lse,
                        check_shapes=False)

