"""How should SAAP score clusters and spend its key budget per layer? An offline screening on a collection.

On a collection written by ``attnopt saap collect`` (keys of every position, queries of sampled positions), k-means
is fitted on every sequence but the held-out one, per layer, KV head and cluster count, over the rotated or the
de-roped keys; for the last recorded queries of the held-out sequence each scheme attends sink + window + whole
clusters, and the dense softmax mass of what it attends (the recall) is measured against its measured selectivity
(attended keys over visible keys). Probe counts are swept, so each (layer, window, C, scorer) gives a curve.

Scorers (how a query ranks the clusters; a GQA group's distributions are summed, as at decode):

* ``centroids``: softmax of ``scale * q . c`` (the training-free baseline the decode kernel implements);
* ``oracle``: the true attention mass of each cluster (the bound of any query model over the partition);
* ``topk``: not clusters: the indexed keys of most true mass (the bound of any sparse selection).

Reported: mean recall over the layers at a common probe count (what one ``saap_probes`` gives, as measured
selectivity), and with a per-layer allocation (``allocate``: each layer its own window and probes, greedy on the
marginal recall per attended key, to the same mean selectivity), which is what ``SaapIndex.layer_budgets`` stores.

Usage: python benchmarks/saap_quality_scoring.py COLLECTION [--clusters 256,512,1024] [--target 0.069] ...
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from attnopt.runtime.saap.build import assign_keys, fit_to_prompt
from attnopt.runtime.saap.collect import Collection
from attnopt.runtime.saap.rope import apply_rope
from attnopt.runtime.saap.train import kmeans

sys.path.insert(0, str(Path(__file__).parent))  # its sibling, also when loaded by path (tests)
from saap_quality_partition import heldout_split  # noqa: E402

SCORERS = ("centroids", "oracle")


def layer_curves(coll: Collection, layer: int, clusters: list[int], windows: list[int], probe_fractions: list[float],
                 queries: int, sink: int, rotated: bool, iterations: int, heldout: int = -1,
                 refine: int = 0) -> dict:
    """{(scorer, C, window): [(selectivity, recall), ...] over the probe sweep} plus ("topk", window) curves."""
    rope, ident = coll.rope, coll.identity
    Hkv, G = ident.num_kv_heads, ident.num_q_heads // ident.num_kv_heads
    scale = 1 / math.sqrt(ident.head_dim)
    held, others, m_keep, pos, N = heldout_split(coll, heldout, queries)
    kd = held.keys[layer][:, :N]
    k = apply_rope(kd, torch.arange(N), rope)
    q = apply_rope(held.queries[layer][:, m_keep], pos, rope)  # (Hq, M, D)
    s = torch.einsum("hmd,hnd->hmn", q, k.repeat_interleave(G, 0)) * scale
    cols = torch.arange(N)
    s = s.masked_fill(cols[None, None, :] > pos[None, :, None], float("-inf"))
    probs = torch.softmax(s, dim=-1)  # (Hq, M, N)
    gmass = probs.reshape(Hkv, G, *probs.shape[1:]).sum(1)  # (Hkv, M, N): the group's summed mass
    visible = (pos + 1).float()
    out: dict = {}

    def measure(keep: torch.Tensor) -> tuple[float, float]:
        rec = float((gmass * keep).sum(-1).mean()) / G
        sel = float((keep.sum(-1).float() / visible).mean())
        return round(sel, 5), round(rec, 5)

    train = [s.keys[layer] for s in others]
    if rotated:
        train = [apply_rope(t, torch.arange(t.shape[1]), rope) for t in train]
    train = torch.cat([t[:, sink:] for t in train], dim=1)
    held_keys = k if rotated else kd
    for C in clusters:
        cents = torch.stack([kmeans(train[h], C, iterations, h) for h in range(Hkv)])  # (Hkv, C, D)
        if refine:  # fitted to the held-out sequence's own keys, from the trained centroids (as at prefill)
            fitted, cents = fit_to_prompt(cents, held_keys[None, :, sink:], refine)
            assign = torch.cat([assign_keys(cents, held_keys[None, :, :sink])[0], fitted[0]], dim=1)
        else:
            assign = assign_keys(cents, held_keys[None])[0]  # (Hkv, N)
        qs = q if rotated else held.queries[layer][:, m_keep]
        logits = torch.einsum("hmd,hcd->hmc", qs, cents.repeat_interleave(G, 0)) * scale
        cent_score = torch.softmax(logits, -1).reshape(Hkv, G, queries, C).sum(1)  # (Hkv, M, C)
        for W in windows:
            always = (cols[None, :] < sink) | ((cols[None, :] > pos[:, None] - W) & (cols[None, :] <= pos[:, None]))
            indexed = (cols[None, :] >= sink) & (cols[None, :] <= pos[:, None] - W)  # (M, N)
            owner = assign[:, None, :].expand(Hkv, queries, N)
            oracle = torch.zeros(Hkv, queries, C).scatter_add_(-1, owner, gmass * indexed[None])
            for name, score in (("centroids", cent_score), ("oracle", oracle)):
                order = score.argsort(-1, descending=True)
                rank = torch.empty_like(order).scatter_(-1, order, torch.arange(C).expand_as(order).contiguous())
                rank_of_key = rank.gather(-1, owner)  # (Hkv, M, N)
                curve = []
                for l in sorted({max(1, round(f * C)) for f in probe_fractions}):
                    keep = always[None] | ((rank_of_key < l) & indexed[None])
                    curve.append((l, *measure(keep)))
                out[(name, C, W)] = curve
    for W in windows:  # the key top-k bound at the same windows, counts of keys matched to the cluster sweep
        always = (cols[None, :] < sink) | ((cols[None, :] > pos[:, None] - W) & (cols[None, :] <= pos[:, None]))
        indexed = (cols[None, :] >= sink) & (cols[None, :] <= pos[:, None] - W)
        sc = gmass.masked_fill(~indexed[None], -1.0)
        order = sc.argsort(-1, descending=True)
        rank = torch.empty_like(order).scatter_(-1, order, torch.arange(N).expand_as(order).contiguous())
        curve = []
        for f in probe_fractions:
            n = max(1, round(f * N))
            curve.append((n, *measure(always[None] | ((rank < n) & indexed[None]))))
        out[("topk", 0, W)] = curve
    return out


def interp(curve: list, x: float) -> float:
    """Recall at selectivity ``x`` on a curve of (probes, selectivity, recall) rows (linear, clamped)."""
    pts = sorted((c[1], c[2]) for c in curve)
    if x <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / max(x1 - x0, 1e-12)
    return pts[-1][1]


def uniform(curves: dict, key_of, target: float) -> tuple[float, float, object]:
    """One setting for every layer (the same window and probe count): the best mean recall at mean selectivity
    <= target, over the settings of the sweep. Returns (recall, selectivity, setting)."""
    layers = list(curves)
    best = (0.0, 0.0, None)
    settings = {(k[2], c[0]) for k in curves[layers[0]] if key_of(k) for c in curves[layers[0]][k]}
    for W, l in settings:
        pts = []
        for layer in layers:
            (k,) = [k for k in curves[layer] if key_of(k) and k[2] == W]
            row = [c for c in curves[layer][k] if c[0] == l]
            if not row:
                break
            pts.append(row[0])
        if len(pts) == len(layers):
            sel, rec = sum(p[1] for p in pts) / len(pts), sum(p[2] for p in pts) / len(pts)
            if sel <= target and rec > best[0]:
                best = (rec, sel, {"window": W, "probes": l})
    return best


def allocate(curves: dict, key_of, target: float) -> tuple[float, float, dict]:
    """Per layer its own (window, probes), greedy: start every layer at its cheapest point and repeatedly move the
    layer whose next point on its upper hull gives the most recall per unit of selectivity, until the mean
    selectivity would pass ``target``. Returns (mean recall, mean selectivity, {layer: {window, probes}})."""
    hulls = {}
    for layer, cs in curves.items():
        pts = sorted({(c[1], c[2], k[2], c[0]) for k, cur in cs.items() if key_of(k) for c in cur})
        hull = []  # the upper-left frontier: more selectivity only for more recall
        for p in pts:
            if not hull or p[1] > hull[-1][1]:
                hull.append(p)
        hulls[layer] = hull
    at = {layer: 0 for layer in hulls}
    n = len(hulls)
    total = sum(h[0][0] for h in hulls.values())
    while True:
        best, gain = None, 0.0
        for layer, h in hulls.items():
            i = at[layer]
            if i + 1 < len(h):
                d_sel, d_rec = h[i + 1][0] - h[i][0], h[i + 1][1] - h[i][1]
                if (total + d_sel) / n <= target and d_rec / max(d_sel, 1e-9) > gain:
                    best, gain = layer, d_rec / max(d_sel, 1e-9)
        if best is None:
            break
        total += hulls[best][at[best] + 1][0] - hulls[best][at[best]][0]
        at[best] += 1
    pick = {layer: hulls[layer][at[layer]] for layer in hulls}
    rec = sum(p[1] for p in pick.values()) / n
    return rec, total / n, {layer: {"window": p[2], "probes": p[3], "selectivity": p[0], "recall": p[1]}
                           for layer, p in pick.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("collection")
    ap.add_argument("--clusters", default="256,512,1024")
    ap.add_argument("--windows", default="64,128,256")
    ap.add_argument("--probe-fractions", default="0.01,0.02,0.03,0.04,0.06,0.08,0.1,0.13,0.17")
    ap.add_argument("--target", type=float, default=0.069, help="mean selectivity of the sparse layers (0.069: "
                    "10 %% over all 30 layers of SmolLM2 with layer 0 dense)")
    ap.add_argument("--queries", type=int, default=48)
    ap.add_argument("--sink", type=int, default=4)
    ap.add_argument("--layers", default="")
    ap.add_argument("--deroped", action="store_true", help="cluster the de-roped keys (the paper) instead")
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--refine", type=int, default=0, help="passes of fit_to_prompt over the held-out keys (prefill)")
    ap.add_argument("--out")
    args = ap.parse_args()
    coll = Collection.load(args.collection)
    layers = [int(x) for x in args.layers.split(",")] if args.layers else list(range(1, coll.identity.num_layers))
    Cs = [int(x) for x in args.clusters.split(",")]
    windows = [int(x) for x in args.windows.split(",")]
    fracs = [float(x) for x in args.probe_fractions.split(",")]
    curves = {}
    for layer in layers:
        t0 = time.perf_counter()
        curves[layer] = layer_curves(coll, layer, Cs, windows, fracs, args.queries, args.sink, not args.deroped,
                                     args.iterations, refine=args.refine)
        brief = {f"{k[0]}/C{k[1]}/W{k[2]}": round(interp(v, args.target), 4) for k, v in curves[layer].items()}
        print(f"layer {layer} ({time.perf_counter() - t0:.0f} s) recall at {args.target}: {brief}", flush=True)
    summary = {}
    for name in ("topk", *SCORERS):
        for C in ([0] if name == "topk" else Cs):
            def key_of(k, name=name, C=C):
                return k[0] == name and k[1] == C
            u = uniform(curves, key_of, args.target)
            a = allocate(curves, key_of, args.target)
            summary[f"{name}/C{C}"] = {"uniform": {"recall": round(u[0], 4), "selectivity": round(u[1], 4),
                                                   "setting": u[2]},
                                       "per_layer": {"recall": round(a[0], 4), "selectivity": round(a[1], 4),
                                                     "settings": a[2]}}
            print(f"{name}/C{C}: uniform recall {u[0]:.4f} at {u[1]:.4f} {u[2]}; per-layer {a[0]:.4f} at {a[1]:.4f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "summary": summary,
                       "curves": {str(l): {"/".join(map(str, k)): v for k, v in c.items()} for l, c in curves.items()}},
                      f, indent=1)


if __name__ == "__main__":
    main()
