"""End-to-end check of attnopt on the real SmolLM2-135M on a GPU (issue 3's "plugs into the pass" criterion).

For each dtype (fp32, bf16), cache (dynamic, static) and plan (the planner's choice, and each kernel plan
forced), it
1. teacher-forces the original model's greedy tokens through the original and the optimized model, and
   compares every step's logits (max abs difference, and whether the argmax agrees);
2. runs greedy ``generate`` through both and reports the first position where the tokens differ, if any;
3. checks that the sites were rewritten and executed.
With ``--baseline`` it also compares HF's eager attention with its SDPA attention the same way: how far two exact
implementations of the original drift apart in that dtype, the yardstick for the bf16 rows.
It writes one JSON in the benchmarks results format and prints a table last.

Usage: python benchmarks/gpu_e2e_smollm2.py --gguf /tmp/smol.gguf --out $OUT/e2e.json [--baseline]
       [--prompt-tokens 2000] [--device cpu]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import attnopt
from attnopt.bench.common import results_header, write_results


def load(gguf: Path, dtype: torch.dtype, attn: str, device: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=dtype,
                                                 attn_implementation=attn).to(device).eval()
    return model, tok


def make_cache(model, kind: str, max_len: int):
    from transformers import DynamicCache, StaticCache

    if kind == "dynamic":
        return DynamicCache(config=model.config)
    return StaticCache(config=model.config, max_cache_len=max_len)


@torch.no_grad()
def forced_logits(model, prompt_ids, tokens, cache_kind, max_len):
    """Logits of every step when the given tokens are fed one at a time after the prompt: (T, vocab) fp32."""
    cache = make_cache(model, cache_kind, max_len)
    out = model(input_ids=prompt_ids, past_key_values=cache, use_cache=True)
    # clone: under CUDA graphs (mode="reduce-overhead") the next replay overwrites a step's output in place
    logits = [out.logits[:, -1].float().clone()]
    for t in tokens[:-1]:
        out = model(input_ids=t.view(1, 1), past_key_values=cache, use_cache=True)
        logits.append(out.logits[:, -1].float().clone())
    return torch.cat(logits)


@torch.no_grad()
def greedy(model, prompt_ids, n, cache_kind):
    kw = {"cache_implementation": "static"} if cache_kind == "static" else {}
    out = model.generate(prompt_ids, max_new_tokens=n, do_sample=False, **kw)
    return out[0, prompt_ids.shape[1]:]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--plans", default="auto,split_kv,stream_k",
                    help="comma-separated: auto, a plan kind to force, or auto-ro (auto through inductor with "
                         "mode='reduce-overhead', the documented fast path); the others use inner_backend='eager'")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--caches", default="dynamic,static")
    ap.add_argument("--prompt-tokens", type=int, default=0,
                    help="repeat the prompt text up to this many tokens (0: the short prompt), so that decode reads a "
                         "longer cache")
    ap.add_argument("--baseline", action="store_true",
                    help="also compare HF's eager attention with its SDPA attention (the dtype's own drift)")
    ap.add_argument("--device", default="cuda", help="cuda; cpu checks the script itself (reference kernels)")
    args = ap.parse_args()

    prompt = "The history of the printing press begins"
    rows = []
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        model, tok = load(args.gguf, dtype, "sdpa", args.device)
        prompt_ids = tok(prompt, return_tensors="pt").input_ids
        if args.prompt_tokens > prompt_ids.shape[1]:
            reps = -(-args.prompt_tokens // prompt_ids.shape[1])
            prompt_ids = prompt_ids.repeat(1, reps)[:, :args.prompt_tokens]
        prompt_ids = prompt_ids.to(args.device)
        max_len = prompt_ids.shape[1] + args.tokens + 8
        baseline = load(args.gguf, dtype, "eager", args.device)[0] if args.baseline else None
        for cache_kind in args.caches.split(","):
            ref_tokens = greedy(model, prompt_ids, args.tokens, cache_kind)
            ref_logits = forced_logits(model, prompt_ids, ref_tokens, cache_kind, max_len)

            def compare(candidate, plan, optimized=True):
                """One row: ``candidate``'s teacher-forced logits and greedy tokens against the original's."""
                t0 = time.perf_counter()
                logits = forced_logits(candidate, prompt_ids, ref_tokens, cache_kind, max_len)
                toks = greedy(candidate, prompt_ids, args.tokens, cache_kind)
                elapsed = time.perf_counter() - t0
                report = attnopt.last_plans(candidate) if optimized else None
                sites, rewritten = (report.sites, report.rewritten) if report else ([], [])
                diff = (logits - ref_logits).abs()
                scale = ref_logits.abs().amax(dim=-1)
                same = toks == ref_tokens
                first_diff = None if bool(same.all()) else int((~same).nonzero()[0, 0])
                # the original's margin between its two best logits at the step where the tokens first differ
                # (both runs saw the same tokens before it): a near tie makes a flip a rounding matter
                top2 = ref_logits[first_diff].topk(2).values if first_diff is not None else None
                rows.append({
                    "case": "smollm2-135m", "prompt_tokens": int(prompt_ids.shape[1]), "dtype": dtype_name,
                    "cache": cache_kind, "plan": plan,
                    "chosen_kinds": sorted({s.chosen.kind for s in rewritten if s.chosen}),
                    "rewritten_sites": len(rewritten), "sites": len(sites), "calls": sum(s.calls for s in sites),
                    "max_abs_logit_diff": float(diff.max()), "max_rel_logit_diff": float((diff.amax(-1) / scale).max()),
                    "argmax_agree_forced": bool((logits.argmax(-1) == ref_logits.argmax(-1)).all()),
                    "greedy_identical": first_diff is None, "first_token_difference": first_diff,
                    "original_top2_margin_there": None if top2 is None else float(top2[0] - top2[1]),
                    "seconds": round(elapsed, 2),
                })
                print(json.dumps(rows[-1]), flush=True)

            if baseline is not None:
                # HF's own eager attention against its SDPA attention: how far two exact implementations of the
                # original drift apart in this dtype (the tolerance the attnopt rows are read against)
                compare(baseline, "hf-eager-attention", optimized=False)
            for plan in args.plans.split(","):
                torch._dynamo.reset()
                if plan == "auto-ro":
                    opt = attnopt.optimize(model, mode="reduce-overhead" if args.device == "cuda" else None)
                else:
                    opts = {"inner_backend": "eager"}
                    if plan != "auto":
                        opts["force_plan"] = plan
                    opt = attnopt.optimize(model, **opts)
                compare(opt, plan)
        del model, baseline
        if args.device == "cuda":
            torch.cuda.empty_cache()

    result = results_header("e2e", model="SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized)")
    result["rows"] = rows
    write_results(args.out, result)
    print(f"{'dtype':9} {'cache':8} {'N':>5} {'plan':19} {'chosen':10} {'rw/sites':9} {'calls':6} {'max|dlogit|':12} "
          f"{'greedy==':8} first_diff (margin)")
    for r in rows:
        margin = r["original_top2_margin_there"]
        print(f"{r['dtype']:9} {r['cache']:8} {r['prompt_tokens']:5d} {r['plan']:19} {','.join(r['chosen_kinds']):10} "
              f"{r['rewritten_sites']}/{r['sites']:<6} {r['calls']:<6} {r['max_abs_logit_diff']:<12.3e} "
              f"{str(r['greedy_identical']):8} {r['first_token_difference']}"
              + (f" ({margin:.3f})" if margin is not None else ""))


if __name__ == "__main__":
    main()
