"""The pure-PyTorch SAAP decode: the oracle of the Triton kernel and the CPU path of the ``saap`` plan.

A query attends to exactly: the sink keys [0, sink), every key from ``indexed_end`` on (the recent window and
every token decoded since the prefill), and every key of its group's top-``probes`` clusters. Under GQA the
G query heads of a KV head (and the L query tokens of one call) pick their clusters jointly: their cluster
distributions are summed before the top-l.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..reference import attention_states
from .build import ClusterState
from .index import SaapIndex
from ..kernels.saap_rule import (SELECT_KEY_BITS, scoring_centroids, selection_keys, threshold_clusters,  # noqa: F401
                                 top_clusters)



def query_positions(n_keys: int, q_len: int, device: torch.device) -> Tensor:
    """RoPE positions of the L query tokens of a decode call over a cache of ``n_keys`` (they are its last L)."""
    return torch.arange(n_keys - q_len, n_keys, device=device)


def select_clusters(index: SaapIndex, layer: int, q: Tensor, positions: Tensor, probes: int, scale: float,
                    per_token: bool = False, centroids: Tensor | None = None) -> Tensor:
    """Top-``probes`` clusters of each group: q (B, Hq, L, D) rotated at ``positions`` (L,); ``centroids``
    (Hkv, C, D): the ones refined at prefill (``ClusterState.centroids``), else the index's.

    Returns (B, Hkv, probes) int64 (scores summed over the L tokens), or (B, Hkv, L, probes) with ``per_token``.
    """
    scores = index.cluster_scores(layer, q, positions, scale, centroids)  # (B, Hkv, L, C)
    if not per_token:
        scores = scores.sum(dim=2)
    return top_clusters(scores, probes)


def attended_keys(state: ClusterState, clusters: Tensor, n_keys: int, q_len: int = 1) -> Tensor:
    """Boolean (B, Hkv, L, N): which keys each query token attends to.

    ``clusters`` is (B, Hkv, l) (shared by the L tokens) or (B, Hkv, L, l) cluster indices, or a boolean
    (B, Hkv, C) mask of the chosen clusters (as ``threshold_clusters`` gives). Token i of the call sits at
    position ``n_keys - q_len + i`` and sees no key after itself.
    """
    device = clusters.device
    if clusters.dtype == torch.bool:
        B, H, _ = clusters.shape
        L = q_len
        chosen = clusters[:, :, None, :].expand(-1, -1, L, -1)
    else:
        if clusters.dim() == 3:
            clusters = clusters[:, :, None, :].expand(-1, -1, q_len, -1)
        B, H, L, _ = clusters.shape
        chosen = torch.zeros((B, H, L, state.num_clusters), dtype=torch.bool, device=device)
        chosen.scatter_(-1, clusters, True)
    owner = state.cluster_of_positions(n_keys)  # (B, H, N), -1 = always attended
    picked = chosen.gather(-1, owner.clamp(min=0)[:, :, None, :].expand(-1, -1, L, -1))
    keep = torch.where(owner[:, :, None, :] < 0, True, picked)
    cols = torch.arange(n_keys, device=device)
    rows = torch.arange(n_keys - L, n_keys, device=device)
    return keep & (cols[None, :] <= rows[:, None])


def selectivity(keep: Tensor, valid_len: Tensor | None = None) -> Tensor:
    """Mean fraction of the visible keys attended, over (B, Hkv, L): a 0-d fp32 tensor."""
    n = keep.shape[-1]
    L = keep.shape[-2]
    visible = torch.arange(n - L + 1, n + 1, device=keep.device, dtype=torch.float32)  # causal key count per token
    if valid_len is not None:
        visible = torch.minimum(visible, valid_len.float().view(-1, 1, 1))
    return (keep.float().sum(-1) / visible).mean()


def saap_decode_states(q: Tensor, k: Tensor, v: Tensor, keep: Tensor, scale: float,
                       valid_len: Tensor | None = None, attn_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Softmax state over exactly the keys ``keep`` (B, Hkv, L, N) marks: q (B, Hq, L, D), k/v (B, Hkv, N, D);
    an ``attn_mask`` (bool or additive, broadcastable to (B, Hq, L, N)) removes keys as well.

    Returns o (B, Hq, L, Dv) fp32 and lse (B, Hq, L) fp32 (natural log).
    """
    B, Hq, L, _ = q.shape
    G = Hq // k.shape[1]
    mask = keep.repeat_interleave(G, dim=1)  # (B, Hq, L, N): query head h reads KV head h // G
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        mask = mask & attn_mask
    elif attn_mask is not None:  # additive: keep its values on the attended keys
        mask = attn_mask.expand(B, Hq, L, k.shape[2]).masked_fill(~mask, float("-inf"))
    return attention_states(q, k, v, attn_mask=mask, valid_len=valid_len, scale=scale)


def saap_decode(index: SaapIndex, layer: int, state: ClusterState, q: Tensor, k: Tensor, v: Tensor, probes: int,
                scale: float, valid_len: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Reference SAAP decode of one layer. Returns (o (B, Hq, L, Dv) in q's dtype, lse fp32, selectivity)."""
    N, L = k.shape[2], q.shape[2]
    clusters = select_clusters(index, layer, q, query_positions(N, L, q.device), probes, scale,
                               centroids=state.centroids)
    keep = attended_keys(state, clusters, N, L)
    o, lse = saap_decode_states(q, k, v, keep, scale, valid_len)
    return o.to(q.dtype), lse, selectivity(keep, valid_len)


def kernel_scorer(index: SaapIndex, layer: int):
    """The Triton scoring weights (``runtime.kernels.saap_select.SaapScorer``) of one layer, on the index's device:
    the centroids as the rule rounds them (``scoring_centroids``), the RoPE inverse frequencies (None for an index
    over rotated keys) and the MLP as the rule scores with it (``saap_rule.scoring_mlp``: BatchNorm folded, bf16)."""
    from ..kernels.saap_rule import ScoringMLP
    from ..kernels.saap_select import SaapScorer

    li = index.layers[layer]
    device = li.centroids.device
    inv_freq = None if index.rotated else index.rope.inv_freq(device).contiguous()
    mlp = None if li.mlp is None else ScoringMLP(*(t.to(device) for t in li.scoring_mlp(index.bn_eps)))
    return SaapScorer(scoring_centroids(li.centroids), inv_freq, mlp)
