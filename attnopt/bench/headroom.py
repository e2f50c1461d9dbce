"""``attnopt bench headroom``: how far the decode kernels are from what the hardware allows, and whether a wider
split-KV / stream-K sweep than the planner offers closes a gap.

Per case of ``attnopt bench kernels`` (bf16, CUDA-graph timing with the bench's L2 rotation), side by side:

* ``read-floor``: the fastest streaming read of exactly the case's K/V bytes (no attention at all), over a few
  grid sizes and load widths: no kernel that reads K and V once can beat it;
* the peers, SDPA flash and cuDNN;
* split-KV over ``--splits`` x ``--configs`` and stream-K over ``--stream-k-grids`` (programs per SM) x
  ``--stream-k-configs``, every plan checked against the reference (a row over 2e-2 relative error is reported
  as BAD and left out of the summary).

It decides which configurations the planner offers (``runtime/strategies/split_kv.py``); the sweeps behind the
current ones are ``benchmarks/results/experiments/kernel-headroom-*.json`` (their history in git).
"""
from __future__ import annotations

import argparse
import itertools
import math
from typing import Any, Sequence

from .common import format_table, results_header, write_results

#: The last sweep's defaults: split counts whose grid is a whole number of programs per SM with 8 KV heads
#: (33 x 8 = 2 x 132) against 16 splits (128 programs).
DEFAULT_CASES = "llama3-8b-128k,llama3-8b-512k,llama3-8b-32k"
DEFAULT_SPLITS = "16,33,66"
DEFAULT_CONFIGS = "64x4x3,128x4x3"
#: A result row with a larger relative error than this is wrong, not slow.
MAX_REL_ERR = 2e-2


def parse_ints(text: str, what: str) -> tuple[int, ...]:
    """``"16,33"`` -> (16, 33); an empty string -> (); anything else is a ``ValueError`` naming ``what``."""
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{what}: {text!r} is not a comma-separated list of whole numbers") from None
    if any(v < 1 for v in values):
        raise ValueError(f"{what}: {text!r}: every value must be >= 1")
    return values


def parse_configs(text: str, what: str) -> tuple[tuple[int, int, int], ...]:
    """``"64x4x3,128x4x3"`` -> ((64, 4, 3), (128, 4, 3)): (block_n, num_warps, num_stages) per kernel config."""
    configs = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        parts = item.split("x")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"{what}: {item!r} is not BLOCK_NxWARPSxSTAGES (e.g. 64x4x3)")
        configs.append(tuple(int(p) for p in parts))
    return tuple(configs)


def sweep_plans(kv_len: int, sms: int, splits: Sequence[int], configs: Sequence[tuple[int, int, int]],
                grids: Sequence[int], stream_k_configs: Sequence[tuple[int, int, int]]) -> list:
    """The plans timed for one case: split-KV for each split count (at most one split per 32 keys) and config,
    stream-K for each grid (programs per SM times ``sms``) and config. Every plan reads K/V tiles through TMA."""
    from attnopt.plan import SplitKVPlan, StreamKPlan

    max_splits = -(-kv_len // 32)
    plans: list[Any] = [SplitKVPlan(num_splits=s, block_n=b, num_warps=w, num_stages=st, tma=True)
                        for s, (b, w, st) in itertools.product(splits, configs) if s <= max_splits]
    plans += [StreamKPlan(grid=g * sms, block_n=b, num_warps=w, num_stages=st, tma=True)
              for g, (b, w, st) in itertools.product(grids, stream_k_configs)]
    return plans


def summarize(case: str, rows: Sequence[dict[str, Any]], floor_us: float) -> dict[str, Any]:
    """The case's read floor, best peer and best attnopt plan, over the rows that ran and are exact."""
    ok = [r for r in rows if r.get("us") is not None and r.get("rel_err", 1.0) < MAX_REL_ERR]
    peers = sorted((r for r in ok if r.get("peer") is True), key=lambda r: r["us"])
    ours = sorted((r for r in ok if r.get("peer") is False), key=lambda r: r["us"])
    best_peer, best = (peers[0] if peers else None), (ours[0] if ours else None)
    return dict(case=case, read_floor_us=floor_us, best_peer=best_peer and best_peer["method"],
                best_peer_us=best_peer and best_peer["us"], best=best and best["method"], best_us=best and best["us"],
                peer_over_best=(best_peer["us"] / best["us"]) if best_peer and best else None,
                floor_over_best=(floor_us / best["us"]) if best else None,
                bad=[r["method"] for r in rows if r.get("error") or r.get("rel_err", 0.0) >= MAX_REL_ERR])


def read_floor_us(kv_bytes: int, l2_bytes: int) -> tuple[float, str]:
    """Fastest streaming read of ``kv_bytes`` (rotated buffers so that every call misses in L2), and how."""
    import torch

    from .common import Rotation, _read_kernel, cycle, time_us

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


def measure_case(case: str, args: argparse.Namespace, l2: int, sms: int) -> tuple[list[dict[str, Any]], float]:
    """Every row of one case (read floor, peers, the sweep) and its read floor in µs."""
    import torch

    from attnopt.runtime.reference import decode_attention

    from .common import Rotation, cycle, rel_err, time_us
    from .kernels import CASES, _make_set, _peer_methods, plan_call

    B, Hq, Hkv, D, N, valid = CASES[case]
    kv_bytes = B * Hkv * N * 2 * D * 2
    floor_us, floor_how = read_floor_us(kv_bytes, l2)
    rot = Rotation(lambda i: _make_set(i, B, Hq, Hkv, D, N, 1, valid, torch.bfloat16), kv_bytes, l2)
    s0 = rot.sets[0]
    scale = 1 / math.sqrt(D)
    ref = decode_attention(s0["q"].float(), s0["k"], s0["v"], scale=scale).float()
    rows: list[dict[str, Any]] = [dict(case=case, method="read-floor", us=floor_us, how=floor_how, rel_err=0.0)]

    def timed(name: str, make, **extra) -> None:
        try:
            fn = cycle([make(s) for s in rot.sets])
            out = fn()
            torch.cuda.synchronize()
            rows.append(dict(case=case, method=name, us=time_us(fn, "graph"), rel_err=rel_err(out.float(), ref),
                             **extra))
        except Exception as exc:  # noqa: BLE001 - a config out of shared memory is a row, not the end of the run
            rows.append(dict(case=case, method=name, error=f"{type(exc).__name__}: {exc}"[:300], **extra))

    for m in _peer_methods(B, Hq, Hkv, D, N, valid, scale, argparse.Namespace(no_flex=True, no_eager_peer=True)):
        if m.name in ("sdpa-flash", "sdpa-cudnn"):
            timed(m.name, m.make, peer=True)
    for plan in sweep_plans(N, sms, args.splits, args.configs, args.stream_k_grids, args.stream_k_configs):
        timed(plan.describe(), lambda st, plan=plan: plan_call(plan, st, scale), peer=False, plan=plan.to_json())
    del rot
    torch.cuda.empty_cache()
    return rows, floor_us


def register(suites) -> None:
    p = suites.add_parser("headroom", help="read floor, cuDNN/flash and a wide split-KV/stream-K sweep per case")
    p.add_argument("--cases", default=DEFAULT_CASES, help="comma-separated cases of `bench kernels`")
    p.add_argument("--splits", default=DEFAULT_SPLITS, help="split-KV split counts")
    p.add_argument("--configs", default=DEFAULT_CONFIGS, help="split-KV BLOCK_NxWARPSxSTAGES configs")
    p.add_argument("--stream-k-grids", default="1", help="stream-K grids in programs per SM ('' for none)")
    p.add_argument("--stream-k-configs", default="64x4x3", help="stream-K BLOCK_NxWARPSxSTAGES configs")
    p.add_argument("--out", help="write the results JSON here (after every case: a cut-off run keeps its rows)")
    p.set_defaults(func=run)


def run(args) -> int:
    from .kernels import CASES

    try:
        cases = [c for c in args.cases.split(",") if c]
        unknown = [c for c in cases if c not in CASES]
        if unknown:
            raise ValueError(f"unknown case(s) {', '.join(unknown)}; known: {', '.join(CASES)}")
        args.splits = parse_ints(args.splits, "--splits")
        args.stream_k_grids = parse_ints(args.stream_k_grids, "--stream-k-grids")
        args.configs = parse_configs(args.configs, "--configs")
        args.stream_k_configs = parse_configs(args.stream_k_configs, "--stream-k-configs")
    except ValueError as exc:
        print(f"attnopt bench headroom: {exc}")
        return 2
    import torch

    if not torch.cuda.is_available():
        print("attnopt bench headroom: needs a CUDA GPU (it times Triton kernels against cuDNN); none found")
        return 2
    results = results_header("headroom")
    l2 = results.get("l2_bytes") or (50 << 20)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    results["summary"] = []
    for case in cases:
        rows, floor_us = measure_case(case, args, l2, sms)
        results["rows"] += rows
        results["summary"].append(summarize(case, rows, floor_us))
        if args.out:
            write_results(args.out, results)
    print(format_table(results["summary"], [
        ("case", "case", ""), ("read_floor_us", "read floor µs", ".2f"), ("best_peer", "best peer", ""),
        ("best_peer_us", "peer µs", ".2f"), ("best_us", "attnopt best µs", ".2f"), ("peer_over_best", "peer/ours", ".3f"),
        ("best", "best plan", "")]))
    bad = [m for s in results["summary"] for m in s["bad"]]
    if bad:
        print("BAD (error or rel_err >= 2e-2):", ", ".join(bad))
    return 0
