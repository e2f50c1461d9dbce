"""The profile of ``attnopt bench e2e --profile``: a decode step's GPU time by kernel class (attnopt's attention and
mask scans, SDPA, GEMMs, inductor's kernels, the rest), busy and exclusive time per class, and the chosen plan's
standalone CUDA-graph time at the step's shape, for the in-step/standalone ratio."""
from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any

import torch


def _kernel_class(name: str) -> str:
    """The part of a decode step a GPU kernel belongs to, by its name."""
    if any(t in name for t in ("_split_kv", "_stream_k", "_merge_states", "_saap")):
        return "attnopt attention kernels"
    if not name.startswith("triton_") and any(t in name for t in ("_valid_len", "_key_range", "_key_start")):
        return "attnopt mask scans (valid length, window start)"  # (inductor's kernels name the ops they fuse)
    if name.startswith("triton_"):  # inductor names a kernel after every op it fuses: its RoPE-and-cache-write
        return "inductor kernels"     # kernel carries "decode_attention" (H100 profile at e6e7a19: 30 a step)
    if any(t in name for t in ("flash", "fmha", "cudnn", "sdpa", "attention")):
        return "SDPA kernels"
    if any(t in name for t in ("gemm", "gemv", "nvjet", "xmma", "cutlass", "sm90", "cublas", "splitKreduce")):
        return "GEMMs"
    return "other kernels (input copies, the harness's argmax, SDPA's mask conversions)"


def profile_steps(step, cache, tok, n: int = 5) -> dict[str, Any]:
    """GPU time per step by kernel class (attention, GEMMs, inductor, other), kernel launches, and host time of the
    attnopt ops when they run outside a graph."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            logits = step(tok, cache)
            tok = logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
    classes: dict[str, dict[str, float]] = {}
    host_ops: dict[str, dict[str, float]] = {}
    busy = _busy_us_by_class(prof, n)
    for e in prof.key_averages():
        gpu = getattr(e, "self_device_time_total", None)
        if gpu is None:
            gpu = getattr(e, "self_cuda_time_total", 0.0)
        if str(getattr(e, "device_type", "")).endswith("CUDA"):
            c = classes.setdefault(_kernel_class(e.key), {"kernels_per_step": 0.0, "gpu_us_per_step": 0.0})
            c["kernels_per_step"] += e.count / n
            c["gpu_us_per_step"] += gpu / n
        elif "attnopt::" in e.key or "Torch-Compiled Region" in e.key or "CUDAGraph" in e.key:
            host_ops[e.key] = {"calls_per_step": e.count / n, "host_us_per_step": e.cpu_time_total / n}
    for name, (us, alone) in busy.items():
        entry = classes.setdefault(name, {"kernels_per_step": 0.0, "gpu_us_per_step": 0.0})
        entry["busy_us_per_step"], entry["exclusive_us_per_step"] = us, alone
    return {"gpu_by_class": classes, "host_ops": host_ops,
            "kernels_per_step": sum(c["kernels_per_step"] for c in classes.values()),
            "gpu_us_per_step": sum(c["gpu_us_per_step"] for c in classes.values())}


def _busy_us_by_class(prof, n: int) -> dict[str, tuple[float, float]]:
    """Per kernel class, (busy, exclusive) µs per step: busy is the time during which at least one of its kernels ran
    (the union of their intervals; summing durations counts twice what overlaps: split-KV launches its merge with
    programmatic dependent launch, and the merge starts while the partial kernel still runs); exclusive is the part
    of that during which no kernel of another class ran (a kernel launched early with PDL waits inside its interval
    while its predecessor finishes: that wait is busy time, not exclusive)."""
    spans: dict[str, list[tuple[float, float]]] = {}
    for e in prof.events():
        if not str(getattr(e, "device_type", "")).endswith("CUDA"):
            continue
        tr = e.time_range
        spans.setdefault(_kernel_class(e.name), []).append((tr.start, tr.end))
    merged = {name: _union(iv) for name, iv in spans.items()}
    out = {}
    for name, mine in merged.items():
        others = _union([span for other, iv in merged.items() if other != name for span in iv])
        busy = sum(e0 - s0 for s0, e0 in mine)
        out[name] = (busy / n, (busy - _overlap(mine, others)) / n)
    return out


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, disjoint intervals covering the same time as ``intervals``."""
    out: list[tuple[float, float]] = []
    for s0, e0 in sorted(intervals):
        if out and s0 <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e0))
        else:
            out.append((s0, e0))
    return out


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two sorted, disjoint interval lists."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def standalone_attention_us(report, cache, context: int) -> dict[str, Any] | None:
    """The chosen plan of the first rewritten site, alone in a CUDA graph at this fill (the mask and the valid length
    given, as in the step): the yardstick for the attention's share of a step. The calls go round every layer's cache,
    as the step reads them: over one layer's cache alone, L2 kept part of it between calls (SmolLM2's shape at 32k:
    25 MB of K/V against the H100's 50 MB of L2), which made the yardstick faster than any layer of a step can be."""
    from .common import time_us

    site = next((s for s in report.rewritten if s.chosen is not None), None)
    layers = [layer for layer in getattr(cache, "layers", ()) if getattr(layer, "keys", None) is not None]
    if site is None or not layers:
        return None
    k0 = layers[0].keys
    hq = site.site.q_heads
    q = torch.randn(k0.shape[0], hq, 1, k0.shape[-1], device=k0.device, dtype=k0.dtype)
    n = k0.shape[2]
    mask = (torch.arange(n, device=k0.device) <= context).view(1, 1, 1, n)
    valid = torch.full((k0.shape[0],), context + 1, device=k0.device, dtype=torch.int32)
    plan = site.chosen.runtime_key()
    op = torch.ops.attnopt.decode_attention
    turn = itertools.cycle([(layer.keys, layer.values) for layer in layers])

    def call():
        k, v = next(turn)
        return op(q, k, v, mask, valid, float(site.site.scale), False, plan, "bench:standalone")

    return {"plan": plan, "us": time_us(call, "graph", min_calls=len(layers)), "layers_rotated": len(layers)}


def host_profile(call, tokens: int, top: int = 14) -> dict[str, list[dict[str, Any]]]:
    """Where ``call()``'s host time goes (cProfile), in µs per generated token: the functions with the most own
    time, and attnopt's functions with the most cumulative time."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.runcall(call)
    stats = pstats.Stats(profiler).stats  # {(file, line, name): (calls, prim, tottime, cumtime, callers)}

    def rows(items) -> list[dict[str, Any]]:
        return [{"function": f"{name} ({'/'.join(Path(file).parts[-2:])}:{line})",
                 "calls_per_token": round(v[0] / tokens, 2), "own_us_per_token": round(1e6 * v[2] / tokens, 1),
                 "cum_us_per_token": round(1e6 * v[3] / tokens, 1)} for (file, line, name), v in items]

    own = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    ours = sorted(((k, v) for k, v in stats.items() if f"{os.sep}attnopt{os.sep}" in k[0]), key=lambda kv: -kv[1][3])
    return {"own": rows(own), "attnopt_cumulative": rows(ours[:top])}


def tuning_records() -> list[dict[str, Any]]:
    """What the tuner measured in this process's tuning cache file: per shape its seconds, the warm-up's share (and of
    that, the compile workers' seconds: ``attnopt.tuning_procs``), the rounds' and the tie-break's (with the tie-break's own warm-up at the other length) and the number of candidates
    timed (with ``--isolate`` each run starts from an empty cache, so these are first-call
    costs)."""
    from attnopt.tuning_cache import TuningCache

    out = []
    for shape, record in TuningCache().load().items():
        winner = record.get("winner") or {}
        out.append({"shape": _shape_of(shape), "timings_taken": sum(len(v) for v in (record.get("samples") or {}).values()),
                    "tune_s": record.get("tune_s"), "warm_up_s": record.get("warm_up_s"),
                    "measure_s": record.get("measure_s"), "rounds": record.get("rounds"),
                    "tie_break_s": record.get("tie_break_s"), "tie_warm_up_s": record.get("tie_warm_up_s"),
                    "tune_cpu_s": record.get("tune_cpu_s"), "warm_up_calls_cpu_s": record.get("warm_up_calls_cpu_s"),
                    "compile_procs": record.get("compile_procs"), "compile_procs_s": record.get("compile_procs_s"),
                    "compile_procs_errors": record.get("compile_procs_errors"), "timer": record.get("timer"),
                    "timed": len(record.get("timings") or {}), "winner": winner.get("kind"),
                    "measured_us": record.get("measured_us")})
    return out


def _shape_of(key: str) -> Any:
    """The shape part of a tuning cache key (its environment is the same for every record of one run)."""
    import json

    try:
        return json.loads(key).get("shape")
    except (ValueError, AttributeError):
        return key


def attention_in_step(profile: dict[str, Any], sites: int, standalone: dict[str, Any] | None) -> dict[str, Any]:
    """The attention's GPU time per layer inside the step (its kernels and the mask scans made for them, exclusive
    µs: time when no other class ran) and its ratio to the same plan alone in a CUDA graph (issue 16's 1.1x)."""
    classes = profile.get("gpu_by_class") or {}
    mine = [v.get("exclusive_us_per_step", 0.0) for k, v in classes.items()
            if k.startswith(("attnopt attention", "attnopt mask scans"))]
    if not sites or not mine:
        return {}
    per_layer = sum(mine) / sites
    out: dict[str, Any] = {"attention_in_step_us_per_layer": round(per_layer, 3)}
    alone = (standalone or {}).get("us")
    if alone:
        out["attention_in_step_vs_standalone"] = round(per_layer / alone, 3)
    return out
