"""Experiment (one GPU call): split-KV with one-tile tail splits (``split_kv_decode(tail_splits=...)``) against the
same split counts without, next to SDPA cuDNN and flash, on the issue-3 shapes where attnopt and cuDNN tie.

The tail splits start after every other split and take one KV tile each, so the grid ends on short programs.
CUDA-graph timing with the bench's L2 rotation. Writes ``$OUT/tail_splits.json`` and prints, per case, each
variant against cuDNN. Not part of the package: it decides whether the planner offers tail splits.
"""
from __future__ import annotations

import argparse
import math
import os

import torch

from attnopt.bench.common import Rotation, cycle, rel_err, results_header, time_us, write_results
from attnopt.bench.kernels import CASES, _make_set, _peer_methods
from attnopt.runtime.kernels.split_kv import split_kv_decode, split_kv_workspace
from attnopt.runtime.reference import decode_attention

#: Per case: ((block_n, warps, stages), ((num_splits, tail_splits), ...)), uniform splits first.
VARIANTS = {
    "mha56-d64-64k": [((256, 4, 3), ((64, 0), (64, 8), (64, 16), (72, 8), (80, 16), (48, 16), (96, 32))),
                      ((256, 4, 2), ((64, 0), (64, 16)))],
    "llama3-8b-B64-4k": [((128, 4, 3), ((1, 0), (2, 1), (3, 2), (5, 4))),
                         ((64, 4, 3), ((2, 0), (2, 1), (4, 2)))],
    "llama3-8b-B8-32k": [((64, 4, 3), ((2, 0), (3, 1), (4, 2), (6, 4))),
                         ((128, 4, 3), ((2, 0), (3, 1)))],
    "llama3-8b-128k": [((64, 4, 3), ((16, 0), (17, 1), (18, 2), (20, 4), (24, 8)))],
    "llama3-8b-8k": [((128, 4, 3), ((8, 0), (9, 1), (10, 2), (12, 4)))],
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=",".join(VARIANTS))
    args = ap.parse_args()
    res = results_header("tail_splits")
    l2 = res.get("l2_bytes") or (50 << 20)
    peer_args = argparse.Namespace(no_flex=True, no_eager_peer=True)
    res["rows"] = []
    for case in args.cases.split(","):
        B, Hq, Hkv, D, N, valid = CASES[case]
        kv_bytes = B * Hkv * N * 2 * D * 2
        rot = Rotation(lambda i: _make_set(i, B, Hq, Hkv, D, N, 1, valid, torch.bfloat16), kv_bytes, l2)
        s0 = rot.sets[0]
        scale = 1 / math.sqrt(D)
        ref = decode_attention(s0["q"].float(), s0["k"], s0["v"], scale=scale).float()
        rows = []

        def timeit(name, make, **extra):
            fn = cycle([make(s) for s in rot.sets])
            out = fn()
            torch.cuda.synchronize()
            rows.append(dict(case=case, method=name, us=time_us(fn, "graph"), rel_err=rel_err(out.float(), ref),
                             **extra))

        for m in _peer_methods(B, Hq, Hkv, D, N, valid, scale, peer_args):
            if m.name in ("sdpa-flash", "sdpa-cudnn"):
                timeit(m.name, m.make, peer=True)
        for (block_n, warps, stages), pairs in VARIANTS[case]:
            for splits, tail in pairs:
                def make(st, splits=splits, tail=tail, block_n=block_n, warps=warps, stages=stages):
                    ws = split_kv_workspace(splits, st["q"], st["k"], st["v"]) if splits > 1 else None
                    out = torch.empty_like(st["q"])
                    return lambda: split_kv_decode(st["q"], st["k"], st["v"], out, workspace=ws, scale=scale,
                                                   num_splits=splits, block_n=block_n, num_warps=warps,
                                                   num_stages=stages, tma=True, tail_splits=tail)[0]
                timeit(f"split_kv(S={splits}, tail={tail}, {block_n}/{warps}/{stages})", make, peer=False)
        cudnn = next(r["us"] for r in rows if r["method"] == "sdpa-cudnn")
        print(f"\n== {case}  cuDNN {cudnn:.2f} us")
        for r in rows:
            flag = "" if r["rel_err"] < 2e-2 else f"  BAD rel_err {r['rel_err']:.3e}"
            print(f"  {r['method']:44s} {r['us']:8.2f} us  x{cudnn / r['us']:.3f}{flag}")
        res["rows"] += rows
        write_results(os.path.join(os.environ.get("OUT", "."), "tail_splits.json"), res)
        rot = s0 = None  # free this case's K/V before the next
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
