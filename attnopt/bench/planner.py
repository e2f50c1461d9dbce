"""``attnopt bench planner``: the planner's pick on the user's route against SDPA's backends, in one run.

For each case (``planner_grid``: the issue's named shapes, the grid's corners, a seeded Latin-hypercube sample of
the grid, a few shapes off it; with ``--cases`` only the cases named, which may include the e2e bench's nearly full
static caches, ``e2e-*``, and sampled or held-out shapes by a name that spells them, ``planner_grid.case_of``), a function calling ``F.scaled_dot_product_attention`` (``enable_gqa`` for GQA,
the mask passed in for a static cache) goes through ``attnopt.optimize`` with the datasheet profile, exactly as a
user calls it, with the measured choice on (``ATTNOPT_TUNE=1``, a fresh tuning cache; timing device time as for
``mode="reduce-overhead"``, since this bench times CUDA-graph replays). Its first call (compile, plan, tuning) is
timed as ``compile_s`` and the part of it spent tuning as ``tune_s``; what the tuner timed is kept (``tuning``: per
timed length, every candidate's µs, from the tuning cache's new records). Then, in the same run and over the same
rotating input sets (spanning several L2 sizes; one call per set per replay), every method is timed by CUDA-graph
replay and checked against an fp32 reference:

* ``attnopt:planner``: the compiled function (tuned choice);
* ``attnopt:model`` (unless ``--no-compare-model``): the same with ``ATTNOPT_TUNE=0``, the cost model's pick alone
  (what a user gets while tuning is opt-in);
* the peers: SDPA with flash, cuDNN and efficient forced (K/V expanded once outside the timing where a backend
  lacks ``enable_gqa``), for a static GQA cache Hugging Face's StaticCache SDPA path compiled (``repeat_kv`` each
  call, then SDPA with the mask), and with ``--compiled-peer`` ``torch.compile`` of the same function without
  attnopt.

The pick and the peers within 5 % of the best are then timed ``--retime`` more times each in alternating order, and
each keeps its median (``us_samples``), so that the order of measurement does not decide a tie of one kernel.

A dynamic case also times one eager call of the pick and of sdpa-cudnn at KV lengths not called before against
lengths called before (``fresh_length_us``): every step of a growing cache is a new length, and PyTorch builds a
cuDNN SDPA graph per length. ``growing_ratio_to_best_peer`` charges each its excess per step (``growing_us``);
``ratio_to_best_peer`` is the replayed time at one length alone.

Per case: the ratio best peer / ours (>= 1: we are faster), the fraction of the HBM read roofline (the valid K/V
bytes over the read bandwidth measured in the same run), the first-call seconds, and for static caches the
speedup over the best SDPA over the whole cache. ``overall``: min ratio, geometric mean, the count >= 0.99, the
static-cache check (``static-4k-of-32k`` >= 5x), first-call seconds. ``--time-budget`` stops starting new cases;
``--part I/K`` runs every K-th case, so K device calls cover them all, and ``--merge`` joins their files.

``--smoke`` runs three tiny cases on the CPU (split-KV forced through the Triton interpreter, host timing, the
eager inner backend, SDPA's CPU path as the peer): the code path, not a measurement (the CPU test).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from typing import Any, Callable

from attnopt.checks import float_at_least

from .planner_grid import STATIC_KINDS, all_cases, valid_len_of
from .planner_summary import (REL_ERR_OK, merge, overall, parse_part, print_summary, summarize,  # noqa: F401
                              tuning_records)  # (tuning_records: re-exported, the tests')
from .planner_timing import (Clock, _error, cudnn_call, fresh_length_us, growing_us,  # noqa: F401
                             retime)  # (growing_us: the tests')

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
#: Input sets per case at most (small shapes need many to span the L2).
MAX_SETS = 256
#: --smoke: (B, Hq, Hkv, D, N, q_len, cache), tiny enough for the interpreter.
SMOKE_CASES = {"smoke-fixed": (1, 4, 2, 64, 96, 1, "fixed"), "smoke-dynamic": (1, 4, 2, 64, 80, 1, "dynamic"),
               "smoke-static": (2, 4, 2, 64, 64, 4, "static")}


def register(sub) -> None:
    p = sub.add_parser("planner", help="the planner's pick through optimize() vs SDPA's backends, on a wide grid",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run_cli)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=None, help="results JSON (default: benchmarks/results/planner-<device>.json)")
    p.add_argument("--grid", type=int, default=40, help="Latin-hypercube grid shapes (default 40)")
    p.add_argument("--off-grid", type=int, default=4, help="seeded shapes off the grid (default 4)")
    p.add_argument("--seed", type=int, default=19, help="seed of the sample (default 19)")
    p.add_argument("--cases", default=None,
                   help="only these cases (comma-separated; named, corner or e2e-* names, or a shape spelled as the "
                        "sampled cases are: PREFIX-B<b>-<Hq>/<Hkv>-d<D>-N<N>-q<L>-<cache>), before the sample")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--inner-backend", default=None,
                   help="optimize()'s inner backend, and torch.compile's for the compiled peer (default: inductor; "
                        "eager with --smoke)")
    p.add_argument("--no-compare-model", dest="compare_model", action="store_false",
                   help="skip timing the cost model's pick alone (ATTNOPT_TUNE=0; a second compile per case)")
    p.add_argument("--compiled-peer", action="store_true",
                   help="also time torch.compile of the function without attnopt (SDPA's own pick, compiled: one more "
                        "inductor compile per case)")
    p.add_argument("--part", default=None, metavar="I/K",
                   help="only every K-th case from the I-th (0-based): spread the cases over K device calls")
    p.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                   help="no run: join the results files of --part runs into --out (rows, summaries, overall)")
    p.add_argument("--time-budget", type=float_at_least(0), default=420.0,
                   help="seconds; no new case starts after this (default 420; 0: no limit)")
    p.add_argument("--retime", type=int, default=2,
                   help="time the planner's pick and the closest peers this many more times each, alternating, and "
                        "keep each one's median (default 2; 0: one measurement each)")
    p.add_argument("--keep-cache", action="store_true",
                   help="use the user's tuning cache instead of a fresh one (compile_s then excludes tuning)")
    p.add_argument("--smoke", action="store_true", help="three tiny cases on the CPU: the code path only")
    p.add_argument("--commit", default=None, help="commit sha to record (default: git rev-parse HEAD)")


def _attend(q, k, v, mask=None):
    import torch.nn.functional as F

    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


def _hf_static_attend(q, k, v, mask):
    """What Hugging Face's SDPA attention runs over a StaticCache: K/V expanded to the query heads
    (``repeat_kv``: expand + reshape), then SDPA with the bool mask and no ``enable_gqa``."""
    import torch.nn.functional as F

    b, hkv, n, d = k.shape
    g = q.shape[1] // hkv
    k = k[:, :, None].expand(b, hkv, g, n, d).reshape(b, hkv * g, n, d)
    v = v[:, :, None].expand(b, hkv, g, n, v.shape[-1]).reshape(b, hkv * g, n, v.shape[-1])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _make_set(i, case, dtype, device):
    """Input set ``i``: q (B, Hq, L, D), k/v (B, Hkv, N, D); a static case adds its bool mask (B, 1, L, N) and the
    (B,) valid length the reference uses."""
    import torch

    B, Hq, Hkv, D, N, L, cache = case
    g = torch.Generator(device=device).manual_seed(1234 + i)
    s = {"q": torch.randn(B, Hq, L, D, device=device, dtype=dtype, generator=g),
         "k": torch.randn(B, Hkv, N, D, device=device, dtype=dtype, generator=g),
         "v": torch.randn(B, Hkv, N, D, device=device, dtype=dtype, generator=g), "mask": None, "valid": None}
    valid = valid_len_of(case)
    if valid is not None:
        s["valid"] = torch.full((B,), valid, device=device, dtype=torch.int32)
        s["mask"] = (torch.arange(N, device=device) < valid)[None, None, None, :].expand(B, 1, L, N).contiguous()
    return s


def _args_of(s, cache):
    return (s["q"], s["k"], s["v"]) + ((s["mask"],) if cache in STATIC_KINDS else ())


def _optimized_row(base, method, sets, case, ref, clock, args, hw_name, tune: str,
                   inner: str | None = None, keep: dict[str, Callable[[], Any]] | None = None) -> dict[str, Any]:
    """``optimize(_attend)`` with ``ATTNOPT_TUNE=tune`` (inner backend ``inner``, default ``--inner-backend``):
    first-call seconds, plan, error, time. ``keep``: gets the timed call by method (for ``planner_timing.retime``)."""
    import torch

    import attnopt
    from .common import cycle, graph_timed_tuning, rel_err

    row = dict(base, method=method, peer=False)
    os.environ["ATTNOPT_TUNE"] = tune
    try:
        torch._dynamo.reset()
        # --smoke forces split-KV, so that the CPU run goes through the (interpreted) kernels, not the CPU's dense pick
        forced = {"force_plan": "split_kv"} if args.smoke else {}
        opt = attnopt.optimize(_attend, hardware=hw_name, inner_backend=inner or args.inner_backend, **forced)
        if case[6] == "dynamic":  # a growing cache: the KV length is symbolic, planned per bucket
            for s in sets:
                torch._dynamo.maybe_mark_dynamic(s["k"], 2)
                torch._dynamo.maybe_mark_dynamic(s["v"], 2)
        clock.sync()
        from attnopt.tuning import TuningCache

        before = TuningCache().load() if tune == "1" else {}
        t0 = time.perf_counter()
        with graph_timed_tuning(tune == "1" and clock.device == "cuda"):
            out = opt(*_args_of(sets[0], case[6]))
        clock.sync()
        row["compile_s"] = round(time.perf_counter() - t0, 3)
        if tune == "1":
            row["tuning"] = tuning_records(before, TuningCache().load())
            row["tune_s"] = round(sum(r.get("tune_s") or 0.0 for r in row["tuning"]), 3)
        row["rel_err"] = rel_err(out.float(), ref)
        if clock.device == "cuda":
            # the first call ran eagerly (pointer tiles); the timing replays what a captured graph runs (TMA tiles):
            # that variant's output is checked too (a wrong kernel that only the timed variant reached went unseen)
            from attnopt.runtime.kernels.common import tma_as_captured

            with tma_as_captured():
                row["rel_err_captured"] = rel_err(opt(*_args_of(sets[0], case[6])).float(), ref)
        report = attnopt.last_plans(opt)
        site = report.rewritten[0] if report.rewritten else (report.sites[0] if report.sites else None)
        if site is not None:
            row.update(plan=site.chosen.describe() if site.chosen else None, rewritten=site.rewritten,
                       choice=site.choice, est_us=site.chosen.est_us if site.chosen else None,
                       tuned_us=None if math.isnan(site.measured_us) else site.measured_us,
                       why_untouched=site.reason_untouched)
        fn = cycle([lambda s=s: opt(*_args_of(s, case[6])) for s in sets])
        row["us"] = clock.time(fn, len(sets))
        row["timing"] = clock.last
        if keep is not None:
            keep[method] = fn
        if case[6] == "dynamic" and clock.device == "cuda":
            row["fresh_length_us"] = fresh_length_us(lambda s: (lambda: opt(*_args_of(s, case[6]))), sets[0])
    except Exception as exc:  # report and go on: one failing case must not lose the run
        row["error"] = _error(exc)
    return row


def _peer_rows(base, case, sets, ref, scale, clock, args,
               keep: dict[str, Callable[[], Any]] | None = None) -> list[dict[str, Any]]:
    """SDPA with each backend forced (GPU), or SDPA's own path (CPU); torch.compile of the same function. ``keep``:
    gets each peer's timed call by method (for ``planner_timing.retime``)."""
    import torch

    from .common import cycle, rel_err
    from .kernels import _peer_methods

    B, Hq, Hkv, D, N, L, cache = case
    makers: list[tuple[str, Callable, str | None]] = []
    if clock.device == "cuda":
        for m in _peer_methods(B, Hq, Hkv, D, N, valid_len_of(case), scale,
                               argparse.Namespace(no_flex=True, no_eager_peer=True)):
            makers.append((m.name, m.make, None))
    else:
        makers.append(("sdpa", lambda s: (lambda: _attend(*_args_of(s, cache))), None))
    if args.compiled_peer or args.smoke:
        compiled = torch.compile(_attend, backend=args.inner_backend, dynamic=cache == "dynamic")
        makers.append(("torch-compile", lambda s: (lambda: compiled(*_args_of(s, cache))),
                       "torch.compile of the same function, without attnopt"))
    if cache in STATIC_KINDS and Hq != Hkv:
        hf = torch.compile(_hf_static_attend, backend=args.inner_backend)
        makers.append(("hf-static-compiled", lambda s: (lambda: hf(*_args_of(s, cache))),
                       "Hugging Face's StaticCache SDPA path (repeat_kv, then SDPA with the mask), compiled"))
    rows = []
    for name, make, note in makers:
        row = dict(base, method=name, peer=True, **({"note": note} if note else {}))
        try:
            calls = [make(s) for s in sets]
            if getattr(calls[0], "note", None):
                row["note"] = calls[0].note
            row["rel_err"] = rel_err(calls[0]().float(), ref)
            fn = cycle(calls)
            row["us"] = clock.time(fn, len(calls))
            row["timing"] = clock.last
            if keep is not None:
                keep[name] = fn
            if cache == "dynamic" and clock.device == "cuda" and name == "sdpa-cudnn":
                row["fresh_length_us"] = fresh_length_us(lambda s: cudnn_call(s, scale, Hq != Hkv), sets[0])
        except Exception as exc:
            row["error"] = _error(exc)
        rows.append(row)
    return rows


def run(args, on_case: Callable[[dict[str, Any]], Any] | None = None) -> dict[str, Any]:
    import torch

    from attnopt.hardware import detect_profile
    from attnopt.runtime.reference import decode_attention

    from .common import Rotation, read_bandwidth_TBps, results_header

    device = "cpu" if args.smoke else "cuda"
    clock = Clock(device)
    args.inner_backend = args.inner_backend or ("eager" if args.smoke else "inductor")
    if args.smoke:
        cases = dict(SMOKE_CASES)
    else:
        named = tuple(c.strip() for c in args.cases.split(",") if c.strip()) if args.cases else None
        cases = all_cases(args.grid, args.off_grid, args.seed, named)
        if args.part:
            i, k = parse_part(args.part)
            cases = {name: c for j, (name, c) in enumerate(cases.items()) if j % k == i}
    if not args.keep_cache:
        os.environ["ATTNOPT_CACHE_DIR"] = tempfile.mkdtemp(prefix="attnopt-planner-bench-")
    tune_before = os.environ.get("ATTNOPT_TUNE")
    for limit in ("cache_size_limit", "recompile_limit"):  # the name differs across torch versions
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, max(getattr(torch._dynamo.config, limit), 64))
    dtype_name = "float32" if args.smoke else DTYPES[args.dtype]
    dtype = getattr(torch, dtype_name)
    hw_name = detect_profile().name
    reads = read_bandwidth_TBps() if device == "cuda" else {"best": None}
    read_bw = reads["best"]
    results = results_header("planner", commit=args.commit, read_bw_TBps=read_bw and round(read_bw, 4),
                             read_bw_detail=reads, dtype=dtype_name, timing="graph" if device == "cuda" else "host",
                             profile=hw_name, inner_backend=args.inner_backend, seed=args.seed,
                             tuning_cache=os.environ.get("ATTNOPT_CACHE_DIR", "user cache"),
                             timing_note="us: median per call over CUDA-graph replays of back-to-back calls, one per "
                                         "rotating input set (the sets span several L2 sizes)")
    print(f"device {results['device']}: read {read_bw} TB/s; profile {hw_name}; torch {results['torch']}, "
          f"triton {results['triton']}; {len(cases)} cases", flush=True)
    t_start = time.time()
    summaries = []
    try:
        for name, case in cases.items():
            if args.time_budget and time.time() - t_start > args.time_budget:
                results.setdefault("skipped_cases", []).append(name)
                continue
            summaries.append(_run_case(name, case, dtype, dtype_name, clock, args, hw_name, read_bw, results,
                                       Rotation, decode_attention))
            results["summary"] = summaries
            results["overall"] = overall(summaries)
            if on_case is not None:
                on_case(results)
    finally:
        if tune_before is None:
            os.environ.pop("ATTNOPT_TUNE", None)
        else:
            os.environ["ATTNOPT_TUNE"] = tune_before
    results["summary"] = summaries
    results["overall"] = overall(summaries)
    results["elapsed_s"] = round(time.time() - t_start, 1)
    print_summary(results)
    return results


def _run_case(name, case, dtype, dtype_name, clock, args, hw_name, read_bw, results, Rotation, decode_attention):
    import torch

    B, Hq, Hkv, D, N, L, cache = case
    valid = valid_len_of(case)
    kv_bytes = B * Hkv * (valid or N) * 2 * D * dtype.itemsize
    floor_us = kv_bytes / (read_bw * 1e12) * 1e6 if read_bw else None
    scale = 1.0 / math.sqrt(D)
    print(f"\n== {name}: B={B} H={Hq}/{Hkv} D={D} N={N} q={L} {cache}" + (f" valid={valid}" if valid else "")
          + (f"  floor {floor_us:.1f} µs" if floor_us else ""), flush=True)
    rot = Rotation(lambda i: _make_set(i, case, dtype, clock.device), B * Hkv * N * 2 * D * dtype.itemsize,
                   results.get("l2_bytes") if clock.device == "cuda" else None,
                   max_sets=MAX_SETS if clock.device == "cuda" else 2)
    sets = rot.sets
    s0 = sets[0]
    # fp32 reference in partitions of about 1 GB of K/V (a set holds up to 6 GB; one fp32 copy of it would not fit)
    ref = decode_attention(s0["q"].float(), s0["k"], s0["v"], valid_len=s0["valid"], scale=scale,
                           num_partitions=max(1, B * Hkv * N * 2 * D * dtype.itemsize >> 30))
    base = {"case": name, "B": B, "Hq": Hq, "Hkv": Hkv, "D": D, "N": N, "q_len": L, "cache": cache,
            "valid_len": valid, "dtype": dtype_name, "floor_us": floor_us, "rotation_sets": rot.count}
    keep: dict[str, Callable[[], Any]] = {}
    planner = _optimized_row(base, "attnopt:planner", sets, case, ref, clock, args, hw_name, "1", keep=keep)
    peers = _peer_rows(base, case, sets, ref, scale, clock, args, keep=keep)
    # before the model's row, whose dynamo reset would make the planner's function compile again
    retime([planner] + peers, keep, clock, args.retime, len(sets), REL_ERR_OK)
    keep.clear()
    rows = [planner]
    if args.compare_model:
        # the eager inner backend: the same op and kernels replay in the graph, one inductor compile fewer per case
        rows.append(_optimized_row(base, "attnopt:model", sets, case, ref, clock, args, hw_name, "0", inner="eager"))
    rows += peers
    for r in rows:
        if r.get("us") and floor_us:
            r["frac_of_roofline"] = floor_us / r["us"]
    summary = summarize(name, case, rows)
    for r in rows:
        print(f"  {r['method']:<16} " + (f"{r['us']:9.1f} µs  roof {r.get('frac_of_roofline') or 0:5.2f}  "
                                         f"err {r['rel_err']:.1e}" if r.get("us") else r.get("error", "")), flush=True)
    if "ratio_to_best_peer" in summary:
        print(f"  -> {summary['ratio_to_best_peer']:.3f}x best peer ({summary['best_peer']}); "
              f"{summary.get('choice')} {summary.get('plan')}; first call {summary.get('compile_s')} s", flush=True)
    results["rows"].extend(rows)
    del rot, sets, s0, ref
    if clock.device == "cuda":
        torch.cuda.empty_cache()
    return summary


def run_cli(args) -> int:
    import torch

    from .common import write_results

    if args.part:
        parse_part(args.part)
    if args.smoke and (args.cases or args.part):  # the smoke runs its own three cases: the choice was dropped
        raise ValueError("--smoke runs its three fixed cases on the CPU; drop --cases / --part, or drop --smoke")
    if args.merge:
        if not args.out:
            raise ValueError("--merge needs --out (the joined results file)")
        results = merge(args.merge)
        print_summary(results)
        print(f"\nwrote {write_results(args.out, results)}")
        return 0
    if not args.smoke and not torch.cuda.is_available():
        raise ValueError("attnopt bench planner needs a CUDA GPU (--smoke runs its code path on the CPU)")
    from .kernels import _slug

    device = "cpu-smoke" if args.smoke else _slug(torch.cuda.get_device_name())
    out = args.out or f"benchmarks/results/planner-{device}.json"
    results = run(args, on_case=lambda partial: write_results(out, partial))
    print(f"\nwrote {write_results(out, results)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m attnopt.bench.planner", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run_cli(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
