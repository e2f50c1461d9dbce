"""Where a dense (SDPA cuDNN) pick loses to SDPA's own cuDNN call, on a GPU: the same kernel reached five ways, timed
in interleaved rounds over the planner bench's rotating input sets, with the kernels each way launches.

On the H100 (planner parts at 18ffcc3 / f9e648f) the planner's pick was cuDNN and still 1-2 % slower than the
``sdpa-cudnn`` peer on three small cases (lhs01 static 22.8 vs 22.4 µs, lhs04 dynamic 13.4 vs 13.3, lhs33 dynamic
10.9 vs 10.8), while large cases tied within 0.5 %. The bench times the planner first and the peers after it, one
measurement each; this script separates a real per-call cost (an extra kernel, a copy, another cuDNN plan) from the
order of measurement:

* ``peer``: ``sdpa_kernel([CUDNN])`` around ``F.scaled_dot_product_attention`` (the bench's ``sdpa-cudnn``);
* ``dense-run``: ``Dense.run`` of ``DensePlan(backend="cudnn")``, prepared (attnopt's code around the kernel);
* ``op``: ``torch.ops.attnopt.decode_attention`` with that plan (the op the lowered graph calls);
* ``optimize``: ``attnopt.optimize(_attend)`` with that plan forced (the whole user route: dynamo, inductor);
* ``compiled``: ``torch.compile(_attend)`` without attnopt (SDPA's own pick, compiled).

Each way is timed ``--rounds`` times, the ways in a rotated order each round (CUDA-graph replay, the bench's
``time_us``); the medians and every round's µs are printed, with the kernel names one call of each way launches
(``torch.profiler``, eager). Then ``fresh_length_us`` per SDPA backend: µs of an eager call at a KV length not
called before against one at a known length (``GpuTimer.fresh_length_us``): what every step of a growing cache pays
on top if the backend builds something per shape (cuDNN's graph, unless ``TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1``).

At q_len > 1 (the last default case) the op makes its output contiguous, the layout its fake declares (463bb66):
free where SDPA's output follows q's layout (flash and cuDNN allocate it so, by torch's meta functions) and q is
contiguous, as here; one copy more than the peer otherwise, which this would show.

    python benchmarks/dense_overhead.py [--cases lhs01-B1-4/1-d96-N37376-q1-static,...] [--rounds 7]
                                        [--out $OUT/dense-overhead.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

DEFAULT_CASES = ("lhs01-B1-4/1-d96-N37376-q1-static,lhs04-B7-4/2-d96-N3264-q1-dynamic,"
                 "lhs33-B8-4/2-d80-N2048-q1-dynamic,lhs23-B14-8/8-d96-N9728-q1-dynamic,x-B1-32/8-d128-N8192-q4-fixed")


def _ways(case, sets, scale):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import attnopt
    from attnopt.bench.planner import _args_of, _attend
    from attnopt.plan import DensePlan
    from attnopt.runtime import ops  # noqa: F401  (registers torch.ops.attnopt.*)
    from attnopt.runtime.strategies import get_strategy

    cache = case[6]
    plan = DensePlan(reason="SDPA cudnn, called explicitly", backend="cudnn")
    dense = get_strategy("dense")
    state = dense.prepare(plan, sets[0]["q"], sets[0]["k"], sets[0]["v"])
    gqa = case[1] != case[2]

    def peer(s):
        def call():
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return F.scaled_dot_product_attention(s["q"], s["k"], s["v"], attn_mask=s["mask"], scale=scale,
                                                      enable_gqa=gqa)
        return call

    def dense_run(s):
        return lambda: dense.run(state, plan, s["q"], s["k"], s["v"], s["mask"], None, scale, False)

    key = plan.runtime_key()

    def op(s):
        return lambda: torch.ops.attnopt.decode_attention(s["q"], s["k"], s["v"], s["mask"], None, scale, False, key,
                                                          "dense-overhead")

    torch._dynamo.reset()
    opt = attnopt.optimize(_attend, force_plan="dense")
    if cache == "dynamic":
        for s in sets:
            torch._dynamo.maybe_mark_dynamic(s["k"], 2)
            torch._dynamo.maybe_mark_dynamic(s["v"], 2)
    compiled = torch.compile(_attend, dynamic=cache == "dynamic")
    ways = {"peer": peer, "dense-run": dense_run, "op": op,
            "optimize": lambda s: (lambda: opt(*_args_of(s, cache))),
            "compiled": lambda s: (lambda: compiled(*_args_of(s, cache)))}
    return ways, opt


def _kernels(fn) -> list[str]:
    """The CUDA kernels (and memcpy/memset) one eager call of ``fn`` launches."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name[:90] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def run_case(name, case, rounds) -> dict:
    import math

    import torch

    import attnopt
    from attnopt.bench.common import Rotation, cycle, rel_err, time_us
    from attnopt.bench.planner import MAX_SETS, _make_set
    from attnopt.runtime.reference import decode_attention

    B, Hq, Hkv, D, N, L, cache = case
    dtype = torch.bfloat16
    scale = 1.0 / math.sqrt(D)
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", None)
    rot = Rotation(lambda i: _make_set(i, case, dtype, "cuda"), B * Hkv * N * 2 * D * 2, l2, max_sets=MAX_SETS)
    sets = rot.sets
    ref = decode_attention(sets[0]["q"].float(), sets[0]["k"], sets[0]["v"], valid_len=sets[0]["valid"], scale=scale)
    ways, opt = _ways(case, sets, scale)
    calls = {w: [make(s) for s in sets] for w, make in ways.items()}
    out: dict = {"case": name, "sets": len(sets), "rel_err": {}, "kernels": {}, "rounds_us": {w: [] for w in calls}}
    for w, cs in calls.items():
        out["rel_err"][w] = rel_err(cs[0]().float(), ref)
        out["kernels"][w] = _kernels(cs[0])
    report = attnopt.last_plans(opt)
    out["optimize_plan"] = report.sites[0].chosen.describe() if report.sites and report.sites[0].chosen else None
    names = list(calls)
    for r in range(rounds):
        for w in names[r % len(names):] + names[:r % len(names)]:
            out["rounds_us"][w].append(time_us(cycle(calls[w]), "graph", min_calls=len(sets)))
    out["median_us"] = {w: statistics.median(v) for w, v in out["rounds_us"].items()}
    # a growing cache calls at a new length every step: [µs at a new length, µs at a known one], eager, per backend
    from attnopt import timer as T
    from attnopt.plan import DensePlan
    from attnopt.site import AttentionSite

    masked = case[6].startswith("static")
    site = AttentionSite.canonical(batch=B, q_heads=Hq, kv_heads=Hkv, head_dim=D, kv_len=N, q_len=L,
                                   dtype="bfloat16", mask_kind="valid_length" if masked else "none")
    probe = T.GpuTimer()
    out["fresh_length_us"] = {}
    for backend in ("cudnn", "flash"):
        try:
            out["fresh_length_us"][backend] = list(probe.fresh_length_us(DensePlan(backend=backend), site))
        except Exception as exc:  # noqa: BLE001 - flash takes no mask: say so
            out["fresh_length_us"][backend] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    probe.release()
    peer = out["median_us"]["peer"]
    out["ratio_to_peer"] = {w: peer / v for w, v in out["median_us"].items()}  # >= 1: as fast as the peer or faster
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=DEFAULT_CASES, help="planner-bench case names (any B-Hq/Hkv-dD-NN-qL-cache name)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    import os

    import torch

    os.environ["ATTNOPT_TUNE"] = "0"  # optimize() takes the model's dense pick: cuDNN first on Hopper profiles

    from attnopt.bench.planner_grid import case_of

    if not torch.cuda.is_available():
        print("dense_overhead.py needs a CUDA GPU", file=sys.stderr)
        return 2
    results = []
    for name in (c.strip() for c in args.cases.split(",") if c.strip()):
        r = run_case(name, case_of(name), args.rounds)
        results.append(r)
        print(json.dumps({k: r[k] for k in ("case", "sets", "optimize_plan", "median_us", "ratio_to_peer",
                                            "fresh_length_us")}),
              flush=True)
        for w, ks in r["kernels"].items():
            print(f"  {w:<10} {len(ks)} kernels: {ks}", flush=True)
    if args.out:  # the results format (device, versions, commit: pass ATTNOPT_COMMIT on a device copy)
        from attnopt.bench.common import results_header, write_results

        write_results(args.out, results_header("dense-overhead", cases=results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
