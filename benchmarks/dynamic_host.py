"""GPU diagnostic: the host time of one eager call of ``attnopt.optimize(fn)`` on a dynamic (growing) KV cache, at a
KV length called before against a new one, beside SDPA cuDNN and flash called the same way; with a cProfile of each.

    python benchmarks/dynamic_host.py OUT.json [B Hq Hkv D N]     (default: lhs04's shape, B7 4/2 D96 N3264)

The planner bench's ``fresh_length_us`` showed 300-750 µs a call at a known length and 300-1400 µs more at a new one
for the planner's pick (H100, 3fed422), where cuDNN's call took 100-230 µs: this says where the host time goes.
Per method: the median synced µs of 20 calls at known lengths and at 20 new lengths, and the top functions of a
cProfile (cumulative and own time) over 20 new-length calls.
"""
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import attnopt


def attend(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=q.shape[1] != k.shape[1])


def main() -> None:
    out_path = sys.argv[1]
    B, Hq, Hkv, D, N = (int(x) for x in (sys.argv[2:7] or (7, 4, 2, 96, 3264)))
    dt = torch.bfloat16
    q = torch.randn(B, Hq, 1, D, device="cuda", dtype=dt)
    base_k = torch.randn(B, Hkv, N + 64, D, device="cuda", dtype=dt)
    base_v = torch.randn_like(base_k)

    def kv(n):
        k, v = base_k[:, :, :n].contiguous(), base_v[:, :, :n].contiguous()
        torch._dynamo.maybe_mark_dynamic(k, 2)
        torch._dynamo.maybe_mark_dynamic(v, 2)
        return k, v

    from torch.nn.attention import SDPBackend, sdpa_kernel

    def backend(b):
        def call(q, k, v):
            with sdpa_kernel([b]):
                return attend(q, k, v)
        return call

    methods = {"attnopt": attnopt.optimize(attend), "sdpa-cudnn": backend(SDPBackend.CUDNN_ATTENTION),
               "sdpa-flash": backend(SDPBackend.FLASH_ATTENTION)}
    result = {"shape": [B, Hq, Hkv, D, N], "torch": torch.__version__, "device": torch.cuda.get_device_name(),
              "commit": os.environ.get("ATTNOPT_COMMIT", "unknown"), "methods": {}}
    for name, fn in methods.items():
        t0 = time.perf_counter()
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
        fresh = timed(fresh_sets)
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
                                   "fresh_us": statistics.median(fresh), "fresh_all_us": fresh,
                                   "profile": text}
        print(f"{name:12s} first {first_s:.2f} s  known {statistics.median(known):8.1f} µs  "
              f"fresh {statistics.median(fresh):8.1f} µs")
    report = attnopt.last_plans(methods["attnopt"])
    result["plan"] = str(report)[:4000]
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)
    print(result["methods"]["attnopt"]["profile"]["tottime"][:6000])


if __name__ == "__main__":
    main()
