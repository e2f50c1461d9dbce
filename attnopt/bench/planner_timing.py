"""How ``attnopt bench planner`` times: a call by CUDA-graph replay (``Clock``), what one measurement cannot settle: the
pick and the closest peers timed again in alternating order (``retime``), and a growing cache's cost per step where a
backend builds something per KV length (``fresh_length_us``, ``growing_us``)."""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable


class Clock:
    """How this run times a call: CUDA-graph replay on a GPU (``bench.common.time_us``), host time on the CPU.
    A call that cannot be captured in a graph is timed eagerly (``do_bench``'s median) and ``last`` says so."""

    def __init__(self, device: str):
        self.device = device
        self.last = "graph" if device == "cuda" else "host"

    def time(self, fn: Callable[[], Any], calls: int) -> float:
        from .common import host_us, time_us

        if self.device != "cuda":
            return host_us(fn, iters=max(2, calls), repeats=3, warmup=1, sync=lambda: None)
        try:
            self.last = "graph"
            return time_us(fn, "graph", min_calls=calls)
        except RuntimeError as exc:
            import torch

            torch.cuda.synchronize()
            self.last = f"eager (graph capture failed: {_error(exc)[:120]})"
            return time_us(fn, "eager")

    def sync(self) -> None:
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()


def _error(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"


#: Keys below the set's length where ``fresh_length_us`` starts: away from the lengths the tuner's own probe called
#: (``GpuTimer.fresh_length_us``: one to three below the timed length), since cuDNN's plan cache is per thread and a
#: length the tuner called is no longer new to it.
FRESH_OFFSET = 37


def fresh_length_us(call_on: Callable[[dict[str, Any]], Callable[[], Any]], s: dict[str, Any],
                    lengths: int = 5) -> list[float]:
    """[µs of an eager call at a KV length not called before, µs at one called before], medians over ``lengths``
    pairs of synced calls on copies of set ``s`` a few keys shorter, made before each timed call (a growing cache
    is a new contiguous tensor a key longer every step, and every step is a new length). ``call_on(set) -> call``.

    One untimed call first, at the known length (not a multiple of 16: a kernel specialised on that compiles there,
    once, not per step); then the known and the new lengths alternate, so that whatever the calls before left
    behind (the graph timing's clocks, a compile's cold caches) weighs on both alike. All new lengths first, then
    the known ones again, as before, charged the planner's pick 230-340 µs a new length on the H100 (planner runs
    at 8e6ae2d and d356f90), which this order does not (CPU, inductor and eager inner backends: 54.5 against 52.5 µs
    alternating, 364 against 172 one kind after the other)."""
    import torch

    def at(n: int) -> float:
        shorter = dict(s, k=s["k"][:, :, :n].contiguous(), v=s["v"][:, :, :n].contiguous())
        call = call_on(shorter)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        call()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e6

    n = s["k"].shape[2]
    known_n = max(1, n - FRESH_OFFSET)
    at(known_n)
    known, new = [], []
    for i in range(lengths):
        known.append(at(known_n))
        new.append(at(max(1, known_n - 1 - i)))
    return [statistics.median(new), statistics.median(known)]


def cudnn_call(s: dict[str, Any], scale: float, gqa: bool) -> Callable[[], Any]:
    """SDPA's cuDNN backend on set ``s`` (no mask: a dynamic case), made without calling it."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def call():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(s["q"], s["k"], s["v"], scale=scale, enable_gqa=gqa)
    return call


def growing_us(row: dict[str, Any]) -> float | None:
    """A dynamic case's µs per step of a growing cache: the replayed µs plus what a call at a new length costs over a
    known one beyond host noise (``tuning.FRESH_LENGTH_SLACK_US``; a cuDNN SDPA graph build per length on the H100:
    39-108 ms at dbfa5c3). The replayed µs where no fresh length was measured (flash and the memory-efficient
    kernel build nothing per length; the planner's pick and sdpa-cudnn are measured)."""
    from attnopt.tuning import FRESH_LENGTH_SLACK_US

    if not row.get("us"):
        return None
    fresh = row.get("fresh_length_us")
    if not fresh or not all(isinstance(x, (int, float)) for x in fresh):
        return row["us"]
    extra = fresh[0] - fresh[1]
    return row["us"] + (extra if extra > FRESH_LENGTH_SLACK_US else 0.0)


#: Peers within this fraction of the best are re-timed with the planner's pick (``retime``).
RETIME_WITHIN = 0.05


def retime(rows: list[dict[str, Any]], keep: dict[str, Callable[[], Any]], clock: Any, times: int, calls: int,
           rel_err_ok: float) -> None:
    """Time the planner's pick and the peers within ``RETIME_WITHIN`` of the best ``times`` more times each, in
    alternating order (ABBA), and set each one's ``us`` to the median of all its measurements (``us_samples``).
    One measurement each, the pick first, right after its compile, left a 1-2 % spread between two calls of the same
    cuDNN kernel on the H100 (planner parts at 18ffcc3 / f9e648f). Only SDPA peers and the HF static path are
    re-timed: a ``torch.compile`` peer of the same function would make dynamo recompile between the two."""
    ok = [r for r in rows if r.get("us") and r.get("rel_err", 1.0) < rel_err_ok and r["method"] in keep]
    peers = [r for r in ok if r["peer"] and (r["method"].startswith("sdpa") or r["method"].startswith("hf-"))]
    if not peers or not any(r["method"] == "attnopt:planner" for r in ok) or times <= 0:
        return
    best = min(r["us"] for r in peers)
    chosen = [r for r in ok if r["method"] == "attnopt:planner"] + [r for r in peers
                                                                     if r["us"] <= (1 + RETIME_WITHIN) * best]
    samples = {r["method"]: [r["us"]] for r in chosen}
    for i in range(times):
        for r in (chosen if i % 2 else chosen[::-1]):
            samples[r["method"]].append(clock.time(keep[r["method"]], calls))
    for r in chosen:
        r["us_samples"] = samples[r["method"]]
        r["us"] = statistics.median(samples[r["method"]])
