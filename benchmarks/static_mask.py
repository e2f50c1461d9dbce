"""A static cache through its mask, on a GPU: where the time goes, and what the mask-tile path saves.

Issue 19 asks that a static cache given to SDPA as a bool mask (``static-4k-of-32k``: 32k slots holding 4k tokens,
the mask (B, 1, 1, N)) run at least 5x faster than SDPA over the whole cache. On the H100 at 50b728f the planner's
split-KV pick reached 3.5x (16.5 µs against cuDNN's 58.4), 5.7x with the length given directly. Per split-KV
config (splits, block_n, warps, stages), each timed by CUDA-graph replay over rotating input sets (L2 holds no
K/V), in interleaved rounds:

* ``scan+shares``: the path at 50b728f: ``valid_len_from_mask`` (a launch), then split-KV over [0, valid_len) in
  contiguous shares, the mask read in every tile (``mask_tiles=False``), TMA tiles, and the merge;
* ``mask-tiles-tma``: split-KV given the mask alone (what the lowered graph runs now): every split owns every S-th
  tile, reads the mask over them and attends only to the tiles with a visible key (``runtime/kernels/mask_tiles.py``),
  the tiles whose last key is visible by the copy engine, then the merge;
* ``mask-tiles``: the same, every tile by pointer loads (``mask_tiles=True``);
* ``length-only``: split-KV given the valid length and no mask (the bound: nothing to read but the tokens);

against ``sdpa-cudnn`` (SDPA's cuDNN backend over the whole cache with the mask, the planner bench's peer). Prints
the medians, each way's speedup over the peer and its max abs error against the fp32 reference.

    python benchmarks/static_mask.py [--cases static-4k-of-32k,e2e-llama3-8b-128k-static] [--rounds 3]
                                     [--out $OUT/static-mask.json]
"""
from __future__ import annotations

import argparse
import statistics
import sys

#: (splits, block_n, warps, stages): D=128 configs around the planner's picks at 50b728f (16 splits of 128-key tiles
#: at static-4k-of-32k, 25 of 64 at e2e-llama3-8b-128k-static).
CONFIGS = ((8, 128, 4, 3), (16, 64, 4, 3), (16, 128, 4, 3), (32, 64, 4, 3))


def _ways(sets, scale, config):
    import torch

    from attnopt.runtime import ops  # noqa: F401  (registers torch.ops.attnopt.*)
    from attnopt.runtime.kernels.split_kv import split_kv_decode, split_kv_workspace

    splits, block_n, warps, stages = config
    s0 = sets[0]
    ws = split_kv_workspace(splits, s0["q"], s0["k"], s0["v"])
    out = torch.empty_like(s0["q"])
    kw = dict(workspace=ws, scale=scale, num_splits=splits, block_n=block_n, num_warps=warps, num_stages=stages,
              tma=True)

    def scan_shares(s):
        def call():
            valid = torch.ops.attnopt.valid_len_from_mask(s["mask"], s["q"].shape[0])
            return split_kv_decode(s["q"], s["k"], s["v"], out, attn_mask=s["mask"], valid_len=valid,
                                   mask_tiles=False, **kw)[0]
        return call

    def mask_tiles_tma(s):
        return lambda: split_kv_decode(s["q"], s["k"], s["v"], out, attn_mask=s["mask"], **kw)[0]

    def mask_tiles(s):
        return lambda: split_kv_decode(s["q"], s["k"], s["v"], out, attn_mask=s["mask"], mask_tiles=True, **kw)[0]

    def length_only(s):
        return lambda: split_kv_decode(s["q"], s["k"], s["v"], out, valid_len=s["valid"], **kw)[0]

    tag = "S{}/bn{}/w{}/st{}".format(*config)
    return {f"scan+shares {tag}": scan_shares, f"mask-tiles-tma {tag}": mask_tiles_tma, f"mask-tiles {tag}": mask_tiles,
            f"length-only {tag}": length_only}


def _peer(scale, gqa):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def make(s):
        def call():
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return F.scaled_dot_product_attention(s["q"], s["k"], s["v"], attn_mask=s["mask"], scale=scale,
                                                      enable_gqa=gqa)
        return call
    return make


def timed_rounds(makers: dict, sets: list, ref, rounds: int, unchecked: frozenset = frozenset()) -> dict:
    """Each way (``makers``: name -> input set -> call) checked once against ``ref`` (max abs error; None for the
    ways in ``unchecked``, run once but not compared: a launch that writes partials only), then timed by CUDA-graph
    replay over the input sets in ``rounds`` interleaved rounds (each round starts at another way). Returns
    max_abs_err, rounds_us and median_us per way, and ``failed``: the ways whose first call raised (a config out of
    shared memory), with the error."""
    from attnopt.bench.common import cycle, time_us

    calls = {w: [make(s) for s in sets] for w, make in makers.items()}
    out: dict = {"max_abs_err": {}, "failed": {}}
    for w, cs in list(calls.items()):
        try:
            o = cs[0]()
            out["max_abs_err"][w] = None if w in unchecked else float((o.float() - ref).abs().max())
        except Exception as e:  # noqa: BLE001 - reported; the other ways still run
            out["failed"][w] = f"{type(e).__name__}: {str(e)[:300]}"
            del calls[w]
    out["rounds_us"] = {w: [] for w in calls}
    names = list(calls)
    for r in range(rounds):
        for w in names[r % len(names):] + names[:r % len(names)]:
            out["rounds_us"][w].append(time_us(cycle(calls[w]), "graph", target_ms=2.0, replays=5,
                                               min_calls=len(sets)))
    out["median_us"] = {w: statistics.median(v) for w, v in out["rounds_us"].items()}
    return out


def run_case(name, case, rounds, configs) -> dict:
    import math

    import torch

    from attnopt.bench.common import Rotation
    from attnopt.bench.planner import MAX_SETS, _make_set
    from attnopt.runtime.reference import decode_attention

    B, Hq, Hkv, D, N, L, cache = case
    if not cache.startswith("static"):
        raise SystemExit(f"{name}: not a static case (its mask is what this measures)")
    dtype = torch.bfloat16
    scale = 1.0 / math.sqrt(D)
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", None)
    sets = Rotation(lambda i: _make_set(i, case, dtype, "cuda"), B * Hkv * N * 2 * D * 2, l2, max_sets=MAX_SETS).sets
    ref = decode_attention(sets[0]["q"].float(), sets[0]["k"], sets[0]["v"], valid_len=sets[0]["valid"],
                           scale=scale).float()
    makers = {"sdpa-cudnn": _peer(scale, Hq != Hkv)}
    for config in configs:
        makers.update(_ways(sets, scale, config))
    out = {"case": name, "sets": len(sets), **timed_rounds(makers, sets, ref, rounds)}
    peer = out["median_us"]["sdpa-cudnn"]
    out["speedup_vs_sdpa_cudnn"] = {w: peer / v for w, v in out["median_us"].items()}
    return out


def cuda_ready() -> bool:
    """Whether there is a GPU (else a message); the eager warm-ups then compile the variant a graph replays (TMA),
    once."""
    import os

    os.environ.setdefault("ATTNOPT_TMA_EAGER", "1")
    import torch

    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return False
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="static-4k-of-32k,e2e-llama3-8b-128k-static",
                   help="static planner-bench case names (the second: a nearly full cache)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--configs", default=None, help="split-KV configs S/block_n/warps/stages, comma-separated "
                   "(default: " + ",".join("/".join(map(str, c)) for c in CONFIGS) + ")")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not cuda_ready():
        return 2
    from attnopt.bench.planner_grid import case_of

    results = []
    for name in (c.strip() for c in args.cases.split(",") if c.strip()):
        configs = CONFIGS if not args.configs else tuple(tuple(int(x) for x in c.split("/"))
                                                          for c in args.configs.split(","))
        r = run_case(name, case_of(name), args.rounds, configs)
        results.append(r)
        print(f"{name} ({r['sets']} input sets)")
        for w, us in r["median_us"].items():
            print(f"  {w:34s} {us:8.2f} µs  {r['speedup_vs_sdpa_cudnn'][w]:5.2f}x  err {r['max_abs_err'][w]:.2e}")
    if args.out:  # the results format (device, versions, commit: pass ATTNOPT_COMMIT on a device copy)
        from attnopt.bench.common import results_header, write_results

        write_results(args.out, results_header("static-mask", cases=results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
