"""One SmolLM2-135M decode step at 8k with SAAP against dense, through attnopt.optimize(mode="reduce-overhead").

GPU only. The model is the real GGUF (staged as ``benchmarks/gpu.sh smollm2`` does, or any path); the index is the
one ``benchmarks/saap_quality_cpu.sh`` trains (carry it: faiss is not on the GPU machines). Both methods prefill
the same random tokens into a StaticCache (SAAP's ``saap_cache(static=True)`` builds the clusters at prefill) and
time greedy decode steps (median after warm-up, each step synced). Writes JSON in the results format.

    python benchmarks/saap_smollm2_step.py --gguf /tmp/e2e/smol.gguf --index idx8k.safetensors --out saap-step.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


@torch.no_grad()
def run_method(model, ids, args, saap: dict | None) -> dict:
    import attnopt
    from attnopt.bench.e2e import prefill
    from attnopt.runtime.saap import registry
    from transformers import StaticCache

    max_len = ids.shape[1] + args.steps + args.warmup + 16
    if saap is None:
        cache = StaticCache(config=model.config, max_cache_len=max_len)
        opt = attnopt.optimize(model, mode="reduce-overhead")
    else:
        cache = registry.saap_cache(args.index, sink=saap["sink"], window=saap["window"], config=args.check_config,
                                    static=True, max_cache_len=max_len)
        opt = attnopt.optimize(model, mode="reduce-overhead", saap=args.index, saap_probes=saap["probes"],
                               saap_sink=saap["sink"], saap_window=saap["window"], force_plan="saap")
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    tok = prefill(model, cache, ids, 2048)
    sync()
    prefill_s = time.perf_counter() - t0
    times, tokens = [], [int(tok)]
    for _ in range(args.warmup + args.steps):
        sync()
        t0 = time.perf_counter()
        torch.compiler.cudagraph_mark_step_begin()
        tok = opt(input_ids=tok, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        tokens.append(int(tok))
        times.append(time.perf_counter() - t0)
    report = attnopt.last_plans(opt)
    kinds = sorted({s.chosen.kind for s in report.rewritten if s.chosen})
    row = {"method": "attnopt-ro" + ("" if saap is None else ":saap"), "context": ids.shape[1],
           "step_ms": 1e3 * statistics.median(times[args.warmup:]), "prefill_s": prefill_s, "kinds": kinds,
           "tokens": tokens}
    if saap is not None:
        measured = [registry.measured_selectivity(s.chosen.runtime_key()) for s in report.rewritten
                    if s.chosen is not None and s.chosen.kind == "saap"]
        measured = [m for m in measured if m]
        row.update(saap, selectivity=sum(m[0] for m in measured) / max(1, len(measured)))
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", required=True)
    p.add_argument("--index", required=True)
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", default="saap-smollm2-step.json")
    p.add_argument("--device", default="cuda", help="cuda (the measurement); cpu only smoke-tests the script")
    args = p.parse_args()
    from attnopt.bench.common import results_header, write_results
    from attnopt.bench.e2e import build_model
    from attnopt.runtime.saap.index import SaapIndexError, load_index

    model, desc = build_model(args.gguf, layers=None, dtype=getattr(torch, args.dtype), device=args.device,
                              max_positions=args.context + 64)
    results = results_header("saap", model=desc, context=args.context, case="smollm2-decode-step")
    args.check_config = model.config
    try:
        load_index(args.index, model.config)
    except SaapIndexError as exc:  # transformers versions may spell the config differently: time it anyway
        results["index_check"] = str(exc)
        args.check_config = None
    torch.manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (1, args.context - args.steps - args.warmup - 1), device=args.device)
    # the quality harness's 5 % and 10 % settings at 8k: (window, probes) with C = 128 clusters of about 64 keys
    settings = [None, {"target": 0.05, "sink": 4, "window": 64, "probes": 5},
                {"target": 0.10, "sink": 4, "window": 128, "probes": 10}]
    for s in settings:
        row = run_method(model, ids, args, s)
        results["rows"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "tokens"}), flush=True)
    write_results(args.out, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
