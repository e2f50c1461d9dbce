"""``attnopt bench cascade``: parallel sampling over one shared prompt -- the shared-prefix cascade against the plain
plan and SDPA, through ``attnopt.optimize`` on functions as a user writes them.

Per case (``parallel-16x32k``: 16 rows, llama3-8b heads (32/8, D=128), a 32k-token shared prompt and 64 generated
tokens per row, bf16), in one process:

* ``attnopt:shared-prefix`` -- ``optimize(shared_decode)``, where ``shared_decode(q, k_prompt, v_prompt, k_rows,
  v_rows)`` attends over ``cat([k_prompt.expand(B, ...), k_rows])`` as ``SharedPrefixCache`` hands it to a model; the
  planner's own choice (the cascade: the prompt is read once for the 16 rows), its plan recorded;
* ``attnopt:per-row-cache`` -- ``optimize(decode)`` over the same keys held per row, (B, Hkv, P + S, D), as a
  ``DynamicCache`` holds them after ``generate(num_return_sequences=16)``: the plain plan (the planner's choice
  among split-KV, stream-K and SDPA, no prefix to share);
* ``attnopt:shared-prefix-plain`` -- ``optimize(shared_decode, strategies=["split_kv"])``: the user's function
  with the cascade turned off (its ``cat`` copies the prompt 16 times per call, in the timing);
* peers on the per-row cache: ``sdpa-flash``, ``sdpa-cudnn``, ``sdpa-efficient`` (``enable_gqa``).

Timing is ``common.time_us``'s CUDA-graph replay, cycling over input sets that together span several L2 sizes
(``common.Rotation``); each output is checked against fp32 attention over the per-row keys. Without a GPU (the CPU
smoke test: the ``tiny`` case, Triton interpreter) each call is timed on the host instead, only SDPA is a peer, and
the plans are forced (``cascade``, ``split_kv``): at tiny shapes the CPU cost model rightly prefers SDPA.
"""
from __future__ import annotations

import argparse
import time
from typing import Any, Callable

#: name -> (B rows, Hq, Hkv, D, P shared prompt tokens, S tokens per row)
CASES = {"tiny": (4, 4, 2, 64, 96, 8), "parallel-16x32k": (16, 32, 8, 128, 32768, 64),
         "parallel-64x8k": (64, 32, 8, 128, 8192, 128)}


def register(suites) -> None:
    p = suites.add_parser("cascade", help="shared-prefix cascade vs the plain plan and SDPA (parallel sampling)",
                          description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="results JSON path (default: benchmarks/results/cascade-<device>.json)")
    p.add_argument("--cases", default="parallel-16x32k", help=f"comma-separated; known: {', '.join(CASES)}")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    p.add_argument("--commit", default=None)
    p.set_defaults(func=run_cli)


def shared_decode(q, k_prompt, v_prompt, k_rows, v_rows):
    """One decode step of B rows sampled from one prompt, as a user writes it (and as ``SharedPrefixCache`` gives
    the keys): every row's keys are the prompt's, then its own."""
    import torch
    import torch.nn.functional as F

    rows = q.shape[0]
    k = torch.cat([k_prompt.expand(rows, -1, -1, -1), k_rows], dim=2)
    v = torch.cat([v_prompt.expand(rows, -1, -1, -1), v_rows], dim=2)
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def decode(q, k, v):
    """The same step over a cache that holds every row's keys (a ``DynamicCache``)."""
    import torch.nn.functional as F

    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def _make_set(i, B, Hq, Hkv, D, P, S, dtype, device):
    import torch

    g = torch.Generator(device=device).manual_seed(100 + i)

    def rnd(*shape):
        return torch.randn(*shape, device=device, dtype=dtype, generator=g)
    return {"q": rnd(B, Hq, 1, D), "kp": rnd(1, Hkv, P, D), "vp": rnd(1, Hkv, P, D), "ks": rnd(B, Hkv, S, D),
            "vs": rnd(B, Hkv, S, D)}


def _per_row(s, B):
    import torch

    return {"q": s["q"], "mask": None, "k": torch.cat([s["kp"].expand(B, -1, -1, -1), s["ks"]], dim=2),
            "v": torch.cat([s["vp"].expand(B, -1, -1, -1), s["vs"]], dim=2)}


def _chosen(fn) -> str:
    import attnopt

    kinds = [s.chosen.describe() for s in attnopt.last_plans(fn).sites if s.rewritten and s.chosen is not None]
    return "; ".join(dict.fromkeys(kinds)) or "left alone"


def run(args) -> dict[str, Any]:
    import torch

    import attnopt

    from .common import Rotation, cycle, host_us, read_bandwidth_TBps, rel_err, results_header, time_us
    from .kernels import _peer_methods

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    names = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in names if c not in CASES]
    if unknown:
        raise ValueError(f"unknown case(s) {unknown}; known: {', '.join(CASES)}")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    reads = read_bandwidth_TBps() if cuda else {"best": float("nan")}
    results = results_header("cascade", commit=args.commit, read_bw_TBps=round(reads["best"], 4), dtype=str(dtype)[6:],
                             timing=("us: median per call over CUDA-graph replays of the optimized function" if cuda
                                     else "us: host wall time per call (CPU smoke run, Triton interpreter)"))

    def timer(fn: Callable[[], Any]) -> float:
        if cuda:
            return time_us(fn, "graph")
        return host_us(fn, iters=2, repeats=1, warmup=1, sync=lambda: None, sync_in_timing=True)

    t0 = time.time()
    for case in names:
        B, Hq, Hkv, D, P, S = CASES[case]
        item = dtype.itemsize
        shared_bytes = (Hkv * P + B * Hkv * S) * 2 * D * item
        per_row_bytes = B * Hkv * (P + S) * 2 * D * item
        shared_sets = Rotation(lambda i: _make_set(i, B, Hq, Hkv, D, P, S, dtype, device), shared_bytes,
                               results.get("l2_bytes")).sets
        count = Rotation(lambda i: None, per_row_bytes, results.get("l2_bytes")).count
        row_sets = [_per_row(s, B) for s in shared_sets[:count]]
        print(f"\n== {case}: B={B} Hq={Hq} Hkv={Hkv} D={D} prompt={P} per-row={S}; {len(shared_sets)} shared / "
              f"{len(row_sets)} per-row input sets", flush=True)
        scale = D ** -0.5
        from attnopt.runtime.reference import attention_states

        ref = attention_states(row_sets[0]["q"].float(), row_sets[0]["k"], row_sets[0]["v"], scale=scale)[0]
        rows = []

        def timed(name, calls, extra):
            row = {"case": case, "B": B, "Hq": Hq, "Hkv": Hkv, "D": D, "prompt": P, "per_row": S,
                   "N": P + S, "dtype": str(dtype)[6:], "method": name, "rotation_sets": len(calls), **extra}
            try:
                out = calls[0]()
                if cuda:
                    torch.cuda.synchronize()
                row["rel_err"] = rel_err(out.float(), ref)
                row["us"] = timer(cycle(calls))
                row["floor_us"] = row["read_bytes"] / (reads["best"] * 1e12) * 1e6
                row["frac_of_roofline"] = row["floor_us"] / row["us"]
            except Exception as exc:  # report, do not hide: one failing method must not lose the others
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            rows.append(row)
            print(f"  {name:<30} " + (f"{row['us']:10.1f} µs  err {row['rel_err']:.1e}  {extra.get('plan', '')}"
                                      if "us" in row else row["error"]), flush=True)

        # On the CPU (tiny shapes) the cost model rightly prefers SDPA: the smoke run forces the plans it checks.
        variants = (("attnopt:shared-prefix", shared_decode, {} if cuda else {"force_plan": "cascade"}, shared_sets,
                     shared_bytes),
                    ("attnopt:per-row-cache", decode, {}, row_sets, per_row_bytes),
                    ("attnopt:shared-prefix-plain", shared_decode,
                     {"strategies": ["split_kv"]} if cuda else {"force_plan": "split_kv"}, shared_sets, per_row_bytes))
        for name, fn, options, sets, read_bytes in variants:
            torch._dynamo.reset()
            opt = attnopt.optimize(fn, inner_backend="eager", **options)
            keys = ("q", "kp", "vp", "ks", "vs") if fn is shared_decode else ("q", "k", "v")
            calls = [lambda s=s: opt(*(s[k] for k in keys)) for s in sets]
            calls[0]()  # compile and plan before the timing
            timed(name, calls, {"peer": False, "read_bytes": read_bytes, "plan": _chosen(opt)})
        peers = _peer_methods(B, Hq, Hkv, D, P + S, None, scale,
                              argparse.Namespace(no_flex=True, no_eager_peer=True)) if cuda else []
        for m in peers:
            timed(m.name, [m.make(s) for s in row_sets], {"peer": True, "read_bytes": per_row_bytes})
        if not cuda:
            timed("sdpa", [lambda s=s: decode(s["q"], s["k"], s["v"]) for s in row_sets],
                  {"peer": True, "read_bytes": per_row_bytes})
        by = {r["method"]: r for r in rows if "us" in r}
        for r in rows:
            if "us" in r:
                for base in ("attnopt:per-row-cache", "sdpa-flash", "sdpa-cudnn"):
                    if base in by:
                        r[f"speedup_vs_{base.split(':')[-1]}"] = by[base]["us"] / r["us"]
        results["rows"].extend(rows)
        del shared_sets, row_sets
        if cuda:
            torch.cuda.empty_cache()
    results["elapsed_s"] = round(time.time() - t0, 1)
    return results


def run_cli(args) -> int:
    from .common import format_table, write_results

    results = run(args)
    out = args.out or f"benchmarks/results/cascade-{results['device'].replace(' ', '-').lower()}.json"
    write_results(out, results)
    print(format_table(results["rows"], [("case", "case", ""), ("method", "method", ""), ("us", "µs", ".1f"),
                                         ("speedup_vs_per-row-cache", "x plain plan", ".2f"),
                                         ("speedup_vs_sdpa-flash", "x flash", ".2f"),
                                         ("frac_of_roofline", "of roofline", ".2f"), ("rel_err", "rel err", ".1e"),
                                         ("plan", "plan", "")]))
    print(f"wrote {out}")
    return 0
