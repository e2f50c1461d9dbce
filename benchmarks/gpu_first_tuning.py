"""What the measured choice costs at a model's first call, on a GPU: SmolLM2-135M's static-cache decode site (9/3
heads, D=64, bf16, a valid-length mask shared by 30 layers; the e2e bench's caches: 1k, 8k and 32k of prompt plus
64 slots) tuned from nothing, each length in a fresh process with fresh Triton and tuning caches, as
``optimize(model)`` tunes it on its first call.

    python benchmarks/gpu_first_tuning.py [--lengths 1088 8256 32832] [--budget 4] [--warm-workers 0 1 16]
                                          [--out $OUT/first-tuning.json]

``--warm-workers``: each length is tuned once per value (``ATTNOPT_TUNE_WARM_WORKERS``): 0 = no warm-up (each
candidate compiled when first timed, as at f9e648f), 1 = compiled one after another before timing, 16 = at once.

Prints one JSON line per length: the tuner's wall seconds (``tune_s``), the warm-up's (``warm_up_s``: every
candidate compiled at once), the rounds, the pick and its µs, and every candidate's µs (or why it was not timed).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap

_ONE = textwrap.dedent("""
    import dataclasses, json, sys
    from attnopt import tuning
    from attnopt.config import OptimizeConfig
    from attnopt.hardware import resolve_profile
    from attnopt.passes.plan import rank_candidates
    from attnopt.runtime.strategies import PlanContext
    from attnopt.site import AttentionSite

    n, budget = int(sys.argv[1]), float(sys.argv[2])
    site = AttentionSite.canonical(q_heads=9, kv_heads=3, head_dim=64, kv_len=n, mask_kind="valid_length",
                                   dtype="bfloat16")
    ranked = rank_candidates(site, resolve_profile(None), PlanContext(device_type="cuda", triton_available=True),
                             OptimizeConfig())[0]
    cache = tuning.TuningCache()
    choice = tuning.Tuner(cache=cache, budget_s=budget).choose(site, ranked, valid_len_sharing=30)
    record = cache.get(tuning.environment_key(), tuning.ShapeKey.of(site, n, False, 30)) or {}
    print(json.dumps({"kv_len": n, "tune_s": round(choice.tune_s, 3), "warm_up_s": record.get("warm_up_s"),
                      "warm_up_errors": record.get("warm_up_errors"), "rounds": record.get("rounds"),
                      "pick": choice.plan.describe(), "pick_us": choice.measured_us, "timings": choice.timings}))
""")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1088, 8256, 32832])
    parser.add_argument("--budget", type=float, default=None, help="seconds per shape (default: the tuner's)")
    parser.add_argument("--warm-workers", type=int, nargs="+", default=[None],
                        help="ATTNOPT_TUNE_WARM_WORKERS values to compare (default: the tuner's)")
    parser.add_argument("--out", default=None, help="also write the lines as one JSON list here")
    args = parser.parse_args()
    from attnopt.tuning import DEFAULT_BUDGET_S

    rows = []
    for n in args.lengths:
        for workers in args.warm_workers:
            with tempfile.TemporaryDirectory(prefix="attnopt-first-") as fresh:
                env = {**os.environ, "TRITON_CACHE_DIR": os.path.join(fresh, "triton"),
                       "ATTNOPT_CACHE_DIR": os.path.join(fresh, "attnopt")}
                env.pop("TRITON_INTERPRET", None)
                if workers is not None:
                    env["ATTNOPT_TUNE_WARM_WORKERS"] = str(workers)
                budget = DEFAULT_BUDGET_S if args.budget is None else args.budget
                proc = subprocess.run([sys.executable, "-c", _ONE, str(n), str(budget)], env=env, text=True,
                                      capture_output=True, timeout=600)
            if proc.returncode:
                sys.exit(f"kv_len {n}: {proc.stderr[-3000:]}")
            rows.append({"warm_workers": workers, **json.loads(proc.stdout.strip().splitlines()[-1])})
            print(json.dumps(rows[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
