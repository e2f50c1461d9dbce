"""Build at prefill: assign the prompt's keys to the index's clusters, on the keys' device, with no host sync.

The keys from ``sink`` up to ``prompt_len - window`` are indexed; the sink before them and everything after
them (the last ``window`` prompt keys and every token decoded later) are attended densely, so new decode tokens
join the recent window and never need assigning. The result is CSR: ``offsets`` (C + 1 per KV head) into
``perm``, the indexed key positions sorted by cluster, plus ``assign`` (each indexed key's cluster), which the
pure-PyTorch reference uses.

With ``refine`` > 0 (``SaapIndex.refine``), the trained centroids are only the start: that many Lloyd passes
over the prompt's own indexed keys (all batch rows together, so one set per KV head, the shape the scorer reads,
``fit_to_prompt``) give the assignment, and decode scores with the means of the resulting clusters
(``ClusterState.centroids``; the mean key for a cluster left empty). Measured on SmolLM2 at 8k
(``benchmarks/saap_quality_scoring.py``): one pass, which costs no more than the plain assignment, brings centroid
scoring to the oracle of the trained partition, +1 to +3 points of attention-mass recall on the hardest layers
at the same selectivity.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..kernels.saap_rule import scoring_centroids
from .index import SaapIndex
from .rope import remove_rope


@dataclass
class ClusterState:
    """One layer's clusters over one batch of sequences.

    Attributes
    ----------
    offsets : (B, Hkv, C + 1) int32. Keys of cluster c are ``perm[b, h, offsets[c]:offsets[c + 1]]``.
    perm : (B, Hkv, n) int32 key positions, sorted by cluster (n = indexed_end - sink).
    assign : (B, Hkv, n) int64 cluster of the key at position ``sink + j``.
    sink : keys [0, sink) are always attended.
    indexed_end : keys [indexed_end, N) are always attended (the window and every later token).
    ends : (B,) int32 ``indexed_end`` on the device, as the kernel reads it.
    window : the window the state was built for (``indexed_end = prompt_len - window``).
    centroids : (Hkv, C, D) the centroids refined at prefill that decode scores with, in the rule's dtype
        (``saap_rule.scoring_centroids``); None when the index's own centroids are used (no refinement).
    """

    offsets: Tensor
    perm: Tensor
    assign: Tensor
    sink: int
    indexed_end: int
    ends: Tensor
    window: int = 0
    centroids: Tensor | None = None

    @property
    def num_clusters(self) -> int:
        return self.offsets.shape[-1] - 1

    def cluster_of_positions(self, n_keys: int) -> Tensor:
        """(B, Hkv, n_keys) int64: each key position's cluster, -1 for the always-attended ones."""
        B, H, n = self.assign.shape
        out = torch.full((B, H, n_keys), -1, dtype=torch.int64, device=self.assign.device)
        end = min(self.sink + n, n_keys)
        out[..., self.sink:end] = self.assign[..., :end - self.sink]
        return out

    def largest_cluster(self) -> Tensor:
        """(B, Hkv) int32 size of each head's largest cluster (device tensor)."""
        return (self.offsets[..., 1:] - self.offsets[..., :-1]).amax(dim=-1)


def assign_keys(centroids: Tensor, keys: Tensor) -> Tensor:
    """Nearest centroid (L2, as k-means trained them) of each key: centroids (Hkv, C, D), keys (B, Hkv, n, D)
    de-roped, fp32 -> (B, Hkv, n) int64. Uses ``argmax(k . c - |c|^2 / 2)``, one matmul per head."""
    c = centroids.to(keys.device, torch.float32)
    B, H, n, D = keys.shape
    C = c.shape[1]
    # -|c|^2 / 2 added in the matmul's epilogue (baddbmm): the (n, C) scores are written once and read once by the
    # argmax, not also rewritten by a subtraction (35 % less time on the CPU at 8k keys and 2048 clusters)
    neg_half = (-0.5 * (c * c).sum(-1))[None, :, None, :].expand(B, H, 1, C).reshape(B * H, 1, C)
    ct = c.transpose(1, 2)[None].expand(B, H, D, C).reshape(B * H, D, C)
    step = max(1, (1 << 26) // max(1, B * H * C))  # about 64M scores at a time (512k keys x 2048 clusters)
    out = []
    for lo in range(0, n, step):
        chunk = keys[:, :, lo:lo + step].float().reshape(B * H, -1, D)
        out.append(torch.baddbmm(neg_half, chunk, ct).argmax(dim=-1).view(B, H, -1))
    return torch.cat(out, dim=-1) if out else torch.zeros((B, H, 0), dtype=torch.int64, device=keys.device)


def fit_to_prompt(centroids: Tensor, keys: Tensor, passes: int) -> tuple[Tensor, Tensor]:
    """Fit the trained ``centroids`` (Hkv, C, D) to a prompt's ``keys`` (B, Hkv, n, D), the batch rows pooled.

    Each of ``passes`` (>= 1) assigns every key to its nearest centroid and moves each centroid to the mean of its
    keys (Lloyd's iteration; between passes a cluster left empty moves onto one of the keys farthest from their
    centroid, ``_reseed_empty``); the last pass's assignment is the result, and the centroids are then exactly the
    means of their clusters' keys, so that a query's centroid logit is its mean logit over the cluster. A cluster left
    without a key gets the mean of all the prompt's keys: it holds nothing to attend, and scoring a query's
    average logit ranks it under every cluster of above-average keys (the ones worth probing), where its trained
    centroid could outscore them (at a context shorter than C keys most clusters are empty).
    One pass costs what the plain assignment does. No host sync.

    Returns (B, Hkv, n) int64 clusters and (Hkv, C, D) fp32 centroids, on the keys' device.
    """
    if passes < 1:
        raise ValueError(f"fit_to_prompt needs at least one pass, got {passes}")
    cents = centroids.to(keys.device, torch.float32)
    B, H, n, D = keys.shape
    x = keys.float().transpose(0, 1).reshape(1, H, B * n, D)  # (1, Hkv, B * n, D): every row's keys of a head
    for i in range(passes):
        a = assign_keys(cents, x)[0]  # (Hkv, B * n)
        sums = torch.zeros_like(cents).scatter_add_(1, a[..., None].expand(-1, -1, D), x[0])
        counts = torch.zeros(cents.shape[:2], device=cents.device).scatter_add_(
            1, a, torch.ones_like(a, dtype=torch.float32))
        last = i + 1 == passes
        keep = x[0].mean(dim=1, keepdim=True).expand_as(cents) if last else cents
        new = torch.where(counts[..., None] > 0, sums / counts.clamp(min=1)[..., None], keep)
        if not last:  # as k-means does: an empty cluster takes an outlier, which would cost probes elsewhere
            new = _reseed_empty(new, counts, x[0], a)
        cents = new
    return a.view(H, B, n).transpose(0, 1), cents


def _reseed_empty(cents: Tensor, counts: Tensor, x: Tensor, a: Tensor) -> Tensor:
    """Move each empty cluster's centroid (Hkv, C, D) onto one of the keys x (Hkv, n, D) farthest from their
    centroid (a (Hkv, n) their clusters), the emptiest clusters to the farthest keys; no host sync."""
    H, C, D = cents.shape
    k = min(C, x.shape[1])
    far = (x - cents.gather(1, a[..., None].expand(-1, -1, D))).pow(2).sum(-1).topk(k, dim=1).indices  # (Hkv, k)
    emptiest = counts.argsort(dim=1)[:, :k]  # (Hkv, k): empty clusters first
    empty = counts.gather(1, emptiest) == 0
    target = torch.where(empty[..., None], x.gather(1, far[..., None].expand(-1, -1, D)),
                         cents.gather(1, emptiest[..., None].expand(-1, -1, D)))
    return cents.scatter(1, emptiest[..., None].expand(-1, -1, D), target)


def build_clusters(index: SaapIndex, layer: int, k: Tensor, prompt_len: int, sink: int, window: int,
                   start_position: int = 0, refine: int | None = None) -> ClusterState:
    """Assign the prompt's keys of one layer to its clusters.

    Parameters
    ----------
    k : (B, Hkv, N, D) rotated keys as the cache holds them (N >= prompt_len); any float dtype.
    prompt_len : keys [0, prompt_len) are the prompt. ``sink`` and ``window`` as in ``SaapPlan``.
    start_position : the RoPE position of key 0 (0 for a cache that starts with the sequence).
    refine : passes of ``fit_to_prompt`` over the prompt's keys (default ``index.refine``; 0: the index's
        centroids as they are).
    """
    if sink < 0 or window < 0:
        raise ValueError(f"sink ({sink}) and window ({window}) must be >= 0")
    refine = index.refine if refine is None else refine
    if refine < 0:
        raise ValueError(f"refine ({refine}) must be >= 0")
    B, H, N, D = k.shape
    if prompt_len > N:
        raise ValueError(f"prompt_len {prompt_len} > keys in the cache ({N})")
    end = max(sink, prompt_len - window)
    n = end - sink
    centroids = index.layers[layer].centroids
    C = centroids.shape[1]
    refined = None
    if n > 0:
        pos = torch.arange(sink, end, device=k.device) + start_position
        keys = k[:, :, sink:end].float() if index.rotated else remove_rope(k[:, :, sink:end], pos, index.rope)
        if refine:
            assign, refined = fit_to_prompt(centroids, keys, refine)
        else:
            assign = assign_keys(centroids, keys)
    else:
        assign = torch.zeros((B, H, 0), dtype=torch.int64, device=k.device)
        if refine:  # nothing to refine on: the trained centroids, as a buffer of the state's own
            refined = centroids.to(k.device, torch.float32).clone()
    state = clusters_from_assignment(assign, C, sink, window)
    # refined: the buffer the Triton scoring reads, so already in the rule's dtype (``scoring_centroids``)
    state.centroids = None if refined is None else scoring_centroids(refined)
    return state


def clusters_from_assignment(assign: Tensor, clusters: int, sink: int, window: int = 0) -> ClusterState:
    """The CSR ``ClusterState`` of ``assign`` (B, Hkv, n) int64, the cluster in [0, clusters) of key ``sink + j``;
    keys from ``sink + n`` on are the window."""
    B, H, n = assign.shape
    end = sink + n
    sorted_assign, order = torch.sort(assign, dim=-1, stable=True)
    perm = (order + sink).to(torch.int32)
    bounds = torch.arange(clusters + 1, device=assign.device, dtype=sorted_assign.dtype).expand(B, H, clusters + 1)
    offsets = torch.searchsorted(sorted_assign.contiguous(), bounds.contiguous()).to(torch.int32)
    ends = torch.full((B,), end, dtype=torch.int32, device=assign.device)
    return ClusterState(offsets=offsets, perm=perm, assign=assign, sink=sink, indexed_end=end, ends=ends,
                        window=window)
