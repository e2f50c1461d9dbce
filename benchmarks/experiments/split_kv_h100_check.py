"""Experiment (one GPU): the split-KV plan that was best on the H100 at 38e55ce (16 splits, 64-key tiles, 4 warps,
3 stages, TMA), timed in CUDA-graph mode on rotating inputs exactly as ``bench kernels`` does, at 8k, 32k and
128k (llama3-8b shape, bf16), to compare a kernel change with the committed ``kernels-nvidia-h100-80gb-hbm3.json``
rows of that plan. JSON to $OUT/split_kv_check.json."""
import json
import math
import os

import torch

from attnopt.bench.common import Rotation, cycle, device_info, git_commit, time_us
from attnopt.plan import SplitKVPlan
from attnopt.runtime.strategies import get_strategy

plan = SplitKVPlan(num_splits=16, block_n=64, num_warps=4, num_stages=3, tma=True)
strat = get_strategy("split_kv")
rows = []
for n in (8192, 32768, 131072):
    def make(i, n=n):
        g = torch.Generator(device="cuda").manual_seed(i)
        return [torch.randn(1, h, m, 128, device="cuda", dtype=torch.bfloat16, generator=g)
                for h, m in ((32, 1), (8, n), (8, n))]
    rot = Rotation(make, 2 * 8 * n * 128 * 2, device_info()["l2_bytes"])
    calls = []
    for q, k, v in rot.sets:
        state = strat.prepare(plan, q, k, v)
        calls.append(lambda q=q, k=k, v=v, state=state: strat.run(state, plan, q, k, v, None, None,
                                                                  1 / math.sqrt(128), False))
    rows.append({"N": n, "us": round(time_us(cycle(calls), "graph"), 2)})
    print(rows[-1], flush=True)
with open(os.path.join(os.environ.get("OUT", "."), "split_kv_check.json"), "w") as f:
    json.dump({"device": torch.cuda.get_device_name(), "commit": git_commit(), "plan": plan.describe(),
               "baseline_38e55ce_us": {"8192": 17.23, "32768": 49.59, "131072": 180.66}, "rows": rows}, f, indent=1)
