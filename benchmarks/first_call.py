"""GPU measurement: what the measured choice adds to a model's first call through ``attnopt.optimize``, SmolLM2-135M's
shape (30 layers, 9/3 heads, D=64, bf16, random weights: the first call depends on shapes, not weights) at one
context, each cache kind in a fresh process with an empty tuning cache and an empty Triton cache (a new user's first
run: every candidate kernel compiles cold), through ``attnopt bench e2e --isolate``.

    python benchmarks/first_call.py OUT_DIR [--context 8k] [--caches dynamic static] [--methods attnopt-ro attnopt]

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
    p.add_argument("--caches", nargs="+", default=["dynamic", "static"])
    p.add_argument("--methods", nargs="+", default=["attnopt-ro"])
    p.add_argument("--timeout", type=float, default=200)
    args = p.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    for cache in args.caches:
        for method in args.methods:
            out = os.path.join(args.out_dir, f"first-{cache}-{method}.json")
            env = dict(os.environ, TRITON_CACHE_DIR=tempfile.mkdtemp(prefix="attnopt-first-triton-"))
            cmd = [sys.executable, "-m", "attnopt.cli", "bench", "e2e", "--model", "smollm2-135m", "--contexts",
                   args.context, "--methods", method, "--cache", cache, "--steps", "5", "--warmup", "2", "--isolate",
                   "--timeout", str(args.timeout), "--out", out]
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
