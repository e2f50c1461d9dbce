"""GPU measurement: what the measured choice adds to a model's first call through ``attnopt.optimize``, SmolLM2-135M's
shape (30 layers, 9/3 heads, D=64, bf16, random weights: the first call depends on shapes, not weights) at one
context, each cache kind in a fresh process with an empty tuning cache (``--cold-triton``: and an empty Triton cache,
as a new user's first run on a machine, where inductor's own kernels compile cold too: 26-35 s for SmolLM2), through
``attnopt bench e2e --isolate``. A growing (dynamic) cache compiles twice (the first step at its prompt's length, the
second with a symbolic length, tuned per bucket) and, under ``mode="reduce-overhead"``, records a CUDA graph per new
length: give it the longer timeout.

    python benchmarks/first_call.py OUT_DIR [--context 8k] [--caches static dynamic] [--methods attnopt attnopt-ro]
                                    [--cold-triton] [--timeout 280] [--model smollm2-135m] [--device cuda]

Prints per run: the first call's seconds, attnopt's pass seconds, the inner compile's, the background tunings' wall
seconds and what the first call waited for them; then per tuned shape (30 layers must share one: one record per
shape, or per length bucket of a growing cache) its seconds, warm-up (compiles), timing and tie-break seconds, the
candidates timed and the timings taken. Writes OUT_DIR/first-<cache>-<method>.json (the e2e rows).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--context", default="8k")
    p.add_argument("--caches", nargs="+", default=["static", "dynamic"])
    p.add_argument("--methods", nargs="+", default=["attnopt"])
    p.add_argument("--timeout", type=float, default=280)
    p.add_argument("--cold-triton", action="store_true", help="an empty Triton cache per run too")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--device", default="cuda", help="cuda; cpu checks the script (no tuning there)")
    args = p.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    for cache in args.caches:
        for method in args.methods:
            out = os.path.join(args.out_dir, f"first-{cache}-{method}.json")
            env = dict(os.environ)
            if args.cold_triton:
                env["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="attnopt-first-triton-")
            cmd = [sys.executable, "-m", "attnopt.cli", "bench", "e2e", "--model", args.model, "--contexts",
                   args.context, "--methods", method, "--cache", cache, "--steps", "5", "--warmup", "2", "--isolate",
                   "--timeout", str(args.timeout), "--device", args.device, "--out", out]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if proc.returncode or not os.path.exists(out):
                print(f"{cache} {method}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
                continue
            for row in json.load(open(out))["rows"]:
                keys = ("first_call_s", "warmup_s", "step_ms", "attnopt_pass_s", "inner_compile_s", "background_tunings",
                        "tuning_wall_s", "first_call_waited_s", "sites", "rewritten", "kinds", "error")
                print(f"{cache} {method}: " + json.dumps({k: row.get(k) for k in keys if k in row}))
                for r in row.get("tuning") or []:
                    shape = r.get("shape") or {}
                    print("   ", json.dumps({"kv_len": shape.get("kv_len") if isinstance(shape, dict) else shape,
                                          "bucketed": shape.get("bucketed") if isinstance(shape, dict) else None,
                                          **{k: r.get(k) for k in ("tune_s", "warm_up_s", "measure_s", "tie_break_s",
                                                                    "tie_warm_up_s", "rounds", "timed", "timings_taken",
                                                                    "winner", "measured_us", "tune_cpu_s")}}))


if __name__ == "__main__":
    main()
