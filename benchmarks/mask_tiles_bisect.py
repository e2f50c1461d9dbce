"""Which split-KV launches over a static cache's mask come out wrong on a GPU: a sweep to isolate the cause.

On the H100 (full planner grid at main 6c52fb6) two static q_len-4 cases returned wrong outputs from their first
(eager) call: lhs17 (B=38, 10/2 heads, D=80, 520 of 4160 slots) with S=1/256/8/2 (rel err 0.677) and S=3/128/4/2
(0.0066), and lhs07 (B=4, 32/4 heads, D=96, 1096 of 8768) with S=8/128/4/3 (1.04). Both have 32-row query tiles
(G x q_len = 20 and 32) and a padded head dim, and the valid keys end inside a tile; the Triton interpreter gets
them right (``tests/runtime/test_mask_tiles_wide.py``). This times nothing: per combination of head dim, query rows
(G, q_len), where the valid keys end (inside a tile or on a tile's end), config (splits/block_n/warps/stages) and
path (pointer loads, as an eager call; the copy engine, as a captured graph), it prints the relative error against
the fp64 reference and lists the wrong ones (> 5e-3).

    python benchmarks/mask_tiles_bisect.py [--out $OUT/mask-tiles-bisect.json]
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

HEAD_DIMS = (80, 128)
ROWS = ((5, 4), (2, 4), (32, 1))  # (G, q_len): 20 rows (32-row tile), 8 (16-row tile), 32 at q_len 1
ENDS = (520, 512)  # valid keys of 4160 slots: inside a tile, on a tile's end
CONFIGS = ((1, 256, 8, 2), (8, 128, 4, 3), (4, 64, 4, 3))
PATHS = ("pointers", "tma")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    from attnopt.runtime.kernels.split_kv import split_kv_decode, split_kv_workspace
    from attnopt.runtime.reference import sdpa_float64

    B, Hkv, N = 4, 2, 4160
    rows, wrong = [], []
    for D, (G, L), valid in itertools.product(HEAD_DIMS, ROWS, ENDS):
        g = torch.Generator(device="cpu").manual_seed(D * 1000 + G * 10 + L)
        q = torch.randn(B, Hkv * G, L, D, generator=g).to("cuda", torch.bfloat16)
        k = torch.randn(B, Hkv, N, D, generator=g).to("cuda", torch.bfloat16)
        v = torch.randn(B, Hkv, N, D, generator=g).to("cuda", torch.bfloat16)
        mask = (torch.arange(N, device="cuda") < valid)[None, None, None, :].expand(B, 1, L, N).contiguous()
        ref = sdpa_float64(q, k, v, attn_mask=mask)
        for (splits, block_n, warps, stages), path in itertools.product(CONFIGS, PATHS):
            os.environ["ATTNOPT_TMA_EAGER"] = "1" if path == "tma" else "0"
            out = torch.full_like(q, float("nan"))
            try:
                split_kv_decode(q, k, v, out, None, attn_mask=mask, num_splits=splits, block_n=block_n,
                                num_warps=warps, num_stages=stages, tma=True,
                                workspace=split_kv_workspace(splits, q, k, v) if splits > 1 else None)
                torch.cuda.synchronize()
                err = ((out.double() - ref).norm() / ref.norm()).item()
            except Exception as exc:  # noqa: BLE001 - a launch that fails is a row too
                err = f"{type(exc).__name__}: {str(exc)[:120]}"
            row = {"D": D, "G": G, "q_len": L, "valid": valid, "config": f"S{splits}/{block_n}/{warps}/{stages}",
                   "path": path, "rel_err": err}
            rows.append(row)
            if not isinstance(err, float) or not err < 5e-3:
                wrong.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{len(wrong)} of {len(rows)} wrong:")
    for row in wrong:
        print("  WRONG", json.dumps(row))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows, "wrong": wrong}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
