"""Where a ``generate()`` token's time goes, HF's compiled path beside attnopt's documented fast path: one profiled
``generate()`` per method (torch.profiler, CPU and CUDA), each decode forward call marked, then per token the wall
time, the GPU's busy time (union of kernel intervals), the GPU's idle time split into "while the host is inside the
decode forward" and "elsewhere" (generate()'s own loop), and the host time of the forward.

Usage on a GPU: python benchmarks/generate_timeline.py --context 8192 --out timeline.json [--traces DIR]
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def marked(fn, name):
    def call(*args, **kwargs):
        with torch.profiler.record_function(name):
            return fn(*args, **kwargs)
    return call


def union(intervals):
    total, end = 0.0, -1e30
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def overlap(intervals, spans):
    """Busy time of ``intervals`` inside ``spans`` (both lists of (start, end), µs)."""
    out = 0.0
    for s0, e0 in spans:
        out += union([(max(s, s0), min(e, e0)) for s, e in intervals if e > s0 and s < e0])
    return out


def analyse(trace_path: str, tokens: int, mark: str) -> dict:
    events = json.load(open(trace_path))["traceEvents"]
    kernels = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
               and "dur" in e]
    forwards = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == mark and e.get("ph") == "X"
                      and e.get("cat") in ("user_annotation", "cpu_op"))
    if not kernels or not forwards:
        return {"error": f"{len(kernels)} kernels, {len(forwards)} forward marks"}
    t0 = min(min(s for s, _ in kernels), forwards[0][0])
    t1 = max(max(e for _, e in kernels), forwards[-1][1])
    wall = t1 - t0
    busy = union(kernels)
    decode = forwards[1:]  # the first mark is the prefill's (generate() calls the same forward)
    in_fwd = sum(e - s for s, e in decode)
    busy_in_fwd = overlap(kernels, decode)
    # launch-to-start: from each forward's start to the first kernel that starts after it
    starts = sorted(s for s, _ in kernels)
    import bisect
    lat = []
    for s, e in decode:
        i = bisect.bisect_left(starts, s)
        if i < len(starts):
            lat.append(starts[i] - s)
    lat.sort()
    per = 1.0 / max(len(decode), 1)
    return {"decode_forwards": len(decode), "wall_us_per_token": wall / tokens,
            "gpu_busy_us_per_token": busy / tokens,
            "gpu_idle_us_per_token": (wall - busy) / tokens,
            "host_in_forward_us_per_call": in_fwd * per,
            "gpu_idle_while_in_forward_us_per_call": (in_fwd - busy_in_fwd) * per,
            "forward_start_to_next_kernel_us_median": lat[len(lat) // 2] if lat else None,
            "kernels_per_token": len(kernels) / tokens}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--methods", default="hf-compiled,attnopt-ro")
    p.add_argument("--out", required=True)
    p.add_argument("--traces", default=None)
    p.add_argument("--pairs", type=int, default=4, help="timed (8, TOKENS) generate() pairs; the median decides")
    args = p.parse_args()
    import attnopt
    from attnopt.bench.e2e import OPTIMIZE_OPTIONS, build_model
    from transformers import CompileConfig

    results = {"context": args.context, "tokens": args.tokens, "rows": []}
    for method in args.methods.split(","):
        model, _ = build_model(args.model, layers=None, dtype=torch.bfloat16, device="cuda",
                               max_positions=args.context + 1024)
        kw = {"do_sample": False, "cache_implementation": "static"}
        owner = model
        attr = "__call__"
        if method == "hf-compiled":
            kw["compile_config"] = CompileConfig(fullgraph=True, mode="reduce-overhead")
            attr = "_compiled_call"
        else:
            owner = attnopt.optimize(model, **OPTIMIZE_OPTIONS[method])
        torch.manual_seed(1)
        ids = torch.randint(0, model.config.vocab_size, (1, args.context), device="cuda")
        n = args.tokens
        with torch.no_grad():
            t = time.perf_counter()
            owner.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
            first = time.perf_counter() - t
            owner.generate(ids, max_new_tokens=8, min_new_tokens=8, **kw)
            setattr(owner, attr, marked(getattr(owner, attr), "decode_forward"))
            walls = {}
            for m in (8, n) * args.pairs:
                torch.cuda.synchronize()
                t = time.perf_counter()
                owner.generate(ids, max_new_tokens=m, min_new_tokens=m, **kw)
                torch.cuda.synchronize()
                walls.setdefault(m, []).append(time.perf_counter() - t)
            # each pair's difference; the median decides (one noisy pair cannot), the spread is reported
            pairs = sorted(1e3 * (b - a) / (n - 8) for a, b in zip(walls[8], walls[n]))
            per_token_ms = statistics.median(pairs)
            acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=acts) as prof:
                owner.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
                torch.cuda.synchronize()
        path = os.path.join(tempfile.mkdtemp(), f"{method}.json")
        prof.export_chrome_trace(path)
        row = {"method": method, "first_call_s": first, "generate_ms_per_token": per_token_ms,
               "generate_ms_per_token_pairs": pairs,
               **analyse(path, n, "decode_forward")}
        # the ops the host spends most time in, per token (self CPU time)
        avg = prof.key_averages()
        top = sorted(avg, key=lambda a: -a.self_cpu_time_total)[:20]
        row["top_self_cpu_us_per_token"] = [(a.key, round(a.self_cpu_time_total / n, 1), round(a.count / n, 2))
                                            for a in top]
        results["rows"].append(row)
        if args.traces:
            Path(args.traces).mkdir(parents=True, exist_ok=True)
            with open(path, "rb") as f, gzip.open(Path(args.traces) / f"{method}-{args.context}.json.gz", "wb") as g:
                g.write(f.read())
        print(json.dumps({k: v for k, v in row.items() if k != "top_self_cpu_us_per_token"}), flush=True)
        del owner, model
        torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
