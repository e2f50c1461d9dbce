"""Where split-KV loses to cuDNN at long contexts, on a GPU: forced split-KV variants beside cuDNN, one run.

Issue 19, "kernels where they trail". H100 at 3fed422 (planner bench, CUDA-graph timing, L2 rotated, bf16), dynamic
caches, the tuner's pick against cuDNN replayed at the one length: corner B1 14/2 D80 512k 123.3 µs against 117.8,
lhs39 B2 24/8 D80 N144576 269.0 against 257.6, lhs25 B1 32/8 D128 N98368 142.0 against 137.3 (cuDNN at 97-100 % of
the measured read bandwidth, split-KV at 92-97 %). Per case, each way timed as ``attnopt bench planner`` times (CUDA
graph of back-to-back calls, one per rotating input set, interleaved rounds: ``static_mask.timed_rounds``), each
output checked against ``runtime/reference.py`` first:

* ``sdpa-cudnn``: SDPA's cuDNN backend at this one length (the peer);
* ``base``: the tuner's pick at 3fed422 at this length, as a dynamic cache runs it (the grid at this N, no valid
  length); ``stage1``: its first launch alone (``merge=False``: partials only; not checked), so ``base - stage1``
  is what the merge launch costs in the stream; ``nopdl``: its merge without programmatic dependent launch;
  ``fused``: the last split merging in the same launch;
* ``dv=auto`` / ``dv=2``: the merge with more programs per row (``merge_dv_split``; ``merge.auto_dv_split``: every
  partition in one step); ``chain``: stage 1 launched as a programmatic dependent of the kernel before it (the
  previous call's merge, which lets it launch early) so that back-to-back steps overlap launch with the tail;
  ``chain+auto``: both;
* split counts around the GPU's size (one and two programs per SM, and counts that divide the tiles evenly) and the
  other tile shapes (64/128/256 keys, chunked/padded head dim, 3 stages and the deepest that fits), each with
  ``chain+auto`` beside it with ``--twins``;
* ``stream_k``: the persistent grid (``STREAM_K``: one program per SM at 128-key tiles, two at 64), its split tiles
  merged in the launch, or `` merge-launch``: by a second launch (``runtime/kernels/stream_k_merge.py``).

Also ``floor_us``: the K/V bytes over the device's measured read bandwidth (``read_bandwidth_TBps``), and with
``--half`` (default 0.5) cuDNN, the pick and stream-K again at half the length, for ``fit``: each one's fixed µs and
streaming rate (the tuner's own timings at 3fed422 gave the pick 7-10 µs fixed and 2.87-2.97 TB/s at D=80, 3.08 at
D=128).
Writes JSON (medians, every round, max abs errors, failures: a config out of shared memory) to ``--out``.

    python benchmarks/split_kv_long.py --out $OUT/split-kv-long.json [--cases NAME,...] [--rounds 3] [--quick]
                                       [--twins] [--extra]
"""
from __future__ import annotations

import argparse
import json
import math
import sys

#: (case name for ``planner_grid.case_of``, the tuner's pick at 3fed422 there: splits, block_n, warps, stages,
#: head chunks).
CASES = {
    "corner-B1-g7-d80-512k-q1-dyn": (66, 256, 4, 3, True),
    "lhs39-B2-24/8-d80-N144576-q1-dynamic": (33, 64, 4, 3, True),
    "lhs25-B1-32/8-d128-N98368-q1-dynamic": (33, 128, 4, 3, False),
}

#: Launch variants of one config: name suffix -> split_kv_decode keyword arguments (and whether it is checked).
LAUNCH_WAYS = {
    "": {},
    " dv=auto": {"merge_dv_split": "auto"},
    " dv=2": {"merge_dv_split": 2},
    " chain": {"chain": True},
    " chain+auto": {"chain": True, "merge_dv_split": "auto"},
    " nopdl": {"pdl": False},
    " fused": {"fused_merge": True},
    " stage1": {"merge": False},
}

#: ``--extra``: configs beside the pick, each plain and with ``dv=auto``, after the H100 run at 32e6a4d: the fastest
#: others there (512k S66/bn128/chunks 121.91 µs against the pick's 122.77; lhs39 S8/bn256/st3/chunks 256.16 against
#: 263.93; lhs25 S16/bn64 137.44 against 139.34) and 8 warps, which that run did not time (the tuner's fastest at
#: 512k's 92672 keys was S66/bn128/w8/st3 padded).
EXTRA = {
    "corner-B1-g7-d80-512k-q1-dyn": ((66, 128, 4, 3, True), (66, 128, 8, 3, True), (66, 128, 8, 3, False),
                                     (66, 256, 8, 3, True)),
    "lhs39-B2-24/8-d80-N144576-q1-dynamic": ((8, 256, 4, 3, True), (8, 128, 4, 4, False), (8, 256, 8, 3, True),
                                             (8, 128, 8, 3, False)),
    "lhs25-B1-32/8-d128-N98368-q1-dynamic": ((16, 64, 4, 3, False), (16, 128, 4, 3, False), (16, 128, 8, 3, False),
                                             (33, 128, 8, 3, False)),
}

#: Stream-K beside them, at both lengths (programs per SM, block_n; 3 stages, the pick's head chunks): in the tuner's
#: timings at 3fed422 (lhs25, 185k and 371k keys) it streamed fastest (3.13-3.16 TB/s against split-KV's 3.08) with
#: 19-27 µs of fixed cost against 7: the fit says whether its in-launch merge is what costs.
STREAM_K = ((1, 128), (2, 64))

#: The deepest pipeline tried: at D=80 the tuner's timings at 3fed422 stream at 2.87-2.97 TB/s (the slope of its
#: times over 185k and 371k keys) against 3.08 at D=128: fewer bytes a tile, so fewer in flight per SM.
MAX_STAGES = 6


def other_configs(case, base, sms: int) -> list[tuple[int, int, int, int, bool]]:
    """Configs beside the tuner's pick: its split count, one and two programs per SM over the (batch row, KV head)
    tiles and split counts dividing the KV tiles evenly near them, at 64-, 128- and (D <= 96) 256-key tiles, chunked
    and padded where the head dim is cut, at 3 stages and the deepest pipeline up to MAX_STAGES that fits
    (``fit_stages``)."""
    from attnopt.runtime.strategies.split_kv import fit_stages
    from attnopt.site import AttentionSite

    B, Hq, Hkv, D, N, L, _ = case
    site = AttentionSite(node="bench", module_path="", pattern="sdpa", batch=B, q_heads=Hq, kv_heads=Hkv, head_dim=D,
                         q_len=L, kv_len=N, dtype="bfloat16")
    heads = B * Hkv
    out = []
    for block_n in ((64, 128, 256) if D <= 96 else (64, 128)):
        tiles = -(-N // block_n)
        fill = max(1, round(sms / heads))
        counts = {fill, 2 * fill, base[0]}
        for s in (fill, 2 * fill):  # the nearest count at or below that divides the tiles (within 10 %)
            even = next((c for c in range(s, max(1, int(s * 0.9)) - 1, -1) if tiles % c == 0), None)
            if even:
                counts.add(even)
        for chunks in ((True, False) if D in (80, 96) else (False,)):
            # 3 stages (the tuner's usual) and the deepest pipeline that fits: bytes in flight per SM
            deepest = fit_stages(site, block_n, MAX_STAGES, chunks)
            for stages in sorted({st for st in (3, deepest) if st is not None and st <= (deepest or 0)}):
                for s in sorted(counts):
                    c = (min(s, tiles), block_n, 4, stages, chunks)
                    if c != base and c not in out:
                        out.append(c)
    return out


def _tag(c) -> str:
    s, bn, w, st, chunks = c
    return f"S{s}/bn{bn}/w{w}/st{st}/{'chunks' if chunks else 'padded'}"


def run_case(name, base, rounds, sms, read_TBps, quick=False, twins=False, n_keys=None, extra=False) -> dict:
    """One case's ways (the module docstring), or with ``n_keys`` the case at that length with only cuDNN and the
    tuner's pick plain and ``dv=auto`` and stream-K (for ``fit``)."""
    import torch

    from static_mask import _peer, timed_rounds  # this folder's (the script's own folder is on sys.path)

    from attnopt.bench.common import Rotation
    from attnopt.bench.planner import MAX_SETS, _make_set
    from attnopt.bench.planner_grid import case_of
    from attnopt.runtime.kernels.split_kv import split_kv_decode, split_kv_workspace
    from attnopt.runtime.kernels.stream_k import stream_k_decode, stream_k_workspace
    from attnopt.runtime.reference import decode_attention

    case = case_of(name)
    if n_keys is not None:
        case = case[:4] + (n_keys,) + case[5:]
        quick = True
    B, Hq, Hkv, D, N, L, _ = case
    dtype = torch.bfloat16
    scale = 1.0 / math.sqrt(D)
    kv_bytes = B * Hkv * N * 2 * D * 2
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", None)
    sets = Rotation(lambda i: _make_set(i, case, dtype, "cuda"), kv_bytes, l2, max_sets=MAX_SETS).sets
    ref = decode_attention(sets[0]["q"].float(), sets[0]["k"], sets[0]["v"], scale=scale).float()

    makers, unchecked = {"sdpa-cudnn": _peer(scale, Hq != Hkv)}, set()
    short = ("", " dv=auto") if n_keys is not None else ("", " dv=auto", " chain+auto", " stage1")
    configs = [(base, LAUNCH_WAYS if not quick else {k: LAUNCH_WAYS[k] for k in short})]
    others = [] if quick else other_configs(case, base, sms)
    configs += [(c, {"": {}, **({" chain+auto": LAUNCH_WAYS[" chain+auto"]} if twins else {})}) for c in others]
    if extra and n_keys is None:
        configs += [(c, {"": {}, " dv=auto": LAUNCH_WAYS[" dv=auto"]}) for c in EXTRA.get(name, ())]
    for c, ways in configs:
        splits, block_n, warps, stages, chunks = c
        ws = split_kv_workspace(splits, sets[0]["q"], sets[0]["k"], sets[0]["v"])
        out = torch.empty_like(sets[0]["q"])
        kw = dict(workspace=ws, scale=scale, num_splits=splits, block_n=block_n, num_warps=warps, num_stages=stages,
                  tma=True, head_chunks=chunks)
        for suffix, extra in ways.items():
            way = ("base " if c == base else "") + _tag(c) + suffix
            makers[way] = (lambda o_, kw_: lambda s: lambda: split_kv_decode(s["q"], s["k"], s["v"], o_, **kw_)[0])(
                out, {**kw, **extra})
            if not extra.get("merge", True):
                unchecked.add(way)
    for per_sm, block_n in STREAM_K:  # the persistent grid: balanced shares, its merge in the launch
        grid = per_sm * sms
        ws = stream_k_workspace(grid, sets[0]["q"], sets[0]["k"], sets[0]["v"])
        out = torch.empty_like(sets[0]["q"])
        kw = dict(workspace=ws, scale=scale, grid=grid, block_n=block_n, num_warps=4, num_stages=3, tma=True,
                  head_chunks=base[4])
        for suffix, extra in (("", {}), (" merge-launch", {"merge_launch": True})):
            makers[f"stream_k G{grid}/bn{block_n}/w4/st3{suffix}"] = (
                lambda o_, kw_: lambda s: lambda: stream_k_decode(s["q"], s["k"], s["v"], o_, **kw_)[0])(
                    out, {**kw, **extra})
    res = {"case": name, "n_keys": N, "sets": len(sets), "kv_bytes": kv_bytes,
           "floor_us": kv_bytes / (read_TBps * 1e6), "base": _tag(base),
           **timed_rounds(makers, sets, ref, rounds, frozenset(unchecked))}
    p = res["median_us"].get("sdpa-cudnn")
    res["ratio_to_sdpa_cudnn"] = {w: (p / v if p else None) for w, v in res["median_us"].items()}
    res["frac_of_floor"] = {w: res["floor_us"] / v for w, v in res["median_us"].items()}
    del sets
    torch.cuda.empty_cache()
    return res


def fit(full: dict, part: dict) -> dict:
    """Per way timed at both lengths: the line through (K/V bytes, µs), as fixed µs (the time at no keys: launches,
    pipeline fill, tail, merge) and the streaming rate (TB/s of the slope). Where a way trails cuDNN, this says
    whether its fixed part or its rate is why."""
    out = {}
    for w, us in full["median_us"].items():
        other = part["median_us"].get(w)
        if other is None or full["kv_bytes"] == part["kv_bytes"]:
            continue
        slope = (us - other) / (full["kv_bytes"] - part["kv_bytes"])  # µs per byte
        out[w] = {"fixed_us": us - slope * full["kv_bytes"], "stream_TBps": 1e-6 / slope if slope > 0 else None}
    return out


def verdict(results: list[dict]) -> dict:
    """What a run says to do: per case the fastest checked way against cuDNN and against the tuner's pick; per launch
    variant of the pick (``LAUNCH_WAYS``) its time over the plain pick in every case, and whether it is faster in
    all of them (then ``runtime/strategies/split_kv.LAUNCH`` may take it)."""
    out: dict = {"cases": {}, "launch": {}}
    for r in results:
        med = r["median_us"]
        ok = {w: us for w, us in med.items() if r["max_abs_err"].get(w) is not None}
        base = next((w for w in med if w.startswith("base ") and w == "base " + r["base"]), None)
        kernel = {w: us for w, us in ok.items() if w != "sdpa-cudnn"}
        best = min(kernel, key=kernel.get) if kernel else None
        out["cases"][r["case"]] = {
            "cudnn_us": med.get("sdpa-cudnn"), "base_us": med.get(base), "best": best,
            "best_us": kernel.get(best), "best_vs_cudnn": (med["sdpa-cudnn"] / kernel[best]
                                                           if best and med.get("sdpa-cudnn") else None),
            "merge_us": (med[base] - med[base + " stage1"]) if base and base + " stage1" in med else None}
        for suffix in LAUNCH_WAYS:
            if suffix and base and base + suffix in ok:
                out["launch"].setdefault(suffix.strip(), {})[r["case"]] = ok[base + suffix] / med[base]
    out["launch_wins_everywhere"] = sorted(k for k, v in out["launch"].items()
                                           if len(v) == len(results) and all(x < 1.0 for x in v.values()))
    return out


def _print(r: dict) -> None:
    print(f"{r['case']} at N={r['n_keys']} ({r['sets']} input sets, floor {r['floor_us']:.1f} µs)", flush=True)
    for w, us in sorted(r["median_us"].items(), key=lambda kv: kv[1]):
        err = r["max_abs_err"].get(w)
        print(f"  {w:52s} {us:8.2f} µs  {r['ratio_to_sdpa_cudnn'][w]:5.3f}x cuDNN  {r['frac_of_floor'][w]:5.3f} "
              f"floor  err {'-' if err is None else f'{err:.1e}'}", flush=True)
    for w, why in r["failed"].items():
        print(f"  {w:52s} FAILED {why}", flush=True)
    for w, f in r.get("fit", {}).items():
        rate = f["stream_TBps"]
        print(f"  fit {w:48s} fixed {f['fixed_us']:6.2f} µs  streaming {'-' if rate is None else f'{rate:.3f}'} TB/s",
              flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=",".join(CASES), help=f"of {', '.join(CASES)}")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="the tuner's pick only (plain, dv=auto, chain+auto, stage "
                   "1) and stream-K")
    p.add_argument("--twins", action="store_true", help="every other config also with chain+auto")
    p.add_argument("--extra", action="store_true", help="also the EXTRA configs, each plain and with dv=auto")
    p.add_argument("--half", type=float, default=0.5, help="also time cuDNN and the pick at this fraction of N, "
                   "for the fit of fixed µs and streaming rate (0: no)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from static_mask import cuda_ready  # this folder's (the script's own folder is on sys.path)

    if not cuda_ready():
        return 2
    import torch

    from attnopt.bench.common import read_bandwidth_TBps
    from attnopt.bench.planner_grid import case_of

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bw = read_bandwidth_TBps(1 << 30, "graph")
    print(f"read bandwidth {bw['best']:.3f} TB/s", flush=True)
    results = []
    for name in (c.strip() for c in args.cases.split(",") if c.strip()):
        if name not in CASES:
            raise SystemExit(f"unknown case {name!r}; valid: {', '.join(CASES)}")
        r = run_case(name, CASES[name], args.rounds, sms, bw["best"], args.quick, args.twins, extra=args.extra)
        if args.half > 0:
            n = case_of(name)[4]
            r["at_half"] = run_case(name, CASES[name], args.rounds, sms, bw["best"],
                                    n_keys=max(256, int(n * args.half) // 256 * 256))
            r["fit"] = fit(r, r["at_half"])
            _print(r["at_half"])
        results.append(r)
        _print(r)
        if args.out:  # after every case: a run cut short keeps what it measured
            from attnopt.bench.common import results_header, write_results

            write_results(args.out, results_header("split-kv-long", read_bw_TBps=bw, cases=results,
                                                   verdict=verdict(results)))
    print(json.dumps(verdict(results), indent=1), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
