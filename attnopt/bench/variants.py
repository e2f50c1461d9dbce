"""``attnopt bench variants``: attention variants through ``attnopt.optimize`` on functions as a user writes them.

In one run, on one GPU, with CUDA graphs and L2 rotation as the other suites:

* ``window``: a sliding window of W keys over an N-key cache (the mask built from the query position, as Hugging
  Face's ``sliding_window_overlay``), SDPA with the window as a mask (the peer, which reads the whole cache)
  against the same function through ``optimize`` (the kernels start at the window's first key, found on device),
  with the eager inner backend and (on a GPU) the default, inductor. Each row lists the GPU activities of a call.
  Target: >= 10x at W = 4k, N = 128k. L2 rotation moves the window (its position) between disjoint parts of the
  cache, so no two consecutive calls read the same keys.
* ``softcap`` and ``alibi``: Gemma 2's eager chain ``tanh(s * scale / cap) * cap``, and an eager chain with an
  MPT-style ALiBi bias (slopes times ``arange`` built in the function), against the same chain without either,
  all through ``optimize`` with the split-KV plan at the same shape. Target: within 5 %.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import torch
import torch.nn.functional as F

from .common import (Rotation, device_info, format_table, graph_timed_tuning, rel_err, results_header, time_us,
                     write_results)

#: Softcap of the softcap case: Gemma 2's.
CAP = 50.0


def windowed_sdpa(window: int) -> Callable:
    """The user's function: SDPA over the cache with a sliding-window mask built from the query position."""
    def attend(q, k, v, pos):
        kv = torch.arange(k.shape[2], device=k.device)[None, None, None, :]
        qp = pos.view(1, 1, -1, 1)
        mask = (kv <= qp) & (kv > qp - window)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    return attend


def alibi_slopes(heads: int, device) -> torch.Tensor:
    """ALiBi's geometric slopes ``2^(-8 h / H)``, h = 1..H."""
    return 2.0 ** (-8.0 * torch.arange(1, heads + 1, device=device, dtype=torch.float32) / heads)


def eager_chain(softcap: float | None, alibi: bool = False) -> Callable:
    """The user's eager attention (Hugging Face's ``repeat_kv`` and fp32 softmax), capped like Gemma 2, with an
    ALiBi bias like MPT's, or plain."""
    def attend(q, k, v):
        b, hkv, n, d = k.shape
        g = q.shape[1] // hkv
        kr = k[:, :, None].expand(b, hkv, g, n, d).reshape(b, hkv * g, n, d)
        vr = v[:, :, None].expand(b, hkv, g, n, d).reshape(b, hkv * g, n, d)
        s = torch.matmul(q, kr.transpose(2, 3)) * d ** -0.5
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        if alibi:
            s = s + alibi_slopes(q.shape[1], q.device).view(1, -1, 1, 1) * torch.arange(n, device=q.device)
        p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(p, vr)
    return attend


def _time(fn: Callable[[], Any], device: str) -> float:
    if device == "cuda":
        return time_us(fn, "graph")
    t0 = time.perf_counter()  # CPU smoke: one call, only to keep the suite runnable
    fn()
    return (time.perf_counter() - t0) * 1e6


def _plan(optimized) -> str:
    """The plan of the rewritten site, with its variant (``window=...``, ``softcap=...``, ``alibi``)."""
    import attnopt

    sites = [s for s in attnopt.last_plans(optimized).sites if s.rewritten]
    if not sites:
        return "not rewritten"
    variant = sites[0].site.variant_str()
    return sites[0].chosen.describe() + (f" [{variant}]" if variant else "")


def _choice(optimized) -> str:
    """How the site's plan was chosen: measured, cached, model or forced (``SiteReport.choice``)."""
    import attnopt

    sites = attnopt.last_plans(optimized).sites
    return sites[0].choice if sites else "none"


def _row(case: str, method: str, us: float, err: float, plan: str, **shape) -> dict:
    return {"case": case, **shape, "method": method, "us": us, "rel_err": err, "plan": plan}


def bench_window(B: int, Hq: int, Hkv: int, D: int, N: int, window: int, dtype, device: str,
                 l2_bytes: int | None, inductor: bool = False, **options: Any) -> list[dict]:
    """The window rows; ``options`` go to ``optimize`` (the planner picks the plan unless they force one). With
    ``inductor`` also ``optimize``'s default inner backend (``attnopt-inductor``): inductor fuses the function's
    mask construction (five small launches eagerly) around the attnopt ops."""
    import attnopt
    from attnopt.runtime.reference import sdpa_float64

    k = torch.randn(B, Hkv, N, D, device=device, dtype=dtype)
    v = torch.randn(B, Hkv, N, D, device=device, dtype=dtype)
    span = max(1, N // window)  # disjoint windows that fit the cache

    def make(i: int):  # the window ends at a different place per set
        pos = torch.tensor([(span - i % span) * window - 1], device=device)
        return torch.randn(B, Hq, 1, D, device=device, dtype=dtype), pos

    rot = Rotation(make, window * B * Hkv * D * 2 * k.element_size(), l2_bytes)
    peer = windowed_sdpa(window)
    ours = attnopt.optimize(windowed_sdpa(window), inner_backend="eager", **options)
    q0, pos0 = rot.sets[0]
    ref = sdpa_float64(q0, k, v, attn_mask=_band(N, int(pos0), window, device))
    shape = dict(B=B, Hq=Hq, Hkv=Hkv, D=D, N=N, window=window, dtype=str(dtype).removeprefix("torch."))
    with torch.inference_mode():
        with graph_timed_tuning(_tuning_on(device)):  # timed below by CUDA-graph replay: so rank the plans
            ours(q0, k, v, pos0)  # compile outside any capture
        rows = [_row("window", "sdpa-mask", _time(lambda: _call(peer, rot.next(), k, v), device),
                     rel_err(peer(q0, k, v, pos0), ref), "torch SDPA", **shape),
                _row("window", "attnopt", _time(lambda: _call(ours, rot.next(), k, v), device),
                     rel_err(ours(q0, k, v, pos0), ref), _plan(ours), **shape)]
    rows[1]["choice"] = _choice(ours)
    fns = [peer, ours]
    if inductor:
        fused = attnopt.optimize(windowed_sdpa(window), **options)
        with torch.inference_mode():
            with graph_timed_tuning(_tuning_on(device)):
                fused(q0, k, v, pos0)
            rows.append(_row("window", "attnopt-inductor", _time(lambda: _call(fused, rot.next(), k, v), device),
                             rel_err(fused(q0, k, v, pos0), ref), _plan(fused), **shape))
        rows[2]["choice"] = _choice(fused)
        fns.append(fused)
    if device == "cuda":  # what one call launches: the window path's mask scans, fills and kernels, by name
        with torch.inference_mode():
            for row, fn in zip(rows, fns):
                row["kernels"] = _kernels(lambda fn=fn: fn(q0, k, v, pos0))
    for row in rows[1:]:
        row["speedup_vs_sdpa"] = rows[0]["us"] / row["us"]
    return rows


def _kernels(fn: Callable[[], Any]) -> list[str] | None:
    """The GPU activities (kernels, copies, fills) of one call of ``fn``, in order, by name (torch.profiler); None
    where the profiler cannot say."""
    try:
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return [e.name[:80] for e in sorted(prof.events(), key=lambda e: e.time_range.start)
                if e.device_type == DeviceType.CUDA]
    except Exception:  # noqa: BLE001 - a diagnostic: its absence costs the row nothing else
        return None


def _tuning_on(device: str) -> bool:
    """Whether the planner measures plans here (a GPU, ``ATTNOPT_TUNE`` not off)."""
    from attnopt.tuning import default_tuner

    return device == "cuda" and default_tuner("cuda", True) is not None


def _call(fn: Callable, qpos: tuple, k: torch.Tensor, v: torch.Tensor):
    """``fn(q, k, v, pos)`` with (q, pos) from a rotation set."""
    q, pos = qpos
    return fn(q, k, v, pos)


def _band(n: int, pos: int, window: int, device) -> torch.Tensor:
    kv = torch.arange(n, device=device)
    return ((kv <= pos) & (kv > pos - window))[None, None, None, :]


def bench_softcap(B: int, Hq: int, Hkv: int, D: int, N: int, dtype, device: str, l2_bytes: int | None) -> list[dict]:
    import attnopt
    from attnopt.runtime.reference import sdpa_float64

    def make(i: int):
        return tuple(torch.randn(B, h, n, D, device=device, dtype=dtype) for h, n in ((Hq, 1), (Hkv, N), (Hkv, N)))

    rot = Rotation(make, 2 * B * Hkv * N * D * torch.tensor([], dtype=dtype).element_size(), l2_bytes)
    q0, k0, v0 = rot.sets[0]
    shape = dict(B=B, Hq=Hq, Hkv=Hkv, D=D, N=N, window=None, dtype=str(dtype).removeprefix("torch."))
    rows = []
    slopes = alibi_slopes(Hq, device)
    with torch.inference_mode():
        for case, cap, alibi in (("plain", None, False), ("softcap", CAP, False), ("alibi", None, True)):
            fn = attnopt.optimize(eager_chain(cap, alibi), inner_backend="eager", force_plan="split_kv")
            ref = sdpa_float64(q0, k0, v0, scale=D ** -0.5 / (cap or 1.0), softcap=cap or 0.0,
                               alibi_slopes=slopes if alibi else None)
            err = rel_err(fn(q0, k0, v0), ref)
            rows.append(_row(case, "attnopt", _time(lambda: fn(*rot.next()), device), err, _plan(fn), **shape))
    for r in rows[1:]:
        r["vs_plain"] = r["us"] / rows[0]["us"]
    return rows


def register(suites) -> None:
    p = suites.add_parser("variants", help="sliding window vs SDPA with the window as a mask; softcap and ALiBi vs "
                                           "the plain split-KV plan")
    p.add_argument("--out", help="write the results JSON here")
    p.add_argument("--smoke", action="store_true", help="tiny shapes (CPU: the Triton interpreter), to keep it runnable")
    p.set_defaults(func=run)


def run(args) -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    smoke = args.smoke or device == "cpu"
    dtype = torch.bfloat16 if device == "cuda" and not smoke else torch.float32
    l2 = device_info().get("l2_bytes") if device == "cuda" else None
    torch.manual_seed(0)
    if smoke:
        # the CPU cost model may plan SDPA here: force the kernel so that the smoke runs it
        rows = (bench_window(1, 4, 2, 64, 256, 64, dtype, device, l2, force_plan="split_kv")
                + bench_softcap(1, 4, 2, 64, 96, dtype, device, l2))
    else:
        rows = (bench_window(1, 32, 8, 128, 128 * 1024, 4096, dtype, device, l2, inductor=True)
                + bench_softcap(1, 32, 8, 128, 32 * 1024, dtype, device, l2))
    results = results_header("variants", smoke=smoke)
    results["rows"] = rows
    if args.out:
        write_results(args.out, results)
    print(format_table(rows, [("case", "case", ""), ("N", "N", ""), ("window", "W", ""), ("method", "method", ""),
                              ("us", "µs", ".1f"), ("rel_err", "rel err", ".1e"), ("plan", "plan", "")]))
    for r in rows:
        if "speedup_vs_sdpa" in r:
            print(f"window: {r['method']} is {r['speedup_vs_sdpa']:.1f}x SDPA with the window as a mask (target "
                  f">= 10x); plan chosen: {r.get('choice')}")
        if r.get("kernels") is not None:
            print(f"window {r['method']}: {len(r['kernels'])} GPU activities per call: " + ", ".join(r["kernels"]))
        if "vs_plain" in r:
            print(f"{r['case']}: {100 * (r['vs_plain'] - 1):+.1f} % against the plain split-KV plan (target within 5 %)")
    return 0
