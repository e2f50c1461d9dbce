"""Experiment (one GPU call): how far the issue-3 gaps are from what the hardware allows, and whether a wider
split-KV sweep closes them.

Per case, in CUDA-graph timing with the bench's L2 rotation, side by side:

* ``read-floor``: the fastest streaming read of exactly the case's K/V bytes (no attention at all) over a few
  grid sizes and load widths: no kernel that reads K and V once can beat it;
* the peers (SDPA flash and cuDNN);
* split-KV over a wider grid than the planner offers (splits x block_n x warps x stages x fused merge).

Writes ``$OUT/kernel_headroom.json`` and prints, per case, the read floor, the best peer and the best plans.
Not part of the package: it decides which configurations the planner offers.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os

import torch

from attnopt.bench.common import Rotation, _read_kernel, cycle, rel_err, results_header, time_us
from attnopt.bench.kernels import CASES, _make_set, _peer_methods, plan_call
from attnopt.plan import SplitKVPlan, StreamKPlan
from attnopt.runtime.reference import decode_attention

#: Per case: split-KV (splits, (block_n, warps, stages)) and stream-K (grid in SMs, (block_n, warps, stages)).
#: Session 8, third sweep: split counts whose grid is a whole number of programs per SM with 8 KV heads (33 x 8 =
#: 2 x 132), against 16 splits (128 programs: 4 SMs idle). The first two session-8 sweeps (49d2b32, 193183d) and
#: earlier ones are in git history with the JSON they produced.
SWEEPS = {
    "llama3-8b-128k": ((16, 33, 66),
                       ((64, 4, 3), (64, 4, 4), (128, 4, 3)),
                       (1,), ((64, 4, 3),)),
    "llama3-8b-512k": ((16, 33, 66),
                       ((64, 4, 3), (128, 4, 3)),
                       (1,), ((64, 4, 3),)),
    "llama3-8b-32k": ((8, 16, 33),
                      ((64, 4, 3), (128, 4, 3)),
                      (), ()),
}
#: Fused-merge variants to time (the first session-8 sweep found the fused merge no faster anywhere).
FUSED = (False,)


def read_floor_us(kv_bytes: int, l2_bytes: int) -> tuple[float, str]:
    """Fastest streaming read of ``kv_bytes`` (rotated buffers so that every call misses in L2)."""
    kern = _read_kernel()
    n = kv_bytes // 4
    bufs = Rotation(lambda i: torch.empty(n, dtype=torch.int32, device="cuda").random_(0, 7), kv_bytes, l2_bytes)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    best = (math.inf, "")
    for block, mult, warps in itertools.product((4096, 16384), (1, 2, 4, 8), (4, 8)):
        per_prog = -(-n // (sms * mult) // block) * block
        programs = -(-n // per_prog)
        partial = torch.empty(programs, device="cuda", dtype=torch.float32)
        us = time_us(cycle([lambda x=x, per_prog=per_prog, programs=programs, partial=partial, block=block,
                            warps=warps: kern[(programs,)](x, partial, n, per_prog, BLOCK=block, num_warps=warps)
                            for x in bufs.sets]), "graph")
        if us < best[0]:
            best = (us, f"programs={programs} block={block} warps={warps}")
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=",".join(SWEEPS))
    args = ap.parse_args()
    res = results_header("kernel_headroom")
    l2 = res.get("l2_bytes") or (50 << 20)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    peer_args = argparse.Namespace(no_flex=True, no_eager_peer=True)
    summary = []
    for case in args.cases.split(","):
        B, Hq, Hkv, D, N, valid = CASES[case]
        kv_bytes = B * Hkv * N * 2 * D * 2
        floor_us, floor_how = read_floor_us(kv_bytes, l2)
        rot = Rotation(lambda i: _make_set(i, B, Hq, Hkv, D, N, 1, valid, torch.bfloat16), kv_bytes, l2)
        s0 = rot.sets[0]
        scale = 1 / math.sqrt(D)
        ref = decode_attention(s0["q"].float(), s0["k"], s0["v"], scale=scale).float()
        rows = [dict(case=case, method="read-floor", us=floor_us, how=floor_how, peer=None, rel_err=0.0)]

        def timeit(name, make, **extra):
            fn = cycle([make(s) for s in rot.sets])
            out = fn()
            torch.cuda.synchronize()
            err = rel_err(out.float(), ref)
            rows.append(dict(case=case, method=name, us=time_us(fn, "graph"), rel_err=err, **extra))

        for m in _peer_methods(B, Hq, Hkv, D, N, valid, scale, peer_args):
            if m.name in ("sdpa-flash", "sdpa-cudnn"):
                try:
                    timeit(m.name, m.make, peer=True)
                except Exception as exc:  # noqa: BLE001
                    rows.append(dict(case=case, method=m.name, error=str(exc)[:200]))
        splits, configs, grids, sk_configs = SWEEPS[case]
        max_splits = -(-N // 32)
        plans = [SplitKVPlan(num_splits=s, block_n=block_n, num_warps=warps, num_stages=stages, fused_merge=fused,
                             tma=True)
                 for s, (block_n, warps, stages), fused in itertools.product(splits, configs, FUSED)
                 if not (fused and s == 1) and s <= max_splits]
        plans += [StreamKPlan(grid=mult * sms, block_n=block_n, num_warps=warps, num_stages=stages, tma=True)
                  for mult, (block_n, warps, stages) in itertools.product(grids, sk_configs)]
        for plan in plans:
            try:
                timeit(plan.describe(), lambda st, plan=plan: plan_call(plan, st, scale), peer=False,
                       plan=plan.to_json())
            except Exception as exc:  # noqa: BLE001 (out of shared memory, say)
                rows.append(dict(case=case, method=plan.describe(), error=f"{type(exc).__name__}: {exc}"[:300]))
        ok = [r for r in rows if "us" in r and r["rel_err"] < 2e-2]
        peers = [r for r in ok if r["peer"]]
        ours = sorted((r for r in ok if r["peer"] is False), key=lambda r: r["us"])
        best_peer = min(peers, key=lambda r: r["us"])
        print(f"\n== {case}  read floor {floor_us:.2f} us ({floor_how})  best peer {best_peer['method']} "
              f"{best_peer['us']:.2f} us  (peer / 1.5 = {best_peer['us'] / 1.5:.2f})")
        fused = [r for r in ours if "fused_merge=True" in r["method"]]
        for r in ours[:6] + fused[:2] + [r for r in ours if r["method"].startswith("stream_k")][:3]:
            print(f"  {r['method'][:84]:84s} {r['us']:8.2f} us  x{best_peer['us'] / r['us']:.3f}  "
                  f"floor/us {floor_us / r['us']:.3f}")
        for r in rows:
            if "error" in r or r.get("rel_err", 0) >= 2e-2:
                print("  BAD", {k: r.get(k) for k in ("method", "error", "rel_err")})
        if not ours:
            print("  no attnopt plan ran")
        summary.append(dict(case=case, read_floor_us=floor_us, best_peer=best_peer["method"],
                            best_peer_us=best_peer["us"], best=ours[0]["method"] if ours else None,
                            best_us=ours[0]["us"] if ours else None))
        res["rows"] += rows
        res["summary"] = summary
        with open(os.path.join(os.environ.get("OUT", "."), "kernel_headroom.json"), "w") as f:
            json.dump(res, f, indent=1)  # after every case: a cut-off run keeps what it measured
        del rot
        torch.cuda.empty_cache()
    print(f"\n{'case':18s} {'read floor':>10s} {'peer':>8s} {'ours':>8s} {'ratio':>6s} {'peer/floor':>10s}")
    for s in summary:
        print(f"{s['case']:18s} {s['read_floor_us']:10.2f} {s['best_peer_us']:8.2f} {s['best_us'] or 0:8.2f} "
              f"{s['best_peer_us'] / (s['best_us'] or 1):6.3f} {s['best_peer_us'] / s['read_floor_us']:10.3f}")


if __name__ == "__main__":
    main()
