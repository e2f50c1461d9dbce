"""Which partition and selection rule lets SAAP keep the attention mass at a fixed total key budget?

Offline, on a collection written by ``attnopt saap collect`` (de-roped keys of every position and queries of
sampled positions, per layer): for the last recorded queries of one held-out sequence, the dense softmax is
computed over the rotated keys, and each scheme gets the same key budget per query, ``target * (p + 1)``
keys (sink, window and clusters together). It reports the attention-mass recall per layer of

* ``window``: sink + a window that takes the whole budget (StreamingLLM);
* ``topk``: sink + window + the keys of most mass (the bound of any sparse selection);
* ``oracle/<partition>/<rule>``: sink + window + whole clusters ranked by their true mass (the bound of any
  query model over that partition), where the partitions are k-means over de-roped keys fitted on the other
  sequences (``deroped``; the paper), the same fitted on this sequence's own keys (``self``: k-means at
  prefill), spherical k-means, and more clusters; and the rules are ``fixed`` (the top-l clusters, l from
  the mean cluster size) and ``budget`` (clusters in order of mass until the key budget is spent).

The GQA group's heads pick jointly (``sum``, the paper) or by their largest per-head mass (``max``).
Usage: python benchmarks/saap_quality_partition.py COLLECTION [--target 0.07] [--layers 0,1,2] ...
"""
from __future__ import annotations

import argparse
import json
import math
import time
from typing import Any

import torch
from torch import Tensor

from attnopt.runtime.saap.build import assign_keys
from attnopt.runtime.saap.collect import Collection
from attnopt.runtime.saap.rope import apply_rope
from attnopt.runtime.saap.train import kmeans


def dense_probs(q, k, pos, scale):
    """q (Hq, M, D), k (Hkv, N, D) rotated, pos (M,) -> (Hq, M, N) causal softmax."""
    G = q.shape[0] // k.shape[0]
    s = torch.einsum("hmd,hnd->hmn", q, k.repeat_interleave(G, 0)) * scale
    cols = torch.arange(k.shape[1])
    s = s.masked_fill(cols[None, None, :] > pos[None, :, None], float("-inf"))
    return torch.softmax(s, dim=-1)


def recall_of(probs, keep):
    """probs (Hq, M, N), keep (Hkv, M, N) bool -> mean recall over heads and queries."""
    G = probs.shape[0] // keep.shape[0]
    return float((probs * keep.repeat_interleave(G, 0)).sum(-1).mean())


def base_keep(N, pos, sink, window):
    """(M, N) bool: sink and the last ``window`` keys up to each query; (M, N) bool: the indexed keys."""
    cols = torch.arange(N)[None, :]
    p = pos[:, None]
    always = (cols < sink) | ((cols > p - window) & (cols <= p))
    indexed = (cols >= sink) & (cols <= p - window)
    return always, indexed


def group_mass(probs, Hkv, how):
    G = probs.shape[0] // Hkv
    g = probs.reshape(Hkv, G, *probs.shape[1:])
    return g.sum(1) if how == "sum" else g.amax(1)


def select_keys(score, indexed, always, budget):
    """Per (h, m): always-attended keys plus the indexed keys of highest ``score`` up to ``budget`` (M,) keys."""
    Hkv, M, N = score.shape
    extra = (budget - always.sum(-1)).clamp(min=0)  # (M,)
    s = score.masked_fill(~indexed[None], -1.0)
    order = s.argsort(dim=-1, descending=True)
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(N).expand_as(order).contiguous())
    return always[None] | ((rank < extra[None, :, None]) & indexed[None])


def cluster_keep(mass, assign_row, indexed, always, budget, rule, mean_size):
    """Whole clusters ranked by ``mass`` (Hkv, M, C); assign_row (Hkv, N) cluster of each key."""
    Hkv, M, C = mass.shape
    N = assign_row.shape[1]
    owner = assign_row[:, None, :].expand(Hkv, M, N)
    member = indexed[None] & torch.ones(Hkv, M, N, dtype=torch.bool)
    size = torch.zeros(Hkv, M, C).scatter_add_(-1, owner, member.float())  # indexed keys per cluster per query
    extra = (budget - always.sum(-1)).clamp(min=0).float()  # (M,)
    order = mass.argsort(dim=-1, descending=True)
    if rule == "fixed":
        l = (extra / mean_size).round().clamp(min=1).long()  # (M,)
        rank = torch.empty_like(order)
        rank.scatter_(-1, order, torch.arange(C).expand_as(order).contiguous())
        chosen = rank < l[None, :, None]
    else:  # clusters by mass until the budget is spent (the last one may overrun it, whole clusters only)
        sizes_sorted = size.gather(-1, order)
        before = sizes_sorted.cumsum(-1) - sizes_sorted
        take_sorted = before < extra[None, :, None]
        chosen = torch.zeros_like(take_sorted).scatter_(-1, order, take_sorted)
    picked = chosen.gather(-1, owner)
    keep = always[None] | (picked & indexed[None])
    return keep


def cluster_mass(gmass, assign_row, indexed, C):
    """gmass (Hkv, M, N) -> (Hkv, M, C) mass per cluster over the indexed keys."""
    Hkv, M, N = gmass.shape
    owner = assign_row[:, None, :].expand(Hkv, M, N)
    return torch.zeros(Hkv, M, C).scatter_add_(-1, owner, gmass * indexed[None])


PARTITIONS = ("deroped", "self", "rotated", "rotated-self", "spherical", "blocks")


def partitions(held: Tensor, others: list[Tensor], C: int, sink: int, iterations: int, rope,
               names: tuple[str, ...] = PARTITIONS) -> dict[str, Tensor]:
    """Each partition's cluster of every key: held (Hkv, N, D) de-roped keys of the evaluated sequence, others
    the de-roped keys of the training sequences -> name -> (Hkv, N) int64, for the partitions ``names``."""
    Hkv, N, _ = held.shape
    rot = apply_rope(held, torch.arange(N), rope)
    train = torch.cat([s[:, sink:] for s in others], dim=1)
    train_rot = torch.cat([apply_rope(s, torch.arange(s.shape[1]), rope)[:, sink:] for s in others], dim=1)
    unit = torch.nn.functional.normalize

    def fit(x: Tensor) -> Tensor:
        return torch.stack([kmeans(x[h], C, iterations, h) for h in range(Hkv)])

    block = max(1, (N - sink) // C)
    make = {
        "deroped": lambda: assign_keys(fit(train), held[None])[0],  # the paper: k-means on de-roped training keys
        "self": lambda: assign_keys(fit(held[:, sink:]), held[None])[0],  # the same, fitted at prefill on the prompt
        "rotated": lambda: assign_keys(fit(train_rot), rot[None])[0],  # the keys as the cache holds them
        "rotated-self": lambda: assign_keys(fit(rot[:, sink:]), rot[None])[0],
        "spherical": lambda: assign_keys(unit(fit(unit(train, dim=-1)), dim=-1), unit(held, dim=-1)[None])[0],
        "blocks": lambda: ((torch.arange(N) - sink).clamp(min=0) // block).clamp(max=C - 1).expand(Hkv, N),
    }
    unknown = set(names) - set(make)
    if unknown:
        raise ValueError(f"unknown partition(s) {', '.join(sorted(unknown))}; valid: {', '.join(PARTITIONS)}")
    return {name: make[name]() for name in names}


def heldout_split(coll: Collection, heldout: int, queries: int):
    """(held-out sequence, the others, indices of its last ``queries`` recorded queries, their positions (M,),
    keys up to the last of them N)."""
    held = coll.sequences[heldout]
    others = [s for i, s in enumerate(coll.sequences) if i != heldout % len(coll.sequences)]
    m_keep = torch.arange(held.query_positions.numel())[-queries:]
    pos = held.query_positions[m_keep]
    return held, others, m_keep, pos, int(pos.max()) + 1


def study(coll: Collection, target: float, sink: int = 4, window_fraction: float = 1 / 64, queries: int = 64,
          layers: list[int] | None = None, clusters: tuple[int, ...] = (128,), heldout: int = -1,
          iterations: int = 10, names: tuple[str, ...] = PARTITIONS,
          log: bool = False) -> tuple[dict[int, dict], dict]:
    """Recall of attention mass per layer and scheme (see the module docstring); returns (per layer, mean).

    A cluster scheme's value is (recall, measured selectivity over the visible keys); the others' a recall."""
    rope, ident = coll.rope, coll.identity
    Hkv = ident.num_kv_heads
    scale = 1 / math.sqrt(ident.head_dim)
    held, others, m_keep, pos, N = heldout_split(coll, heldout, queries)
    budget = (target * (pos + 1).float()).round()
    window = max(16, round(N * window_fraction))
    always, indexed = base_keep(N, pos, sink, window)
    table = {}
    for layer in layers if layers is not None else range(ident.num_layers):
        t0 = time.perf_counter()
        kd = held.keys[layer][:, :N]  # de-roped
        k = apply_rope(kd, torch.arange(N), rope)
        probs = dense_probs(apply_rope(held.queries[layer][:, m_keep], pos, rope), k, pos, scale)
        row: dict[str, Any] = {"window": recall_of(probs, _window_keep(N, pos, sink, budget)[None])}
        gms = {how: group_mass(probs, Hkv, how) for how in ("sum", "max")}
        for how, gm in gms.items():
            row[f"topk/{how}"] = recall_of(probs, select_keys(gm, indexed, always, budget))
        for C in clusters:
            parts = partitions(kd, [s.keys[layer] for s in others], C, sink, iterations, rope, names)
            mean_size = float(indexed.sum(-1).float().mean()) / C
            for name, assign in parts.items():
                for how, rule in (("sum", "fixed"), ("sum", "budget"), ("max", "budget")):
                    mass = cluster_mass(gms[how], assign, indexed, C)
                    keep = cluster_keep(mass, assign, indexed, always, budget, rule, mean_size)
                    sel = float((keep.sum(-1).float() / (pos + 1).float()).mean())
                    row[f"oracle/{name}/C{C}/{how}/{rule}"] = (round(recall_of(probs, keep), 4), round(sel, 4))
        table[layer] = row
        if log:
            print(f"layer {layer} ({time.perf_counter() - t0:.0f} s): " +
                  ", ".join(f"{k}={v if isinstance(v, tuple) else round(v, 4)}" for k, v in row.items()), flush=True)
    mean = {}
    for key in next(iter(table.values())):
        vals = [table[l][key] for l in table]
        mean[key] = (round(sum(v[0] for v in vals) / len(vals), 4), round(sum(v[1] for v in vals) / len(vals), 4)) \
            if isinstance(vals[0], tuple) else round(sum(vals) / len(vals), 4)
    return table, {"N": N, "window": window, "mean": mean}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("collection")
    ap.add_argument("--target", type=float, default=0.07, help="keys per query over its visible keys (0.07: 10 %% "
                    "over all 30 layers of SmolLM2 with layer 0 dense)")
    ap.add_argument("--sink", type=int, default=4)
    ap.add_argument("--window-fraction", type=float, default=1 / 64)
    ap.add_argument("--queries", type=int, default=64, help="last recorded queries of the held-out sequence")
    ap.add_argument("--layers", default="", help="comma-separated (default all)")
    ap.add_argument("--clusters", default="128,512")
    ap.add_argument("--heldout", type=int, default=-1, help="which sequence is evaluated (default the last)")
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--partitions", default=",".join(PARTITIONS), help="comma-separated (default all)")
    ap.add_argument("--out")
    args = ap.parse_args()
    coll = Collection.load(args.collection)
    layers = [int(x) for x in args.layers.split(",")] if args.layers else None
    table, info = study(coll, args.target, args.sink, args.window_fraction, args.queries, layers,
                        tuple(int(x) for x in args.clusters.split(",")), args.heldout, args.iterations,
                        tuple(x for x in args.partitions.split(",") if x), log=True)
    print("mean over layers:")
    for k, v in info["mean"].items():
        print(f"  {k}: {v}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"target": args.target, "sink": args.sink, "collection": args.collection, **info,
                       "layers": table}, f, indent=1)


def _window_keep(N, pos, sink, budget):
    cols = torch.arange(N)[None, :]
    p = pos[:, None]
    w = (budget - sink).clamp(min=1)[:, None]
    return (cols < sink) | ((cols > p - w) & (cols <= p))


if __name__ == "__main__":
    main()
