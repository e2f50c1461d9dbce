"""Experiment: stream-K's time against its grid (contributors per output tile) at 8k and 128k, next to split-KV
with the same number of programs, to locate its fixed cost (ncu: at 8k its SMs were active 17 of 42 µs on
average, so a few programs run long). Also split-KV at power-of-two split counts for the 56-head MHA shape.
Writes ``$OUT/stream_k_grids.json``."""
from __future__ import annotations

import json
import math
import os

import torch

from attnopt.bench.common import Rotation, cycle, results_header, time_us
from attnopt.bench.kernels import CASES, _make_set, plan_call
from attnopt.plan import SplitKVPlan, StreamKPlan


def main():
    res = results_header("stream_k_grids")
    l2 = res.get("l2_bytes") or (50 << 20)
    plans = {
        "llama3-8b-8k": [StreamKPlan(grid=g, block_n=64, num_warps=4, num_stages=3, tma=True)
                         for g in (8, 16, 32, 64, 128, 132)]
                        + [SplitKVPlan(num_splits=s, block_n=64, num_warps=4, num_stages=3, tma=True)
                           for s in (1, 2, 4, 8, 16)],
        "llama3-8b-128k": [StreamKPlan(grid=g, block_n=64, num_warps=4, num_stages=3, tma=True)
                           for g in (16, 64, 128, 132)]
                          + [SplitKVPlan(num_splits=s, block_n=64, num_warps=4, num_stages=3, tma=True) for s in (2, 16)],
        "mha56-d64-64k": [SplitKVPlan(num_splits=s, block_n=bn, num_warps=w, num_stages=st, tma=True)
                          for s in (16, 32, 64) for bn, w, st in ((256, 4, 2), (256, 8, 2), (128, 4, 3))],
    }
    for case, ps in plans.items():
        B, Hq, Hkv, D, N, valid = CASES[case]
        kv_bytes = B * Hkv * N * 2 * D * 2
        rot = Rotation(lambda i: _make_set(i, B, Hq, Hkv, D, N, 1, valid, torch.bfloat16), kv_bytes, l2)
        scale = 1 / math.sqrt(D)
        for plan in ps:
            us = time_us(cycle([plan_call(plan, s, scale) for s in rot.sets]), "graph")
            res["rows"].append(dict(case=case, method=plan.describe(), us=us))
            print(f"{case:16s} {plan.describe()[:80]:80s} {us:8.2f} us")
        del rot
        torch.cuda.empty_cache()
    with open(os.path.join(os.environ.get("OUT", "."), "stream_k_grids.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
