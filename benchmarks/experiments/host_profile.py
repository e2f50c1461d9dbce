"""Experiment (one GPU call): where the host time of one split-KV decode call goes (cProfile over many calls,
no sync), next to SDPA's; plus a targeted MHA (G=1, D=64) tile sweep. Prints tables; JSON to $OUT."""
from __future__ import annotations

import json
import math
import os

import torch
import torch.nn.functional as F

from attnopt.bench.common import Rotation, cycle, host_profile, host_us, rel_err, time_us
from attnopt.bench.kernels import _make_set
from attnopt.plan import SplitKVPlan
from attnopt.runtime.reference import decode_attention
from attnopt.runtime.strategies import get_strategy


def main():
    res = {"host": {}, "mha": []}
    strat = get_strategy("split_kv")
    B, Hq, Hkv, D, N = 1, 32, 8, 128, 8192
    s = _make_set(0, B, Hq, Hkv, D, N, 1, None, torch.bfloat16)
    q, k, v = s["q"], s["k"], s["v"]
    scale = 1 / math.sqrt(D)
    for name, plan in (("split16_tma_s3", SplitKVPlan(num_splits=16, block_n=64, num_stages=3, tma=True)),
                       ("split16_s3", SplitKVPlan(num_splits=16, block_n=64, num_stages=3)),
                       ("split1_s3", SplitKVPlan(num_splits=1, block_n=64, num_stages=3))):
        st = strat.prepare(plan, q, k, v)
        fn = lambda: strat.run(st, plan, q, k, v, None, None, scale, False)  # noqa: E731
        res["host"][name] = host_us(fn)
        print(f"host {name}: {res['host'][name]:.1f} µs/call")
        if name == "split16_tma_s3":
            print(host_profile(fn))
    from attnopt.runtime.kernels.merge import merge_states
    o = torch.randn(16, 1, 32, 1, 128, device="cuda")
    lse = torch.randn(16, 1, 32, 1, device="cuda")
    out = torch.empty(1, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    res["host"]["merge_only"] = host_us(lambda: merge_states(o, lse, out=out, lse_out=False))
    res["host"]["sdpa"] = host_us(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
    res["host"]["empty"] = host_us(lambda: torch.empty((1, 32, 1, 128), device="cuda"))
    print({k2: round(v2, 1) for k2, v2 in res["host"].items()})

    # MHA, G=1, D=64, 64k: tiles and pipelines
    B, Hq, Hkv, D, N = 1, 56, 56, 64, 65536
    kv_bytes = B * Hkv * N * 2 * D * 2
    rot = Rotation(lambda i: _make_set(i, B, Hq, Hkv, D, N, 1, None, torch.bfloat16), kv_bytes, 50 << 20)
    s0 = rot.sets[0]
    scale = 1 / math.sqrt(D)
    ref = decode_attention(s0["q"].float(), s0["k"], s0["v"], scale=scale).float()

    def timeit(make):
        calls = [make(x) for x in rot.sets]
        o1 = calls[0]()
        torch.cuda.synchronize()
        return time_us(cycle(calls), "graph"), rel_err(o1.float(), ref)

    from torch.nn.attention import SDPBackend, sdpa_kernel

    def cudnn(x):
        def call():
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return F.scaled_dot_product_attention(x["q"], x["k"], x["v"], scale=scale)
        return call
    us, err = timeit(cudnn)
    res["mha"].append({"method": "cudnn", "us": us})
    print(f"mha56 cudnn {us:.1f}")
    rows = []
    for bn, warps, stages in ((64, 4, 3), (64, 4, 4), (64, 4, 5), (128, 4, 3), (128, 4, 4), (128, 8, 3), (128, 8, 4),
                              (256, 4, 2), (256, 4, 3), (256, 8, 2), (256, 8, 3), (32, 4, 4), (32, 2, 4)):
        for splits in (1, 2, 3, 4, 8):
            plan = SplitKVPlan(num_splits=splits, block_n=bn, num_warps=warps, num_stages=stages, tma=True)

            def make(x, plan=plan):
                st = strat.prepare(plan, x["q"], x["k"], x["v"])
                return lambda: strat.run(st, plan, x["q"], x["k"], x["v"], None, None, scale, False)
            try:
                us2, err2 = timeit(make)
            except Exception as exc:  # noqa: BLE001
                print("  fail", plan.describe(), str(exc)[:120])
                continue
            rows.append({"plan": plan.describe(), "us": us2, "rel_err": err2})
    rows.sort(key=lambda r: r["us"])
    for r in rows[:15]:
        print(f"  {r['plan']:100s} {r['us']:7.1f}  x{us / r['us']:.3f}  err {r['rel_err']:.1e}")
    res["mha"] += rows
    with open(os.path.join(os.environ.get("OUT", "."), "host_profile.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
