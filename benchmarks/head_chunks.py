"""Split-KV with the head dim in two power-of-two chunks against one chunk padded to a power of two, on a GPU.

Issue 19: every shape where the planner's pick trails cuDNN at one KV length has D=80 or 96 (H100 at 50b728f: lhs08
B64 8/8 D80 N2432 0.940, lhs33 B8 4/2 D80 N2048 0.945, lhs04 B7 4/2 D96 N3264 0.958, corner B1 14/2 D80 512k 0.925,
B3 12/4 D96 N5000 0.985). Padded to 128, D=80 spends 37 % of the MMA work and shared memory on zeros (ptxas, sm_90,
bf16, 128-key tiles, 3 stages, TMA: 139 KB of shared memory, one program per SM; in chunks of 64 + 32: 105 KB, two).
Per case and split-KV config (splits, block_n, warps, stages), each timed by CUDA-graph replay over rotating input
sets (L2 holds no K/V) in interleaved rounds, as a dynamic cache runs it (no mask, no valid length):

* ``chunks``: Q.K as two dots over the chunks, P.V into two accumulators, a TMA descriptor per chunk
  (``split_kv_decode(head_chunks=True)``, a plan's ``head_chunks``);
* ``padded``: one chunk padded to a power of two (the default);
* ``chunks-fused`` (``--ways``): chunks, the last split to finish a tile merging it in the same launch;

against ``sdpa-cudnn`` (SDPA's cuDNN backend at this one length, the planner bench's peer). Prints the medians,
each way's ratio to the peer (> 1: faster) and its max abs error against the fp32 reference.

    python benchmarks/head_chunks.py [--cases lhs08-B64-8/8-d80-N2432-q1-dynamic,...] [--rounds 3]
                                     [--configs 1/128/4/3,...] [--ways chunks,padded,chunks-fused]
                                     [--out $OUT/head-chunks.json]
"""
from __future__ import annotations

import argparse
import math
import sys

#: The dynamic cases that trailed the one-length cuDNN peer at 50b728f (H100).
CASES = ("lhs08-B64-8/8-d80-N2432-q1-dynamic", "lhs33-B8-4/2-d80-N2048-q1-dynamic",
         "lhs04-B7-4/2-d96-N3264-q1-dynamic", "corner-B1-g7-d80-512k-q1-dyn", "x-B3-12/4-d96-N5000-q1-dynamic")


def default_configs(case, sms: int) -> list[tuple[int, int, int, int]]:
    """(splits, block_n, warps, stages) around filling the GPU once: the split counts that give about one, two and
    four programs per SM over the (batch row, KV head, query block) tiles, at 64- and 128-key tiles, 4 warps, 3
    stages; at most one tile per split."""
    from attnopt.runtime.kernels.common import block_m_for, cdiv

    B, Hq, Hkv, D, N, L, _ = case
    tiles = B * Hkv * cdiv((Hq // Hkv) * L, block_m_for((Hq // Hkv) * L))
    fill = max(1, round(sms / tiles))
    out = []
    for block_n in (64, 128):
        for s in sorted({fill, 2 * fill, 4 * fill}):
            s = min(s, cdiv(N, block_n))
            if (s, block_n, 4, 3) not in out:
                out.append((s, block_n, 4, 3))
    return out


#: The ways a config can run: (head_chunks, fused_merge) for ``split_kv_decode``.
WAYS = {"chunks": (True, False), "padded": (False, False), "chunks-fused": (True, True)}


def run_case(name, case, rounds, configs, ways=("chunks", "padded")) -> dict:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from static_mask import timed_rounds  # this folder's (the script's own folder is on sys.path)

    from attnopt.bench.common import Rotation
    from attnopt.bench.planner import MAX_SETS, _make_set
    from attnopt.runtime.kernels.split_kv import split_kv_decode, split_kv_workspace
    from attnopt.runtime.reference import decode_attention

    B, Hq, Hkv, D, N, L, cache = case
    dtype = torch.bfloat16
    scale = 1.0 / math.sqrt(D)
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", None)
    sets = Rotation(lambda i: _make_set(i, case, dtype, "cuda"), B * Hkv * N * 2 * D * 2, l2, max_sets=MAX_SETS).sets
    ref = decode_attention(sets[0]["q"].float(), sets[0]["k"], sets[0]["v"], scale=scale).float()

    def peer(s):
        def call():
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return F.scaled_dot_product_attention(s["q"], s["k"], s["v"], scale=scale, enable_gqa=Hq != Hkv)
        return call

    makers = {"sdpa-cudnn": peer}
    for splits, block_n, warps, stages in configs:
        ws = split_kv_workspace(splits, sets[0]["q"], sets[0]["k"], sets[0]["v"])
        out = torch.empty_like(sets[0]["q"])
        kw = dict(workspace=ws, scale=scale, num_splits=splits, block_n=block_n, num_warps=warps, num_stages=stages,
                  tma=True)
        tag = f"S{splits}/bn{block_n}/w{warps}/st{stages}"
        for way in ways:
            chunks, fused = WAYS[way]
            if fused and splits == 1:
                continue
            makers[f"{way} {tag}"] = (lambda kw_, c_, f_: lambda s: lambda: split_kv_decode(
                s["q"], s["k"], s["v"], out, head_chunks=c_, fused_merge=f_, **kw_)[0])(kw, chunks, fused)
    res = {"case": name, "sets": len(sets), **timed_rounds(makers, sets, ref, rounds)}
    p = res["median_us"].get("sdpa-cudnn")
    res["ratio_to_sdpa_cudnn"] = {w: (p / v if p else None) for w, v in res["median_us"].items()}
    return res


def _print(r: dict) -> None:
    print(f"{r['case']} ({r['sets']} input sets)", flush=True)
    for w, us in r["median_us"].items():
        print(f"  {w:28s} {us:8.2f} µs  {r['ratio_to_sdpa_cudnn'][w]:5.3f}x  err {r['max_abs_err'][w]:.2e}", flush=True)
    for w, why in r["failed"].items():
        print(f"  {w:28s} FAILED {why}", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=",".join(CASES), help="planner-bench case names (case_of)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ways", default="chunks,padded", help=f"comma-separated, of {', '.join(WAYS)}")
    p.add_argument("--configs", default=None, help="split-KV configs S/block_n/warps/stages, comma-separated "
                   "(default per case: default_configs)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from static_mask import cuda_ready

    if not cuda_ready():
        return 2
    import torch

    from attnopt.bench.planner_grid import case_of

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    results = []
    for name in (c.strip() for c in args.cases.split(",") if c.strip()):
        case = case_of(name)
        configs = (default_configs(case, sms) if not args.configs
                   else [tuple(int(x) for x in c.split("/")) for c in args.configs.split(",")])
        results.append(run_case(name, case, args.rounds, configs, tuple(w.strip() for w in args.ways.split(","))))
        _print(results[-1])
    if args.out:
        from attnopt.bench.common import results_header, write_results

        write_results(args.out, results_header("head-chunks", cases=results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
