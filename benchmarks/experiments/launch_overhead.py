"""Experiment (one GPU call): where the host time of one eager split-KV call goes, piece by piece.

Times on the host (no sync inside the loop), per call, for the 32/8 D=128 8k bf16 shape:
the strategy's ``run`` (16 splits, TMA and pointer tiles), the launch cache's key alone, the cache's hit path
(``compiled[grid](...)``), the compiled launcher called directly, the descriptors alone, the merge launch,
SDPA, an empty allocation and a CUDA-graph replay; then a cProfile of the full call. JSON to $OUT.
"""
from __future__ import annotations

import json
import math
import os

import torch
import torch.nn.functional as F

from attnopt.bench.common import git_commit, host_profile, host_us
from attnopt.bench.kernels import _make_set
from attnopt.plan import SplitKVPlan
from attnopt.runtime.kernels.common import kv_descriptors
from attnopt.runtime.strategies import get_strategy


def main():
    res = {"device": torch.cuda.get_device_name(), "commit": git_commit(), "torch": torch.__version__}
    strat = get_strategy("split_kv")
    B, Hq, Hkv, D, N = 1, 32, 8, 128, 8192
    s = _make_set(0, B, Hq, Hkv, D, N, 1, None, torch.bfloat16)
    q, k, v = s["q"], s["k"], s["v"]
    scale = 1 / math.sqrt(D)
    from attnopt.runtime.kernels.split_kv import _SPLIT_KV_LAUNCH

    variants = (("run_split16_default", SplitKVPlan(num_splits=16, block_n=64, num_stages=3, tma=True), "0"),
                ("run_split16_tma_forced", SplitKVPlan(num_splits=16, block_n=64, num_stages=3, tma=True), "1"),
                ("run_split16_ptr", SplitKVPlan(num_splits=16, block_n=64, num_stages=3, tma=False), "0"),
                ("run_split1_tma_forced", SplitKVPlan(num_splits=1, block_n=64, num_stages=3, tma=True), "1"),
                ("run_split1_ptr", SplitKVPlan(num_splits=1, block_n=64, num_stages=3, tma=False), "0"))
    for name, plan, tma_eager in variants:
        os.environ["ATTNOPT_TMA_EAGER"] = tma_eager
        st = strat.prepare(plan, q, k, v)
        fn = lambda: strat.run(st, plan, q, k, v, None, None, scale, False)  # noqa: E731
        res[name] = host_us(fn)
        if name in ("run_split16_default", "run_split1_tma_forced"):
            res["profile_" + name] = host_profile(fn, 400, 30)
            print(res["profile_" + name])
    os.environ["ATTNOPT_TMA_EAGER"] = "0"
    # a dynamic cache: a new, one-longer K/V every call (level-2 launches: specialisation, no binder)
    plan = SplitKVPlan(num_splits=16, block_n=64, num_stages=3, tma=True)
    st = strat.prepare(plan, q, k, v)
    kk = torch.randn(B, Hkv, N + 400, D, device="cuda", dtype=torch.bfloat16)
    vv = torch.randn(B, Hkv, N + 400, D, device="cuda", dtype=torch.bfloat16)
    grow = [0]

    def growing():
        grow[0] = (grow[0] + 1) % 400
        n = N + grow[0]
        return strat.run(st, plan, q, kk[:, :, :n], vv[:, :, :n], None,
                         None, scale, False)
    res["run_split16_default_growing_len"] = host_us(growing, iters=100)
    res["launcher_direct"], res["launcher_jit"] = _SPLIT_KV_LAUNCH.direct, _SPLIT_KV_LAUNCH.jit
    os.environ["ATTNOPT_LAUNCH_CACHE"] = "0"
    res["run_split16_default_jit_path"] = host_us(lambda: strat.run(st, plan, q, k, v, None, None, scale, False))
    os.environ["ATTNOPT_LAUNCH_CACHE"] = "1"
    res["kv_descriptors"] = host_us(lambda: kv_descriptors(k, v, 64))
    res["current_stream"] = host_us(lambda: torch.cuda.current_stream().cuda_stream)
    res["capability"] = host_us(lambda: torch.cuda.get_device_capability(q.device))
    from attnopt.runtime.kernels.merge import merge_states
    o = torch.randn(16, 1, 32, 1, 128, device="cuda")
    lse = torch.randn(16, 1, 32, 1, device="cuda")
    out = torch.empty(1, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    res["merge_only"] = host_us(lambda: merge_states(o, lse, out=out, lse_out=False))
    res["sdpa"] = host_us(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
    res["empty"] = host_us(lambda: torch.empty((1, 32, 1, 128), device="cuda"))
    res["copy_small"] = host_us(lambda: out.copy_(q))
    g = torch.cuda.CUDAGraph()
    st = strat.prepare(SplitKVPlan(num_splits=16, block_n=64, num_stages=3, tma=True), q, k, v)
    plan = SplitKVPlan(num_splits=16, block_n=64, num_stages=3, tma=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        strat.run(st, plan, q, k, v, None, None, scale, False)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(g):
        strat.run(st, plan, q, k, v, None, None, scale, False)
    res["graph_replay"] = host_us(lambda: g.replay())
    for name, val in res.items():
        if not name.startswith("profile") and name not in ("device", "commit", "torch"):
            print(f"{name:28s} {val if isinstance(val, str) else round(val, 2)}")
    with open(os.path.join(os.environ.get("OUT", "."), "launch_overhead.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
