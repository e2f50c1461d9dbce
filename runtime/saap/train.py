"""``train``: k-means over de-roped keys (faiss) and the query MLP, per layer and KV head.

Keys: k-means with C clusters per KV head (C scales with the context, ``cluster_count``), optionally refined over
each prompt's own keys at prefill (``refine``, see ``build.fit_to_prompt``). Queries: an MLP of 2
layers (Linear -> BatchNorm -> ReLU -> Linear, hidden 1024 by default) per KV head, trained with the KL divergence
from the real attention mass per cluster. Only long-range attention counts: the mass of the keys in
[sink, position - window), which is what the window does not already cover; every query head of a group is a
training sample of its KV head's MLP, as the group's distributions are summed at decode. Layer 0 stays dense and
gets no index unless ``layers`` names it (``attnopt saap train --sparse-layer-0``).
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from .build import assign_keys
from .collect import Collection
from .index import LayerIndex, SaapIndex
from .rope import apply_rope

#: Keys per cluster the default C aims at. The paper's C = 1024 for 100k-500k keys gives 100-500; at 8k on
#: SmolLM2 finer clusters keep more attention mass at the same selectivity (4 keys a cluster: +1 to +2 points of
#: recall over 64, ``benchmarks/saap_quality_scoring.py``), up to what the selection kernel takes.
KEYS_PER_CLUSTER = 4
#: The most clusters the device selection handles (its radix select over at most 2048 scores).
MAX_CLUSTERS = 2048
#: Lloyd passes over each prompt's keys at prefill that ``attnopt saap train`` stores by default
#: (``SaapIndex.refine``, ``build.fit_to_prompt``): on the hardest layers at 8k (recall at 10 % total), none 0.910,
#: one pass (the cost of the plain assignment, scoring with the clusters' means) 0.927, two with the empty clusters
#: re-seeded between them 0.932; the 2k passkey (fewer keys than clusters) needed the second pass (CPU, 4 trials at
#: 6.5 % total: 4/4 as dense; one pass 3/4 at 9.9 %). Each pass costs one assignment of the prompt's keys.
DEFAULT_REFINE = 2


#: The decode operating point an index recommends (``SaapIndex.decode_defaults``): a sink of 4, a window of
#: 1/128 of the context and probes of 7 % of the clusters: on SmolLM2 at 8k (C = 2048, refined) the CPU screening
#: measured 8.2 % total selectivity (layer 0 dense included) at 6 % of the clusters and 10.1 % at 8 %; tokens
#: decoded after the prompt add to it.
DECODE_SINK = 4
DECODE_WINDOW_FRACTION = 1 / 128
DECODE_PROBE_FRACTION = 0.07


def decode_defaults(clusters: int, context: int) -> dict[str, int]:
    """The recommended ``probes``, ``sink`` and ``window`` of an index of ``clusters`` trained at ``context``."""
    return {"probes": max(1, round(DECODE_PROBE_FRACTION * clusters)), "sink": DECODE_SINK,
            "window": max(16, round(context * DECODE_WINDOW_FRACTION))}


def cluster_count(context: int, keys_per_cluster: int = KEYS_PER_CLUSTER) -> int:
    """C for a context length: a power of two near ``context / keys_per_cluster``, in [16, MAX_CLUSTERS]."""
    return min(MAX_CLUSTERS, max(16, 1 << max(0, round(math.log2(max(1, context / keys_per_cluster))))))


def kmeans(keys: Tensor, clusters: int, iterations: int = 10, seed: int = 0, backend: str = "auto") -> Tensor:
    """k-means (L2) of keys (n, D) -> centroids (C, D) fp32.

    ``backend`` "faiss" (CPU), "torch" (Lloyd's iterations on the keys' device: the GPU machines have no faiss,
    and the keys are already there), or "auto": faiss where it imports, else torch.
    """
    if backend not in ("auto", "faiss", "torch"):
        raise ValueError(f"unknown k-means backend {backend!r}; valid: auto, faiss, torch")
    if keys.shape[0] < clusters:
        raise ValueError(f"k-means needs at least {clusters} keys, got {keys.shape[0]}")
    if backend == "auto":
        try:
            import faiss  # noqa: F401
            backend = "faiss"
        except ImportError:
            backend = "torch"
    if backend == "torch":
        return _torch_kmeans(keys, clusters, iterations, seed)
    import faiss
    import numpy as np

    faiss.omp_set_num_threads(torch.get_num_threads())  # follow torch's thread setting
    x = np.ascontiguousarray(keys.detach().float().cpu().numpy())
    km = faiss.Kmeans(x.shape[1], clusters, niter=iterations, seed=seed, verbose=False,
                      max_points_per_centroid=max(256, x.shape[0] // clusters + 1))
    km.train(x)
    return torch.from_numpy(km.centroids.copy())


def _torch_kmeans(keys: Tensor, clusters: int, iterations: int, seed: int) -> Tensor:
    """Lloyd's k-means as faiss runs it: random distinct keys as the start, empty clusters re-seeded by
    splitting the largest one (a perturbed copy of its centroid). Returns (C, D) fp32 on the CPU."""
    x = keys.detach().float()
    gen = torch.Generator(device="cpu").manual_seed(seed)
    cents = x[torch.randperm(x.shape[0], generator=gen)[:clusters].to(x.device)].clone()
    for _ in range(iterations):
        assign = assign_keys(cents[None], x[None, None])[0, 0]  # (n,)
        sums = torch.zeros_like(cents).index_add_(0, assign, x)
        counts = torch.bincount(assign, minlength=clusters)
        empty = counts == 0
        cents = torch.where(empty[:, None], cents, sums / counts.clamp(min=1)[:, None].float())
        for c in empty.nonzero().flatten().tolist():  # rare: a host loop over the empty clusters only
            big = int(counts.argmax())
            noise = 1e-3 * cents[big].norm() * torch.randn(cents.shape[1], generator=gen).to(x.device)
            cents[c], cents[big] = cents[big] + noise, cents[big] - noise
            counts[big] //= 2
    return cents.cpu()


def long_range_targets(queries: Tensor, positions: Tensor, keys: Tensor, assign: Tensor, clusters: int, sink: int,
                       window: int, scale: float) -> tuple[Tensor, Tensor]:
    """Attention mass per cluster over the long-range keys [sink, p - window) of each query.

    Parameters
    ----------
    queries : (M, D) rotated queries at ``positions`` (M,); keys : (N, D) rotated; assign : (N - sink,) the
    clusters of keys [sink, N).

    Returns
    -------
    (M, C) fp32 distributions (rows sum to 1) and (M,) bool: which queries have any long-range key.
    """
    keys_lr = keys[sink:].float()
    scores = (queries.float() @ keys_lr.T) * scale  # (M, N - sink)
    cols = torch.arange(sink, keys.shape[0], device=keys.device)
    visible = cols[None, :] < (positions[:, None] - window)
    scores = scores.masked_fill(~visible, float("-inf"))
    has = visible.any(dim=1)
    probs = torch.softmax(torch.where(has[:, None], scores, torch.zeros_like(scores)), dim=-1) * visible
    mass = torch.zeros((queries.shape[0], clusters), device=keys.device)
    mass.scatter_add_(1, assign[None, :].expand(queries.shape[0], -1), probs)
    return mass, has


class BatchedQueryMLP(torch.nn.Module):
    """One query MLP per KV head, evaluated together: (Hkv, M, D) -> (Hkv, M, C) logits."""

    def __init__(self, heads: int, dim: int, hidden: int, clusters: int, eps: float = 1e-5, momentum: float = 0.1):
        super().__init__()
        self.eps, self.momentum = eps, momentum
        self.w1 = torch.nn.Parameter(torch.randn(heads, hidden, dim) / math.sqrt(dim))
        self.b1 = torch.nn.Parameter(torch.zeros(heads, hidden))
        self.bn_weight = torch.nn.Parameter(torch.ones(heads, hidden))
        self.bn_bias = torch.nn.Parameter(torch.zeros(heads, hidden))
        self.w2 = torch.nn.Parameter(torch.randn(heads, clusters, hidden) / math.sqrt(hidden))
        self.b2 = torch.nn.Parameter(torch.zeros(heads, clusters))
        self.register_buffer("bn_mean", torch.zeros(heads, hidden))
        self.register_buffer("bn_var", torch.ones(heads, hidden))

    def forward(self, x: Tensor) -> Tensor:
        h = torch.bmm(x, self.w1.transpose(1, 2)) + self.b1[:, None, :]
        if self.training:
            mean, var = h.mean(dim=1), h.var(dim=1, unbiased=False)
            with torch.no_grad():
                n = h.shape[1]
                self.bn_mean.lerp_(mean, self.momentum)
                self.bn_var.lerp_(var * n / max(1, n - 1), self.momentum)
        else:
            mean, var = self.bn_mean, self.bn_var
        h = (h - mean[:, None, :]) * torch.rsqrt(var[:, None, :] + self.eps)
        h = torch.relu(h * self.bn_weight[:, None, :] + self.bn_bias[:, None, :])
        return torch.bmm(h, self.w2.transpose(1, 2)) + self.b2[:, None, :]

    def export(self) -> dict[str, Tensor]:
        return {n: getattr(self, n).detach().float().cpu().clone() for n in
                ("w1", "b1", "bn_mean", "bn_var", "bn_weight", "bn_bias", "w2", "b2")}


@contextlib.contextmanager
def _progress(progress: Any) -> Iterator[Any]:
    if progress is not None:
        yield progress
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  transient=True) as bar:
        yield bar


def train_index(collection: Collection, clusters: int | None = None, hidden: int = 1024, steps: int = 300,
                batch: int = 256, lr: float = 1e-3, sink: int = 1, window: int = 64, kmeans_iterations: int = 10,
                layers: list[int] | None = None, mlp: bool = True, device: str = "cpu", seed: int = 0,
                max_queries: int | None = None, rotated: bool = False, refine: int = 0,
                progress: Any = None) -> SaapIndex:
    """Train a SAAP index from a ``Collection``.

    ``clusters`` defaults to ``cluster_count`` of the shortest sequence. ``layers`` defaults to every layer but 0.
    With ``mlp=False`` only the k-means is trained (centroid scoring, no query model).
    ``max_queries`` keeps at most that many of each sequence's recorded queries (fewer attention targets to compute).
    ``rotated`` clusters the keys as the cache holds them and feeds the MLP rotated queries (``SaapIndex.rotated``).
    ``refine``: Lloyd iterations over each prompt's keys at prefill, stored in the index (``SaapIndex.refine``).
    (The CLI's defaults are attnopt's measured configuration: rotated, no MLP, ``DEFAULT_REFINE``; this function's
    are the paper's.)
    """
    if refine < 0:
        raise ValueError(f"refine ({refine}) must be >= 0")
    ident, rope = collection.identity, collection.rope
    if not collection.sequences:
        raise ValueError("the collection holds no sequence")
    context = min(rec.length for rec in collection.sequences)
    C = clusters or cluster_count(context)
    layer_ids = layers if layers is not None else list(range(1, ident.num_layers))
    G = ident.num_q_heads // ident.num_kv_heads
    scale = 1.0 / math.sqrt(ident.head_dim)
    torch.manual_seed(seed)
    out: dict[int, LayerIndex] = {}
    with _progress(progress) as bar:
        task = bar.add_task(f"train SAAP (C={C}, hidden={hidden if mlp else 0})", total=len(layer_ids))
        for l in layer_ids:
            keys = [_keys(rec, l, rope, rotated, device)[:, sink:] for rec in collection.sequences]
            cents = torch.stack([kmeans(torch.cat([k[h] for k in keys]), C, kmeans_iterations, seed + h)
                                 for h in range(ident.num_kv_heads)])
            del keys
            model_mlp = None
            if mlp:
                xs, ts = _layer_samples(collection, l, cents, rope, sink, window, scale, G, device, max_queries,
                                        rotated)
                model_mlp = _fit_mlp(xs, ts, hidden, C, steps, batch, lr, device)
            out[l] = LayerIndex(cents, model_mlp)
            bar.advance(task)
    info = {"context": context, "clusters": C, "hidden": hidden if mlp else 0, "steps": steps if mlp else 0,
            "sink": sink, "window": window, "sequences": len(collection.sequences), "max_queries": max_queries,
            "decode": decode_defaults(C, context)}
    return SaapIndex(ident, rope, out, train_info=info, rotated=rotated, refine=refine)


def _keys(rec, layer: int, rope, rotated: bool, device: str) -> Tensor:
    """(Hkv, N, D) keys of one recorded sequence on ``device``: de-roped as recorded, or rotated back."""
    keys = rec.keys[layer].to(device)
    return apply_rope(keys, torch.arange(keys.shape[1], device=device), rope) if rotated else keys


def _layer_samples(collection: Collection, layer: int, cents: Tensor, rope, sink: int, window: int, scale: float,
                   G: int, device: str, max_queries: int | None = None,
                   rotated: bool = False) -> tuple[Tensor, Tensor]:
    """(Hkv, M, D) training queries (de-roped, or rotated with ``rotated``) and their (Hkv, M, C) long-range
    cluster-mass targets."""
    Hkv, C, _ = cents.shape
    xs, ts = [[] for _ in range(Hkv)], [[] for _ in range(Hkv)]
    for rec in collection.sequences:
        keys = rec.keys[layer].to(device)  # (Hkv, N, D) de-roped
        n = keys.shape[1]
        k_rot = apply_rope(keys, torch.arange(n, device=device), rope)
        assign = assign_keys(cents.to(device), (k_rot if rotated else keys)[None, :, sink:])[0]  # (Hkv, N - sink)
        m = rec.query_positions.numel()
        keep = torch.linspace(0, m - 1, min(m, max_queries or m)).round().long()  # spread over the positions
        pos = rec.query_positions[keep].to(device)
        q = rec.queries[layer][:, keep].to(device)  # (Hq, M, D)

        q_rot = apply_rope(q, pos, rope)
        for h in range(Hkv):
            for g in range(G):
                t, has = long_range_targets(q_rot[h * G + g], pos, k_rot[h], assign[h], C, sink, window, scale)
                xs[h].append((q_rot if rotated else q)[h * G + g][has])
                ts[h].append(t[has])
    m = min(sum(x.shape[0] for x in xs[h]) for h in range(Hkv))
    return (torch.stack([torch.cat(xs[h])[:m] for h in range(Hkv)]),
            torch.stack([torch.cat(ts[h])[:m] for h in range(Hkv)]))


def _fit_mlp(xs: Tensor, ts: Tensor, hidden: int, C: int, steps: int, batch: int, lr: float,
             device: str) -> dict[str, Tensor]:
    Hkv, M, D = xs.shape
    net = BatchedQueryMLP(Hkv, D, hidden, C).to(device)
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    # cosine decay to zero: the last steps settle instead of hopping between mini-batches
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 0.5 * (1 + math.cos(math.pi * min(i, steps) / steps)))
    net.train()
    for _ in range(steps):
        idx = torch.randint(0, M, (min(batch, M),), device=device)
        logp = F.log_softmax(net(xs[:, idx]), dim=-1)
        # KL(target || model), summed over clusters, averaged over samples and KV heads
        loss = F.kl_div(logp, ts[:, idx], reduction="sum") / (Hkv * idx.numel())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    net.eval()
    return net.export()
