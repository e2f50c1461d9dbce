"""Where the split-KV kernel trails cuDNN (issue 19, "kernels where they trail"): its new variants against cuDNN and
the configs the tuner picks now, on a GPU, in one run.

At main d356f90 (H100, planner bench, CUDA-graph timing, L2 rotated) two dynamic caches still trail: B1 14/2 D80
512k (our best config S66/bn128 chunks with the Dv-split merge 119.24 µs against cuDNN's 117.16; stage 1 alone
118.12; streaming 3.02 TB/s against 3.11) and lhs37, B6 32/32 D64 N30464 (every plan 491-494 µs against 486).
The variants (``runtime/kernels/tile_ops.py``), each beside its plain twin:

* ``swap``: the tile products as ``K @ Q^T`` and ``V^T @ P^T`` (swap-AB), so that the keys and the head dim are the
  wgmma M dimension and the 1-16 query rows its N, instead of query rows padded to 16 for mma.sync;
* ``pfT``: each program also prefetches the K/V rows T tiles ahead into L2 with one bulk request per tensor and tile
  (``pfT-lines``: one ``prefetch.global.L2`` per 128-byte line): more of the stream in flight per SM than the
  shared-memory pipeline holds;
* ``ptr``: K/V tiles by pointer loads instead of the copy engine (the exact 80 columns, no second chunk);
* ``stage1``: the first launch alone (no merge), for what the merge costs.

Every way is a dynamic cache as the planner runs it (the grid at this N, no valid length, the Dv-split merge), bf16,
timed as ``benchmarks/split_kv_long.py`` times (``static_mask.timed_rounds``: CUDA graphs of back-to-back calls over
rotating input sets, interleaved rounds), each output first checked against ``runtime/reference.py``
(``max_abs_err``; a way that raised is listed under ``failed``). Writes JSON after every case (``--out``) and prints
each case sorted by time with its ratio to cuDNN, then a verdict: per variant, its time over its plain twin's in
every case where both ran.

    python benchmarks/trail_variants.py --out $OUT/trail-variants.json [--round 1|2|3|5] [--swap-check]
                                        [--cases NAME,...] [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import math
import sys

#: Variant name -> split_kv_decode keyword arguments beside a config's own.
VARIANTS = {
    "": {},
    "swap": {"swap_ab": True},
    "pf1": {"l2_prefetch": 1},
    "pf2": {"l2_prefetch": 2},
    "pf3": {"l2_prefetch": 3},
    "pf4": {"l2_prefetch": 4},
    "pf8": {"l2_prefetch": 8},
    "pf4-lines": {"l2_prefetch": 4, "prefetch_bulk": False},
    "swap+pf4": {"swap_ab": True, "l2_prefetch": 4},
    "ptr": {"tma": False},
    "ptr+pf1": {"tma": False, "l2_prefetch": 1},
    "ptr+pf2": {"tma": False, "l2_prefetch": 2},
    "ptr+swap": {"tma": False, "swap_ab": True},
    "swap+pf1": {"swap_ab": True, "l2_prefetch": 1},
    "stage1": {"merge": False},
    "stage1+pf2": {"merge": False, "l2_prefetch": 2},
    "stage1+pf4": {"merge": False, "l2_prefetch": 4},
    "ptr+stage1": {"merge": False, "tma": False},
    "ptr+pf3": {"tma": False, "l2_prefetch": 3},
    "ptr+pf4": {"tma": False, "l2_prefetch": 4},
    "ptr+stage1+pf2": {"merge": False, "tma": False, "l2_prefetch": 2},
    "ptr+pf2+dv4": {"tma": False, "l2_prefetch": 2, "merge_dv_split": 4},
    "ptr+pf2+dv8": {"tma": False, "l2_prefetch": 2, "merge_dv_split": 8},
}

#: Per case (``planner_grid.case_of`` names: the corner and lhs37, then G=1 shapes at D=96, 80 and 64): configs
#: (splits, block_n, warps, stages, head chunks) and the variants each is timed with. The first config of the two
#: trailing cases is the fastest one timed before (split_kv_long at b8aff6e: 512k S66/bn128 chunks 119.24 µs; the
#: planner's lhs37 pick at 3fed422, S7/bn64); the others are the tuner's other near picks there.
CASES = {
    "corner-B1-g7-d80-512k-q1-dyn": (
        ((66, 128, 4, 3, True), ("", "swap", "pf2", "pf4", "pf8", "pf4-lines", "swap+pf4", "ptr", "stage1",
                                 "stage1+pf4")),
        ((66, 256, 4, 3, True), ("", "pf4")),
        ((66, 256, 4, 2, True), ("", "swap")),  # swap-AB at 3 stages of 256-key tiles needs 298 KB
        ((66, 128, 4, 3, False), ("", "swap", "swap+pf4", "pf4")),
        ((66, 64, 4, 3, True), ("", "swap", "pf4")),
        ((66, 128, 4, 4, True), ("", "pf4")),
    ),
    "lhs37-B6-32/32-d64-N30464-q1-dynamic": (
        ((7, 64, 4, 3, False), ("", "swap", "pf2", "pf4", "pf4-lines", "swap+pf4", "ptr")),
        ((2, 64, 4, 3, False), ("", "swap", "pf4")),
        ((1, 256, 8, 2, False), ("", "swap", "pf2")),
        ((4, 128, 4, 3, False), ("", "swap", "pf4", "swap+pf4")),
        ((1, 128, 4, 3, False), ("", "swap")),
        # the last wave: 192 heads x S programs over 132 SMs, 5-6 resident each at 64-key tiles
        ((14, 64, 4, 3, False), ("", "swap", "pf4")),
        ((28, 64, 4, 3, False), ("", "swap")),
    ),
    "x-B1-32/32-d96-N32768-q1-dynamic": (
        ((4, 128, 4, 3, True), ("", "swap", "pf4", "swap+pf4")),
        ((4, 128, 4, 3, False), ("", "swap", "pf4")),
        ((8, 64, 4, 3, True), ("", "swap")),
    ),
    "x-B64-8/8-d80-N2432-q1-dynamic": (
        ((1, 64, 4, 3, True), ("", "swap", "pf2")),
        ((2, 128, 4, 3, True), ("", "swap")),
    ),
    "x-B1-56/56-d64-N65536-q1-dynamic": (
        ((64, 256, 4, 3, False), ("", "swap", "pf2")),
        ((2, 128, 4, 3, False), ("", "swap", "pf4", "swap+pf4")),
    ),
}


#: ``--round 2``, after the H100 run of round 1 at 027ab0a (/work/gpu-requests/kern.md): at 512k only pf2 (118.34 µs
#: against 120.08 plain and cuDNN's 117.63) and pointer loads (119.03) helped, pf4+ hurt everywhere (137-201); at lhs37
#: swap-AB at S14/S28 64-key tiles (490.7 against 502.9/494.8, cuDNN 488.7); B64 8/8 D80 2432 trails (141.0 against
#: 137.9). So: the prefetch 1-3 tiles ahead, with pointer loads, the merge's share (stage 1 alone), swap-AB over more
#: grids, and the short D80 shape's other configs.
CASES_2 = {
    "corner-B1-g7-d80-512k-q1-dyn": (
        ((66, 128, 4, 3, True), ("", "pf1", "pf2", "pf3", "ptr", "ptr+pf1", "ptr+pf2", "stage1", "stage1+pf2",
                                 "ptr+stage1")),
        ((66, 128, 4, 3, False), ("", "pf2", "ptr", "ptr+pf2", "ptr+stage1")),
        ((66, 128, 4, 4, False), ("ptr", "ptr+pf2")),
        ((66, 128, 8, 3, False), ("ptr", "ptr+pf2")),
        ((66, 256, 4, 3, True), ("pf1", "pf2")),
    ),
    "lhs37-B6-32/32-d64-N30464-q1-dynamic": (
        ((14, 64, 4, 3, False), ("", "swap", "swap+pf1", "ptr+swap")),
        ((21, 64, 4, 3, False), ("", "swap")),
        ((28, 64, 4, 3, False), ("", "swap", "ptr+swap")),
        ((42, 64, 4, 3, False), ("", "swap")),
        ((7, 128, 4, 3, False), ("", "swap")),
        ((14, 128, 4, 3, False), ("", "swap")),
        ((4, 128, 4, 3, False), ("", "swap", "pf1")),
    ),
    "x-B64-8/8-d80-N2432-q1-dynamic": (
        ((1, 64, 4, 3, True), ("", "pf1", "pf2", "ptr", "ptr+pf2", "swap+pf1")),
        ((1, 128, 4, 3, True), ("", "pf1", "swap")),
        ((1, 128, 4, 3, False), ("", "pf1", "ptr")),
        ((2, 64, 4, 3, True), ("", "pf1", "swap")),
        ((1, 64, 4, 4, True), ("", "pf2")),
    ),
}
#: ``--round 3``: swap-AB rewritten with no ``tl.trans`` of a register tensor that a product wrote (``tile_ops``; the
#: first form was wrong compiled with a valid length): do its round-1 gains hold (lhs37 S14 502.9 -> 490.7 µs, S28
#: 494.8 -> 490.7; B64 8/8 D80 S1 142.9 -> 141.7)?
CASES_3 = {
    "lhs37-B6-32/32-d64-N30464-q1-dynamic": (
        ((14, 64, 4, 3, False), ("", "swap")),
        ((28, 64, 4, 3, False), ("", "swap")),
        ((4, 128, 4, 3, False), ("", "swap")),
    ),
    "x-B64-8/8-d80-N2432-q1-dynamic": (
        ((1, 64, 4, 3, True), ("", "swap")),
    ),
    "x-B1-32/32-d96-N32768-q1-dynamic": (
        ((4, 128, 4, 3, False), ("", "swap")),
    ),
}
#: ``--round 4`` at 87976e5 (H100, ``benchmarks/results/experiments/trail-variants-4-nvidia-h100-87976e5.json``) timed
#: key shares (16-key split shares, each split's last tile moved back to end at its share's end; reverted after it):
#: slower everywhere but a no-op tie (512k S66/bn128 chunks stage 1 + pf2 118.10 µs against 115.92 with tile shares;
#: keys+pf2 120.58 against pf2 117.95; ptr+keys+pf2 119.60 against ptr+pf2 117.20; B64 8/8 D80 2432 S1, where the
#: shares did not move, 139.82 against 138.10; 128k D128 G4 S33 182.39 against 181.31), S64/bn128 131.17 (4 SMs
#: idle); cuDNN 117.46. The rewritten swap-AB at lhs37: S7/bn128 487.86 against 500.95 unswapped, S14 488.18 against
#: 491.58, cuDNN 489.08.
#: ``--round 5``: around the fastest two: pointer loads with the prefetch (512k: the prefetch distance, 2 stages, 64- and
#: 256-key tiles, the merge over 4 and 8 programs a row, stage 1 alone), swap-AB at lhs37 (8 warps, 256-key tiles,
#: S22/S28), and pointer twins at 128k D128 G4.
CASES_5 = {
    "corner-B1-g7-d80-512k-q1-dyn": (
        ((66, 128, 8, 3, False), ("ptr+pf2", "ptr+pf3", "ptr+pf2+dv4", "ptr+pf2+dv8", "ptr+stage1+pf2")),
        ((66, 128, 8, 2, False), ("ptr+pf2",)),
        ((66, 64, 4, 3, False), ("ptr+pf4",)),
        ((66, 64, 8, 3, False), ("ptr+pf4",)),
        ((66, 256, 8, 2, False), ("ptr+pf1",)),
    ),
    "lhs37-B6-32/32-d64-N30464-q1-dynamic": (
        ((7, 128, 4, 3, False), ("swap",)),
        ((7, 128, 8, 3, False), ("swap",)),
        ((14, 128, 8, 3, False), ("swap",)),
        ((22, 128, 4, 3, False), ("swap",)),
        ((28, 128, 4, 3, False), ("swap",)),
        ((7, 256, 4, 2, False), ("swap",)),
    ),
    "x-B1-32/8-d128-N131072-q1-dynamic": (
        ((16, 128, 4, 3, False), ("", "ptr", "ptr+pf2")),
        ((16, 128, 8, 3, False), ("ptr+pf2",)),
    ),
}
ROUNDS = {1: CASES, 2: CASES_2, 3: CASES_3, 5: CASES_5}


def swap_check(device: str = "cuda") -> dict:
    """Round 1's CUDA test found swap-AB wrong compiled (bf16, B2 2/2 D80 q_len 1, 64-key tiles, 2 splits, TMA, head
    chunks, a valid length ending inside a tile, prefetch 1 ahead: max error 5.5e-2; without a valid length and
    without swap-AB exact). Which factor: each combination of splits (1, 2), TMA, head chunks, valid length and
    prefetch (0, 1), swap-AB against the reference and against the plain kernel of the same combination (max abs
    errors), no timing."""
    import itertools

    import torch

    from attnopt.runtime.kernels.split_kv import split_kv_decode, split_kv_workspace
    from attnopt.runtime.reference import sdpa_float64

    g = torch.Generator(device=device).manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float16  # (the interpreter computes bf16 on raw bits)
    B, H, N, D, BN = 2, 2, 9 * 64 + 11, 80, 64
    q, k, v = (torch.randn(B, H, n, D, device=device, dtype=dtype, generator=g) for n in (1, N, N))
    valid = torch.tensor([N - 40, 2 * BN + 3], dtype=torch.int32, device=device)
    kn, vn = k.clone(), v.clone()
    for b, n in enumerate(valid.tolist()):
        kn[b, :, n:] = float("nan")
        vn[b, :, n:] = float("nan")
    rows = []
    for splits, tma, chunks, with_valid, ahead in itertools.product((1, 2), (True, False), (True, False),
                                                                    (True, False), (0, 1)):
        kk, vv, lens = (kn, vn, valid) if with_valid else (k, v, None)
        ref = sdpa_float64(q, k, v, valid_len=lens)
        outs = {}
        for swap in (False, True):
            out = torch.empty_like(q)
            ws = split_kv_workspace(splits, q, kk, vv) if splits > 1 else None
            try:
                split_kv_decode(q, kk, vv, out, workspace=ws, valid_len=lens, num_splits=splits, block_n=BN, tma=tma,
                                head_chunks=chunks, swap_ab=swap, l2_prefetch=ahead)
                if device == "cuda":
                    torch.cuda.synchronize()
                outs[swap] = out
            except Exception as e:  # noqa: BLE001 - reported
                outs[swap] = f"{type(e).__name__}: {str(e)[:200]}"
        row = {"splits": splits, "tma": tma, "chunks": chunks, "valid": with_valid, "prefetch": ahead}
        for swap, o in outs.items():
            row[f"err_swap{int(swap)}"] = o if isinstance(o, str) else float((o.double() - ref).abs().max())
        if not any(isinstance(o, str) for o in outs.values()):
            row["swap_vs_plain"] = float((outs[True].float() - outs[False].float()).abs().max())
        rows.append(row)
        print("  swap-check", json.dumps(row), flush=True)
    return {"rows": rows, "bad": [r for r in rows if not isinstance(r.get("err_swap1"), float)
                                  or r["err_swap1"] > 2e-2]}


def run_case(name: str, configs, rounds: int, read_TBps: float) -> dict:
    import torch

    from split_kv_long import _tag  # this folder's (the script's own folder is on sys.path)
    from static_mask import _peer, timed_rounds

    from attnopt.bench.common import Rotation
    from attnopt.bench.planner import MAX_SETS, _make_set
    from attnopt.bench.planner_grid import case_of
    from attnopt.runtime.kernels.split_kv import split_kv_decode, split_kv_workspace
    from attnopt.runtime.reference import decode_attention

    case = case_of(name)
    B, Hq, Hkv, D, N, L, _ = case
    scale = 1.0 / math.sqrt(D)
    kv_bytes = B * Hkv * N * 2 * D * 2
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", None)
    sets = Rotation(lambda i: _make_set(i, case, torch.bfloat16, "cuda"), kv_bytes, l2, max_sets=MAX_SETS).sets
    ref = decode_attention(sets[0]["q"].float(), sets[0]["k"], sets[0]["v"], scale=scale).float()
    makers, unchecked = {"sdpa-cudnn": _peer(scale, Hq != Hkv)}, set()
    for c, variants in configs:
        splits, block_n, warps, stages, chunks = c
        ws = split_kv_workspace(splits, sets[0]["q"], sets[0]["k"], sets[0]["v"]) if splits > 1 else None
        out = torch.empty_like(sets[0]["q"])
        kw = dict(workspace=ws, scale=scale, num_splits=splits, block_n=block_n, num_warps=warps, num_stages=stages,
                  tma=True, head_chunks=chunks, merge_dv_split="auto")
        for variant in variants:
            extra = VARIANTS[variant]
            way = _tag(c) + (f" {variant}" if variant else "")
            makers[way] = (lambda o_, kw_: lambda s: lambda: split_kv_decode(s["q"], s["k"], s["v"], o_, **kw_)[0])(
                out, {**kw, **extra})
            if not extra.get("merge", True):
                unchecked.add(way)
    res = {"case": name, "shape": case, "n_keys": N, "sets": len(sets), "kv_bytes": kv_bytes,
           "floor_us": kv_bytes / (read_TBps * 1e6), **timed_rounds(makers, sets, ref, rounds, frozenset(unchecked))}
    p = res["median_us"].get("sdpa-cudnn")
    res["ratio_to_sdpa_cudnn"] = {w: (p / v if p else None) for w, v in res["median_us"].items()}
    res["stream_TBps"] = {w: kv_bytes / (v * 1e6) for w, v in res["median_us"].items()}
    del sets
    torch.cuda.empty_cache()
    return res


def verdict(results: list[dict]) -> dict:
    """Per case the fastest checked way against cuDNN and against the fastest plain config (what the tuner can pick
    now); per variant its time over its plain twin's in each case (< 1: faster), and where it won everywhere."""
    out: dict = {"cases": {}, "variants": {}}
    for r in results:
        med = r["median_us"]
        ok = {w: us for w, us in med.items() if w != "sdpa-cudnn" and r["max_abs_err"].get(w) is not None}
        plain = {w: us for w, us in ok.items() if " " not in w}
        best = min(ok, key=ok.get) if ok else None
        best_plain = min(plain, key=plain.get) if plain else None
        cudnn = med.get("sdpa-cudnn")
        out["cases"][r["case"]] = {
            "cudnn_us": cudnn, "best": best, "best_us": ok.get(best), "best_plain": best_plain,
            "best_plain_us": plain.get(best_plain),
            "best_vs_cudnn": cudnn / ok[best] if best and cudnn else None,
            "best_plain_vs_cudnn": cudnn / plain[best_plain] if best_plain and cudnn else None,
            "max_err": max((e for e in r["max_abs_err"].values() if e is not None), default=None)}
        for w, us in ok.items():
            if " " in w:
                config, variant = w.split(" ", 1)
                if config in med:
                    out["variants"].setdefault(variant, {})[f"{r['case']} {config}"] = us / med[config]
    out["wins_everywhere"] = sorted(v for v, d in out["variants"].items() if d and all(x < 1.0 for x in d.values()))
    return out


def _print(r: dict) -> None:
    print(f"{r['case']} {r['shape']} ({r['sets']} input sets, floor {r['floor_us']:.1f} µs)", flush=True)
    for w, us in sorted(r["median_us"].items(), key=lambda kv: kv[1]):
        err = r["max_abs_err"].get(w)
        spread = max(r["rounds_us"][w]) - min(r["rounds_us"][w])
        print(f"  {w:40s} {us:8.2f} µs (±{spread:5.2f})  {r['ratio_to_sdpa_cudnn'][w]:5.3f}x cuDNN  "
              f"{r['stream_TBps'][w]:5.3f} TB/s  err {'-' if err is None else f'{err:.1e}'}", flush=True)
    for w, why in r["failed"].items():
        print(f"  {w:40s} FAILED {why}", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--round", type=int, default=1, choices=sorted(ROUNDS),
                   help="which variant set (CASES, CASES_2, CASES_3, CASES_5)")
    p.add_argument("--cases", default=None, help=f"of the round's (default: all); round 1: {', '.join(CASES)}")
    p.add_argument("--swap-check", action="store_true", help="then the swap-AB correctness matrix (swap_check)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from static_mask import cuda_ready  # this folder's

    if not cuda_ready():
        return 2
    from attnopt.bench.common import read_bandwidth_TBps, results_header, write_results

    cases = ROUNDS[args.round]
    check = None
    bw = read_bandwidth_TBps(1 << 30, "graph")
    print(f"read bandwidth {bw['best']:.3f} TB/s", flush=True)
    results = []
    for name in (c.strip() for c in (args.cases or ",".join(cases)).split(",") if c.strip()):
        if name not in cases:
            raise SystemExit(f"unknown case {name!r}; valid: {', '.join(cases)}")
        results.append(run_case(name, cases[name], args.rounds, bw["best"]))
        _print(results[-1])
        if args.out:  # after every case: a run cut short keeps what it measured
            write_results(args.out, results_header("trail-variants", read_bw_TBps=bw, round=args.round,
                                                   swap_check=check, cases=results, verdict=verdict(results)))
    print(json.dumps(verdict(results), indent=1), flush=True)
    if args.swap_check:  # last: a kernel fault there cannot cost the timings above
        check = swap_check()
        print(f"swap-check: {len(check['bad'])} bad of {len(check['rows'])}: {json.dumps(check['bad'])}", flush=True)
        if args.out:
            write_results(args.out, results_header("trail-variants", read_bw_TBps=bw, round=args.round,
                                                   swap_check=check, cases=results, verdict=verdict(results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
