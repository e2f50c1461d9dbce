"""Experiment (one GPU call): split-KV with TMA tiles, deeper pipelines, PDL merge and fused merge, side by side
with SDPA flash/cuDNN on the issue-3 grid; plus the host (launch) cost per call of each path.

Writes ``$OUT/tma_pdl_sweep.json`` and prints a table per case. Not part of the package: it decides which
variants the planner offers (see ``runtime/strategies/split_kv.py``).
"""
from __future__ import annotations

import argparse
import json
import math
import os

import torch

from attnopt.bench.common import Rotation, cycle, host_us, read_bandwidth_TBps, rel_err, results_header, time_us
from attnopt.bench.kernels import CASES, _make_set, _peer_methods, plan_call
from attnopt.hardware import detect_profile
from attnopt.plan import SplitKVPlan
from attnopt.runtime.reference import decode_attention
from attnopt.runtime.strategies import PlanContext, get_strategy
from attnopt.site import AttentionSite


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=",".join(c for c in CASES if c != "static-4k-of-32k"))
    ap.add_argument("--top", type=int, default=3, help="planner candidates per case to vary")
    args = ap.parse_args()
    res = results_header("tma_pdl_sweep", read_bw=read_bandwidth_TBps())
    read_bw = res["read_bw"]["best"]
    hw = detect_profile()
    ctx = PlanContext(device_type="cuda", triton_available=True)
    strat = get_strategy("split_kv")
    peer_args = argparse.Namespace(no_flex=True, no_eager_peer=True)
    for case in args.cases.split(","):
        B, Hq, Hkv, D, N, valid = CASES[case]
        site = AttentionSite(node="x", module_path="x", pattern="sdpa", batch=B, q_heads=Hq, kv_heads=Hkv, head_dim=D,
                             q_len=1, kv_len=N, dtype="bfloat16", gqa_source="enable_gqa" if Hq != Hkv else "mha")
        cands = sorted(strat.candidates(site, hw, ctx), key=lambda p: strat.estimate_us(p, site, hw, ctx))
        base = []
        for p in cands:
            key = (p.num_splits, p.block_n, p.num_warps)
            if key not in [(b.num_splits, b.block_n, b.num_warps) for b in base]:
                base.append(p)
        base = base[:args.top]
        plans = []
        for p in base:
            for st in (2, 3, 4):
                for tma in (False, True):
                    plans.append(SplitKVPlan(num_splits=p.num_splits, block_n=p.block_n, num_warps=p.num_warps,
                                             num_stages=st, tma=tma))
            if p.num_splits > 1:
                plans.append(SplitKVPlan(num_splits=p.num_splits, block_n=p.block_n, num_warps=p.num_warps,
                                         num_stages=p.num_stages, fused_merge=True))
        kv_bytes = B * Hkv * N * 2 * D * 2
        floor = kv_bytes / (read_bw * 1e12) * 1e6
        rot = Rotation(lambda i: _make_set(i, B, Hq, Hkv, D, N, 1, valid, torch.bfloat16), kv_bytes, res["l2_bytes"])
        s0 = rot.sets[0]
        scale = 1 / math.sqrt(D)
        ref = decode_attention(s0["q"].float(), s0["k"], s0["v"], scale=scale).float()
        rows = []

        def timeit(name, make, **extra):
            fn = cycle([make(s) for s in rot.sets])
            out = fn()
            torch.cuda.synchronize()
            err = rel_err(out.float(), ref)
            us = time_us(fn, "graph")
            row = dict(case=case, method=name, us=us, roof=floor / us, rel_err=err, host_us=host_us(fn, 200, repeats=3), **extra)
            rows.append(row)
            return row

        for m in _peer_methods(B, Hq, Hkv, D, N, valid, scale, peer_args):
            if m.name == "sdpa-efficient":
                continue
            try:
                timeit(m.name, m.make, peer=True)
            except Exception as exc:  # noqa: BLE001
                rows.append(dict(case=case, method=m.name, error=str(exc)[:200]))
        for plan in plans:
            for pdl in ((True, False) if plan.num_splits > 1 and not plan.fused_merge else (True,)):
                os.environ["ATTNOPT_PDL"] = "1" if pdl else "0"

                try:
                    timeit(plan.describe(), lambda s, plan=plan: plan_call(plan, s, scale), peer=False, pdl=pdl,
                           plan=plan.to_json())
                except Exception as exc:  # noqa: BLE001
                    rows.append(dict(case=case, method=plan.describe(), pdl=pdl, error=f"{type(exc).__name__}: {exc}"[:300]))
        os.environ["ATTNOPT_PDL"] = "1"
        ok = [r for r in rows if "us" in r and r["rel_err"] < 2e-2]
        best_peer = min((r for r in ok if r["peer"]), key=lambda r: r["us"])
        print(f"\n== {case}  floor {floor:.1f} µs  best peer {best_peer['method']} {best_peer['us']:.1f} µs")
        for r in sorted(ok, key=lambda r: r["us"])[:12]:
            print(f"  {r['method'][:70]:70s} pdl={r.get('pdl', '-')!s:5s} {r['us']:8.1f} µs  roof {r['roof']:.3f}  "
                  f"x{best_peer['us'] / r['us']:.3f}  host {r['host_us']:.0f} µs")
        bad = [r for r in rows if "error" in r or r.get("rel_err", 0) >= 2e-2]
        for r in bad:
            print("  BAD", r)
        res["rows"] += rows
        del rot
        torch.cuda.empty_cache()
    out = os.path.join(os.environ.get("OUT", "."), "tma_pdl_sweep.json")
    with open(out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
