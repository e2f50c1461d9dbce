"""``attnopt bench kernels``: single-GPU decode attention, attnopt's kernels against every peer, in one process.

For each case (``--cases``, default all: Llama-3-8B's 32/8 heads at D=128 from 8k to 512k keys, SmolLM2's 9/3
heads at D=64, 56-head MHA, batches of 8 and 64, and a static cache) it times, on rotating inputs that span
several L2 sizes:

* the peers: SDPA with each backend forced (flash, cuDNN, efficient; ``enable_gqa``), FlexAttention compiled
  (``torch.compile(flex_attention)``, ``enable_gqa``), and the eager matmul-softmax-matmul (HF's eager path,
  ``repeat_kv`` included);
* attnopt: every candidate plan of the ``split_kv`` and ``stream_k`` strategies, and the planner's choice (the
  lowest estimate among them and ``dense``).

Every method's output is checked against an fp32 reference (relative error). Times are medians (see
``attnopt.bench.common.time_us``): ``us`` in the chosen primary mode (CUDA-graph replay by default), ``us_eager``
with ``triton.testing.do_bench``. The roofline is the KV bytes that must be read over the read bandwidth
measured in the same run. The static-cache case holds 4k valid tokens in a 32k cache: peers run over the full
cache with its boolean mask (what SDPA sees in a Hugging Face StaticCache graph); attnopt takes the valid
length as a device tensor.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

from attnopt.checks import float_at_least

#: name -> (B, Hq, Hkv, D, N, valid length or None)
CASES: dict[str, tuple[int, int, int, int, int, int | None]] = {
    "llama3-8b-8k": (1, 32, 8, 128, 8192, None),
    "llama3-8b-32k": (1, 32, 8, 128, 32768, None),
    "llama3-8b-128k": (1, 32, 8, 128, 131072, None),
    "llama3-8b-512k": (1, 32, 8, 128, 524288, None),
    "smollm2-8k": (1, 9, 3, 64, 8192, None),
    "smollm2-128k": (1, 9, 3, 64, 131072, None),
    "mha56-d64-64k": (1, 56, 56, 64, 65536, None),
    "llama3-8b-B8-32k": (8, 32, 8, 128, 32768, None),
    "llama3-8b-B64-4k": (64, 32, 8, 128, 4096, None),
    "static-4k-of-32k": (1, 32, 8, 128, 32768, 4096),
}
QUICK = ("llama3-8b-8k", "smollm2-8k", "llama3-8b-128k", "static-4k-of-32k")
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
#: Relative error above which a method's row is marked wrong (bf16 outputs land near 3e-3).
REL_ERR_OK = 2e-2


def register(sub) -> None:
    p = sub.add_parser("kernels", help="single-GPU decode kernels vs SDPA / cuDNN / FlexAttention / eager",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run_cli)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=None, help="results JSON path (default: benchmarks/results/kernels-<device>.json)")
    p.add_argument("--quick", action="store_true", help=f"only the cases {', '.join(QUICK)}")
    p.add_argument("--cases", default=None, help=f"comma-separated case names; known: {', '.join(CASES)}")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="input dtype (default bf16)")
    p.add_argument("--timing", default="both", choices=("graph", "eager", "both"),
                   help="graph: CUDA-graph replay medians (primary); eager: do_bench medians; both (default)")
    p.add_argument("--no-flex", action="store_true", help="skip FlexAttention (its compiles take seconds per shape)")
    p.add_argument("--no-eager-peer", action="store_true", help="skip the eager matmul-softmax-matmul peer")
    p.add_argument("--max-candidates", type=int, default=0, help="at most this many candidates per strategy (0: all)")
    p.add_argument("--time-budget", type=float_at_least(0), default=0.0,
                   help="seconds; past this, skip FlexAttention and eager timing for the remaining cases (0: none)")
    p.add_argument("--commit", default=None, help="commit sha to record (default: git rev-parse HEAD)")


def run_cli(args) -> int:
    import torch

    if not torch.cuda.is_available():
        raise ValueError("attnopt bench kernels needs a CUDA GPU")
    from .common import write_results

    out = args.out or f"benchmarks/results/kernels-{_slug(torch.cuda.get_device_name())}.json"
    # Written after every case, so a run cut short still leaves its finished cases behind.
    results = run(args, on_case=lambda partial: write_results(out, partial))
    path = write_results(out, results)
    print(f"\nwrote {path}")
    return 0


def _slug(name: str) -> str:
    return "".join(c.lower() if c.isalnum() else "-" for c in name).strip("-").replace("--", "-")


@dataclass
class Method:
    name: str  # e.g. "sdpa-cudnn", "attnopt:stream_k"
    peer: bool  # a peer (counts for "best peer") or attnopt
    make: Callable[[Any], Callable[[], Any]]  # input set -> zero-argument call returning the output
    plan: str | None = None
    est_us: float | None = None
    planner_choice: bool = False
    note: str | None = None


def _peer_methods(B, Hq, Hkv, D, N, valid, scale, args) -> list[Method]:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    G = Hq // Hkv
    methods = []
    for name, backend in (("sdpa-flash", SDPBackend.FLASH_ATTENTION), ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("sdpa-efficient", SDPBackend.EFFICIENT_ATTENTION)):
        def make(s, backend=backend):
            def call_with(k, v, gqa):
                def call():
                    with sdpa_kernel([backend]):
                        return F.scaled_dot_product_attention(s["q"], k, v, attn_mask=s["mask"], scale=scale,
                                                              enable_gqa=gqa)
                return call
            call = call_with(s["k"], s["v"], G > 1)
            if G > 1:
                try:
                    call()
                except RuntimeError:
                    # This backend lacks enable_gqa: give it K/V expanded once, outside the timing.
                    call = call_with(s["k"].repeat_interleave(G, dim=1), s["v"].repeat_interleave(G, dim=1), False)
                    call.note = "no enable_gqa in this backend: K/V expanded once, outside the timing (G x bytes)"
            return call
        methods.append(Method(name, True, make))
    if not args.no_flex:
        def make_flex(s):
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            fn = _compiled_flex()
            block_mask = None
            if valid is not None:
                vl = s["valid"]
                block_mask = create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx < vl[b], B, None,
                                               s["q"].shape[2], N, device="cuda")
            return lambda: fn(s["q"], s["k"], s["v"], block_mask=block_mask, scale=scale, enable_gqa=G > 1)
        methods.append(Method("flex-compiled", True, make_flex,
                              note="block mask from the valid length" if valid is not None else None))
    if not args.no_eager_peer:
        def make_eager(s):
            q, k, v, mask = s["q"], s["k"], s["v"], s["mask"]
            bias = None
            if mask is not None:
                bias = torch.zeros(mask.shape, device=q.device, dtype=q.dtype).masked_fill(
                    ~mask, torch.finfo(q.dtype).min)

            def call():
                kr = k[:, :, None].expand(B, Hkv, G, N, D).reshape(B, Hq, N, D)  # HF repeat_kv
                vr = v[:, :, None].expand(B, Hkv, G, N, D).reshape(B, Hq, N, D)
                w = torch.matmul(q, kr.transpose(2, 3)) * scale
                if bias is not None:
                    w = w + bias
                w = torch.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
                return torch.matmul(w, vr)
            return call
        methods.append(Method("eager", True, make_eager))
    return methods


_FLEX = None


def _compiled_flex():
    global _FLEX
    if _FLEX is None:
        import torch
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX = torch.compile(flex_attention, dynamic=False)
    return _FLEX


def _attnopt_methods(B, Hq, Hkv, D, N, L, valid, dtype_name, scale, args) -> list[Method]:
    from attnopt.hardware import detect_profile
    from attnopt.plan import DensePlan
    from attnopt.runtime.strategies import PlanContext, get_strategy
    from attnopt.site import AttentionSite

    hw = detect_profile()
    ctx = PlanContext(device_type="cuda", triton_available=True)
    site = AttentionSite(node="bench", module_path="bench", pattern="sdpa", batch=B, q_heads=Hq, kv_heads=Hkv,
                         head_dim=D, q_len=L, kv_len=N, dtype=dtype_name,
                         mask_kind="valid_length" if valid is not None else "none",
                         gqa_source="enable_gqa" if Hq != Hkv else "mha")
    scored = []
    for kind in ("split_kv", "stream_k"):
        strat = get_strategy(kind)
        reason = strat.check(site, hw, ctx)
        if reason:
            print(f"  {kind}: not applicable: {reason}")
            continue
        plans = list(strat.candidates(site, hw, ctx))
        plans = [p.with_estimate(strat.estimate_us(p, site, hw, ctx)) for p in plans]
        plans.sort(key=lambda p: p.est_us)
        if args.max_candidates:
            plans = plans[:args.max_candidates]
        scored += [(p, strat) for p in plans]
    dense = get_strategy("dense")
    dense_est = dense.estimate_us(DensePlan(), site, hw, ctx)
    chosen = min(scored, key=lambda ps: ps[0].est_us)[0] if scored else None
    if chosen is not None and dense_est < chosen.est_us:
        chosen = None
    methods = []
    for plan, strat in scored:
        methods.append(Method(f"attnopt:{plan.kind}", False, lambda s, plan=plan: plan_call(plan, s, scale),
                              plan=plan.describe(), est_us=plan.est_us, planner_choice=plan is chosen))
    if chosen is None:
        print(f"  planner: dense (est {dense_est:.1f} µs) beats every kernel plan")
    return methods


def plan_call(plan, s, scale):
    """A call of ``plan`` on the input set ``s`` (``_make_set``'s dict), its state prepared here, as the bench
    times it: ``strategy.run`` with the set's valid lengths, no mask, not causal."""
    from attnopt.runtime.strategies import get_strategy

    strat = get_strategy(plan.kind)
    state = strat.prepare(plan, s["q"], s["k"], s["v"])
    return lambda: strat.run(state, plan, s["q"], s["k"], s["v"], None, s["valid"], scale, False)


def _make_set(i, B, Hq, Hkv, D, N, L, valid, dtype):
    import torch

    g = torch.Generator(device="cuda").manual_seed(1234 + i)
    q = torch.randn(B, Hq, L, D, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(B, Hkv, N, D, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(B, Hkv, N, D, device="cuda", dtype=dtype, generator=g)
    s = {"q": q, "k": k, "v": v, "mask": None, "valid": None}
    if valid is not None:
        s["valid"] = torch.full((B,), valid, device="cuda", dtype=torch.int32)
        s["mask"] = (torch.arange(N, device="cuda") < valid)[None, None, None, :].expand(B, 1, 1, N).contiguous()
    return s


def run(args, on_case: Callable[[dict[str, Any]], Any] | None = None) -> dict[str, Any]:
    import torch

    from .common import Rotation, copy_bandwidth_TBps, cycle, read_bandwidth_TBps, rel_err, results_header, time_us
    from attnopt.runtime.reference import decode_attention

    names = list(QUICK) if args.quick else list(CASES)
    if args.cases:
        names = [c.strip() for c in args.cases.split(",") if c.strip()]
        unknown = [c for c in names if c not in CASES]
        if unknown:
            raise ValueError(f"unknown case(s) {unknown}; known: {', '.join(CASES)}")
    dtype_name = DTYPES[args.dtype]
    dtype = getattr(torch, dtype_name)
    primary = "eager" if args.timing == "eager" else "graph"
    t_start = time.time()

    try:  # every shape recompiles FlexAttention; the default limit (8) would drop it to its unfused path
        import torch._dynamo

        torch._dynamo.config.recompile_limit = max(getattr(torch._dynamo.config, "recompile_limit", 8), 256)
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 256)
    except (ImportError, AttributeError):
        pass
    copy_bw = copy_bandwidth_TBps()
    reads = read_bandwidth_TBps()
    read_bw = reads["best"]
    results = results_header("kernels", commit=args.commit, copy_bw_TBps=round(copy_bw, 4),
                             read_bw_TBps=round(read_bw, 4), read_bw_detail=reads, dtype=dtype_name, timing=primary,
                             timing_note="us: median per call over CUDA-graph replays of many back-to-back calls"
                             if primary == "graph" else "us: triton.testing.do_bench median")
    print(f"device {results['device']}: copy {copy_bw:.3f} TB/s (read+write), read {read_bw:.3f} TB/s {reads}; "
          f"torch {results['torch']}, triton {results['triton']}, timing {args.timing}", flush=True)
    summaries = []
    L = 1
    for case in names:
        B, Hq, Hkv, D, N, valid = CASES[case]
        late = args.time_budget and time.time() - t_start > args.time_budget
        n_eff = valid if valid is not None else N
        kv_bytes = B * Hkv * n_eff * 2 * D * dtype.itemsize
        floor_us = kv_bytes / (read_bw * 1e12) * 1e6
        scale = 1.0 / math.sqrt(D)
        print(f"\n== {case}: B={B} Hq={Hq} Hkv={Hkv} D={D} N={N}" + (f" valid={valid}" if valid else "")
              + f"  KV {kv_bytes / 1e6:.1f} MB, floor {floor_us:.1f} µs", flush=True)
        set_bytes = B * Hkv * N * 2 * D * dtype.itemsize
        rot = Rotation(lambda i: _make_set(i, B, Hq, Hkv, D, N, L, valid, dtype), set_bytes,
                       results.get("l2_bytes"))
        s0 = rot.sets[0]
        ref = decode_attention(s0["q"].float(), s0["k"], s0["v"], valid_len=s0["valid"], scale=scale)
        ref = ref.float()
        peer_args = argparse.Namespace(**vars(args))
        if late:
            peer_args.no_flex = True
        methods = _peer_methods(B, Hq, Hkv, D, N, valid, scale, peer_args)
        methods += _attnopt_methods(B, Hq, Hkv, D, N, L, valid, dtype_name, scale, args)
        rows = []
        for m in methods:
            row = {"case": case, "B": B, "Hq": Hq, "Hkv": Hkv, "D": D, "N": N, "valid_len": valid, "q_len": L,
                   "dtype": dtype_name, "method": m.name, "plan": m.plan, "peer": m.peer, "est_us": m.est_us,
                   "planner_choice": m.planner_choice, "floor_us": floor_us, "rotation_sets": rot.count}
            if m.note:
                row["note"] = m.note
            try:
                t0 = time.time()
                calls = [m.make(s) for s in rot.sets]
                if getattr(calls[0], "note", None):
                    row["note"] = calls[0].note
                out = calls[0]()
                torch.cuda.synchronize()
                row["rel_err"] = rel_err(out.float(), ref)
                row["setup_s"] = round(time.time() - t0, 2)
                fn = cycle(calls)
                row["us"] = time_us(fn, primary)
                if args.timing == "both" and not late:
                    row["us_eager"] = time_us(fn, "eager")
                row["frac_of_roofline"] = floor_us / row["us"]
                del calls, out
            except Exception as exc:  # a peer unsupported for this shape, or a failure we must report
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
                torch.cuda.synchronize()
            rows.append(row)
            us = row.get("us")
            print(f"  {m.name:<18} {m.plan or '':<62} "
                  + (f"{us:9.1f} µs  {row['frac_of_roofline']:5.2f} roof  err {row['rel_err']:.1e}"
                     if us is not None else row.get("error", "")), flush=True)
        ok = [r for r in rows if r.get("us") is not None and r.get("rel_err", 1.0) < REL_ERR_OK]
        peers = [r for r in ok if r["peer"]]
        ours = [r for r in ok if not r["peer"]]
        best_peer = min(peers, key=lambda r: r["us"]) if peers else None
        for r in rows:
            if best_peer and r.get("us"):
                r["ratio_to_best_peer"] = best_peer["us"] / r["us"]
        best_ours = min(ours, key=lambda r: r["us"]) if ours else None
        chosen = next((r for r in ours if r["planner_choice"]), None)
        full_sdpa = [r for r in peers if r["method"].startswith("sdpa")]
        summary = {"case": case, "floor_us": floor_us,
                   "best_peer": best_peer and best_peer["method"], "best_peer_us": best_peer and best_peer["us"],
                   "best_attnopt": best_ours and best_ours["plan"], "best_attnopt_us": best_ours and best_ours["us"],
                   "planner": chosen and chosen["plan"], "planner_us": chosen and chosen["us"],
                   "best_frac_of_roofline": best_ours and best_ours["frac_of_roofline"]}
        if best_peer and best_ours:
            summary["speedup_best"] = best_peer["us"] / best_ours["us"]
        if best_peer and chosen:
            summary["speedup_planner"] = best_peer["us"] / chosen["us"]
        peers_e = [r for r in peers if r.get("us_eager")]
        ours_e = [r for r in ours if r.get("us_eager")]
        if peers_e and ours_e:
            pe = min(peers_e, key=lambda r: r["us_eager"])
            oe = min(ours_e, key=lambda r: r["us_eager"])
            summary.update(best_peer_eager=pe["method"], best_peer_us_eager=pe["us_eager"],
                           best_attnopt_us_eager=oe["us_eager"], speedup_best_eager=pe["us_eager"] / oe["us_eager"])
        if valid is not None and full_sdpa and best_ours:
            best_sdpa = min(full_sdpa, key=lambda r: r["us"])
            summary["speedup_vs_sdpa_full_cache"] = best_sdpa["us"] / best_ours["us"]
        summaries.append(summary)
        results["rows"].extend(rows)
        results["summary"] = summaries
        if on_case is not None:
            on_case(results)
        del rot, s0, ref
        torch.cuda.empty_cache()
    results["summary"] = summaries
    results["elapsed_s"] = round(time.time() - t_start, 1)
    _print_summary(summaries)
    return results


def _print_summary(summaries) -> None:
    from .common import format_table

    print("\nsummary (µs; speedup = best peer / attnopt; roof = floor / best attnopt)")
    print(format_table(summaries, [("case", "case", ""), ("floor_us", "floor", ".1f"),
                                   ("best_peer", "best peer", ""), ("best_peer_us", "peer µs", ".1f"),
                                   ("best_attnopt_us", "attnopt µs", ".1f"), ("speedup_best", "speedup", ".2f"),
                                   ("planner_us", "planner µs", ".1f"), ("speedup_planner", "planner x", ".2f"),
                                   ("best_frac_of_roofline", "roof", ".2f"),
                                   ("speedup_best_eager", "eager x", ".2f"), ("best_attnopt", "best plan", "")]))
    for s in summaries:
        if "speedup_vs_sdpa_full_cache" in s:
            print(f"{s['case']}: {s['speedup_vs_sdpa_full_cache']:.1f}x vs the best SDPA over the full cache")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m attnopt.bench.kernels", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run_cli(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
