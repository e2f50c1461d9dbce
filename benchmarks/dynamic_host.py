"""GPU diagnostic: the host time of one eager call of ``attnopt.optimize(fn)`` on a dynamic (growing) KV cache, at a
KV length called before against a new one, beside SDPA cuDNN and flash called the same way; with a cProfile of each.

    python benchmarks/dynamic_host.py OUT.json [B Hq Hkv D N]     (default: lhs04's shape, B7 4/2 D96 N3264)

The planner bench's ``fresh_length_us`` showed 300-750 µs a call at a known length and 230-340 µs more at a new one
for the planner's pick (H100, 3fed422 and 8e6ae2d), where cuDNN's call took 70-230 µs. The first version of this
script (H100, 8a4f996) did not reproduce it: its ``optimize`` tuned with each call's host time added (the default
mode), and picked SDPA flash for every bucket around 3264 keys, which builds nothing per length (153 µs known, 168
new). Here the tuning ranks by device time alone, as the planner bench's does (``graph_timed_tuning``; a fresh tuning
cache), so the pick is the bench's Triton plan; ``--host-tuned`` keeps the default mode's tuning.

Per method: the first call's seconds; every synced call's µs at 4 known lengths (x5) and at 20 new lengths (the first
of them the first length not a multiple of 16: a Triton kernel specialised on that compiles there); what changed
over the new-length calls (dynamo's counters: a recompile would show; the direct launcher's Triton-path launches,
``jit``: a new kernel specialisation); the planner bench's own ``fresh_length_us`` on the same function (known and new
lengths alternating) and its order before (every new length, then the same again: each call's µs); and the
top functions of a cProfile (cumulative and own time) over 20 more new-length calls.
"""
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

import attnopt


def attend(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=q.shape[1] != k.shape[1])


def launcher_counts() -> dict:
    """Per direct launcher of the decode kernels: (direct launches, launches through Triton's path)."""
    from attnopt.runtime.kernels import merge, split_kv, stream_k, stream_k_merge

    out = {}
    for mod in (split_kv, stream_k, stream_k_merge, merge):
        for name, obj in vars(mod).items():
            if hasattr(obj, "direct") and hasattr(obj, "jit"):
                out[f"{mod.__name__.rsplit('.', 1)[-1]}.{name}"] = (obj.direct, obj.jit)
    return out


def dynamo_counts() -> dict:
    from torch._dynamo.utils import counters

    return {group: dict(c) for group, c in counters.items()}


def diff(after: dict, before: dict) -> dict:
    out = {}
    for k, v in after.items():
        b = before.get(k)
        if isinstance(v, dict):
            d = diff(v, b or {})
            if d:
                out[k] = d
        elif isinstance(v, tuple):
            d = tuple(x - y for x, y in zip(v, b or (0,) * len(v)))
            if any(d):
                out[k] = d
        elif v != b:
            out[k] = v - (b or 0) if isinstance(v, (int, float)) else v
    return out


def old_order_probe(fn, q, k, v, lengths: int = 3) -> list[float]:
    """The planner bench's fresh-length probe before d356f90+: every new length first (the first of them compiles a
    kernel specialised on a length not a multiple of 16), then the same lengths again; [median new, median known]."""
    def at(n):
        kk, vv = k[:, :, :n].contiguous(), v[:, :, :n].contiguous()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(q, kk, vv)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e6

    n = k.shape[2]
    new = [at(n - 1 - i) for i in range(lengths)]
    known = [at(n - 1 - i) for i in range(lengths)]
    return [statistics.median(new), statistics.median(known), new, known]


def main() -> None:
    out_path = sys.argv[1]
    rest = [a for a in sys.argv[2:] if not a.startswith("--")]
    host_tuned = "--host-tuned" in sys.argv
    B, Hq, Hkv, D, N = (int(x) for x in (rest or (7, 4, 2, 96, 3264)))
    os.environ.setdefault("ATTNOPT_CACHE_DIR", tempfile.mkdtemp(prefix="attnopt-dynhost-"))
    dt = torch.bfloat16
    q = torch.randn(B, Hq, 1, D, device="cuda", dtype=dt)
    base_k = torch.randn(B, Hkv, N + 64, D, device="cuda", dtype=dt)
    base_v = torch.randn_like(base_k)

    def kv(n, mark=True):
        k, v = base_k[:, :, :n].contiguous(), base_v[:, :, :n].contiguous()
        if mark:
            torch._dynamo.maybe_mark_dynamic(k, 2)
            torch._dynamo.maybe_mark_dynamic(v, 2)
        return k, v

    from torch.nn.attention import SDPBackend, sdpa_kernel

    from attnopt.bench.common import graph_timed_tuning
    from attnopt.bench.planner_timing import fresh_length_us

    def backend(b):
        def call(q, k, v):
            with sdpa_kernel([b]):
                return attend(q, k, v)
        return call

    methods = {"attnopt": attnopt.optimize(attend), "sdpa-cudnn": backend(SDPBackend.CUDNN_ATTENTION),
               "sdpa-flash": backend(SDPBackend.FLASH_ATTENTION)}
    result = {"shape": [B, Hq, Hkv, D, N], "torch": torch.__version__, "device": torch.cuda.get_device_name(),
              "commit": os.environ.get("ATTNOPT_COMMIT", "unknown"), "tuning": "host" if host_tuned else "graph",
              "methods": {}}
    for name, fn in methods.items():
        t0 = time.perf_counter()
        with graph_timed_tuning(name == "attnopt" and not host_tuned):
            fn(q, *kv(N))
        torch.cuda.synchronize()
        first_s = time.perf_counter() - t0
        known_sets = [kv(N - i) for i in range(4)]
        for k, v in known_sets:  # these lengths are now known
            fn(q, k, v)
        torch.cuda.synchronize()

        def timed(sets):
            out = []
            for k, v in sets:
                torch.cuda.synchronize()
                t = time.perf_counter()
                fn(q, k, v)
                torch.cuda.synchronize()
                out.append((time.perf_counter() - t) * 1e6)
            return out

        known = timed(known_sets * 5)
        fresh_sets = [kv(N - 8 - i) for i in range(20)]
        counts = (dynamo_counts(), launcher_counts())
        fresh = timed(fresh_sets)
        changed = {"dynamo": diff(dynamo_counts(), counts[0]), "launchers": diff(launcher_counts(), counts[1])}
        bench_probe = fresh_length_us(lambda s: (lambda: fn(s["q"], s["k"], s["v"])),
                                      {"q": q, "k": base_k[:, :, :N - 30], "v": base_v[:, :, :N - 30]})
        old_probe = old_order_probe(fn, q, base_k[:, :, :N - 100], base_v[:, :, :N - 100])
        prof_sets = [kv(N - 40 - i) for i in range(20)]
        pr = cProfile.Profile()
        torch.cuda.synchronize()
        pr.enable()
        for k, v in prof_sets:
            fn(q, k, v)
        torch.cuda.synchronize()
        pr.disable()
        text = {}
        for key in ("cumulative", "tottime"):
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats(key).print_stats(25)
            text[key] = s.getvalue()
        result["methods"][name] = {"first_call_s": round(first_s, 3), "known_us": statistics.median(known),
                                   "known_all_us": known, "fresh_us": statistics.median(fresh[1:]),
                                   "fresh_all_us": fresh, "changed_over_fresh_calls": changed,
                                   "bench_fresh_length_us": bench_probe, "old_order_probe_us": old_probe,
                                   "profile": text}
        print(f"{name:12s} first {first_s:.2f} s  known {statistics.median(known):8.1f} µs  "
              f"fresh {statistics.median(fresh[1:]):8.1f} µs (first new {fresh[0]:.0f})  bench probe "
              f"{bench_probe[0]:.0f}/{bench_probe[1]:.0f}  old-order probe {old_probe[0]:.0f}/{old_probe[1]:.0f} "
              f"{[round(x) for x in old_probe[2] + old_probe[3]]}  changed {json.dumps(changed)}")
    report = attnopt.last_plans(methods["attnopt"])
    result["plan"] = str(report)[:4000]
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)
    print(result["plan"][:1200])
    print(result["methods"]["attnopt"]["profile"]["cumulative"][:5000])


if __name__ == "__main__":
    main()
