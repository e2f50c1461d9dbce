"""What every benchmark suite shares: device facts, measured bandwidths, timing, rotating inputs, results JSON.

Results follow the format in DESIGN.md: ``{"suite", "device", "world_size", "torch", "triton", "commit",
"copy_bw_TBps", "rows": [...]}``; a suite adds fields as it needs them. Timing is the median of many runs:
``graph`` mode replays a CUDA graph holding many calls (no host launch overhead, as a decode step captured by
``torch.compile(mode="reduce-overhead")`` runs), ``eager`` mode is ``triton.testing.do_bench``'s median.
"""
from __future__ import annotations

import functools
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch


def git_commit(explicit: str | None = None) -> str:
    """The commit to record: ``explicit``, else ``$ATTNOPT_COMMIT``, else ``git rev-parse HEAD``, else 'unknown'."""
    if explicit:
        return explicit
    if os.environ.get("ATTNOPT_COMMIT"):
        return os.environ["ATTNOPT_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parent)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def device_info(device: int = 0) -> dict[str, Any]:
    """Name, SM count, L2 and memory of the CUDA device, and the software versions."""
    info: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version()}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(device)
        info.update(device=p.name, sm_count=p.multi_processor_count, memory_bytes=p.total_memory,
                    l2_bytes=getattr(p, "L2_cache_size", None), cuda=torch.version.cuda)
    else:
        info.update(device="cpu", sm_count=os.cpu_count(), memory_bytes=None, l2_bytes=None, cuda=None)
    return info


#: The timed replays of a graph wait behind this many ms of GPU sleep (``replayed_us``), so that each one's time is
#: the GPU's alone. Timed one at a time after a sync, a replay's time also held the host's launch of the graph (the
#: GPU idle from the start event until ``cudaGraphLaunch`` reached it), divided by the graph's calls; and
#: ``captured_calls`` sizes a graph by the eager time per call, which host time decides at decode sizes: a route with
#: more host time per call (optimize()'s compiled function, a kernel plan's Triton launches) got fewer calls per
#: graph and so more of that latency per call than SDPA's own call beside it.
REPLAY_PREROLL_MS = 2.0


def time_us(fn: Callable[[], Any], mode: str = "graph", *, target_ms: float = 5.0, replays: int = 11,
            min_calls: int = 4, capture_error_mode: str = "global") -> float:
    """Median time of one call of ``fn`` in µs.

    ``graph``: ``captured_calls`` (a warm-up, then ``n`` back-to-back calls in one CUDA graph), replayed ``replays``
    times behind a GPU wait (``REPLAY_PREROLL_MS``), the median per call (``replayed_us``). ``eager``:
    ``triton.testing.do_bench`` median.
    """
    if mode == "eager":
        import triton.testing

        return 1e3 * triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")
    if mode != "graph":
        raise ValueError(f"unknown timing mode {mode!r}; valid: graph, eager")
    graph, n = captured_calls(fn, target_ms=target_ms, min_calls=min_calls, capture_error_mode=capture_error_mode)
    return replayed_us(graph, n, replays, REPLAY_PREROLL_MS)


def captured_calls(fn: Callable[[], Any], *, target_ms: float = 5.0, min_calls: int = 4,
                   capture_error_mode: str = "global") -> tuple[Any, int]:
    """(graph, n): ``fn`` warmed up, then ``n`` back-to-back calls (about ``target_ms`` in all, at least
    ``min_calls``: pass the number of rotating input sets so that one replay reads each of them) captured in one
    CUDA graph. ``capture_error_mode``: ``torch.cuda.graph``'s; ``"thread_local"`` lets other threads make CUDA calls
    during the capture (the tuner's background timing, beside the inner compile)."""
    graph, n, _ = captured_calls_estimated(fn, target_ms=target_ms, min_calls=min_calls,
                                           capture_error_mode=capture_error_mode)
    return graph, n


def captured_calls_estimated(fn: Callable[[], Any], *, target_ms: float = 5.0, min_calls: int = 4,
                             capture_error_mode: str = "global", floor: int = 4,
                             long_ms: float | None = None) -> tuple[Any, int, float]:
    """``captured_calls``, and the eager estimate of one call's ms it sized the graph by. ``floor``: the fewest calls
    a graph holds. ``long_ms``: a call at least this long, timed once after one warm call, is not warmed or timed
    further (the tuner's calls are compiled and warm already; at 0.1-1 GB of K/V a call runs for milliseconds and the
    eight eager calls before the capture cost more than the capture)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())

    def timed(calls: int) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        return max(start.elapsed_time(end) / calls, 1e-3)

    with torch.cuda.stream(stream):
        est_ms = None
        if long_ms is not None:
            fn()
            torch.cuda.synchronize()
            est_ms = timed(1)
            est_ms = est_ms if est_ms >= long_ms else None
        if est_ms is None:
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            est_ms = timed(5)
    n = int(max(floor, min_calls, min(400, target_ms / est_ms)))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream, capture_error_mode=capture_error_mode):
        for _ in range(n):
            fn()
    torch.cuda.synchronize()
    return graph, n, est_ms


def replayed_us(graph, calls: int, replays: int, preroll_ms: float = 0.0) -> float:
    """Median µs per call of a captured ``graph`` holding ``calls`` back-to-back calls: one untimed replay, then
    ``replays`` timed ones (CUDA events), each divided by ``calls``.

    ``preroll_ms`` > 0: the timed replays are enqueued back to back behind a GPU-side wait of that long, each between
    two events, so that the host's pauses while it enqueues them do not count. A replay releases the GIL, and beside
    another Python thread (a background tuning beside the inner compile) the host got it back only after that thread's
    switch interval, with the GPU idle between the replay and the end event (H100 batch 6805859: SmolLM2's 32k plan
    measured 49 µs against 17.8 alone). Where the GPU still reached the first event before the last was enqueued,
    the timing is taken again behind a wait twice as long (three tries)."""
    graph.replay()
    torch.cuda.synchronize()
    if preroll_ms > 0:
        for attempt in range(3):
            events = [torch.cuda.Event(enable_timing=True) for _ in range(replays + 1)]
            torch.cuda._sleep(sleep_cycles(preroll_ms * 2 ** attempt))
            events[0].record()
            for end in events[1:]:
                graph.replay()
                end.record()
            caught_up = events[0].query()  # the GPU reached the first event: the host may have held it up since
            torch.cuda.synchronize()
            if not caught_up:
                break
        return statistics.median(a.elapsed_time(b) * 1e3 / calls for a, b in zip(events, events[1:]))
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


_CYCLES_PER_MS: dict[int, float] = {}


def sleep_cycles(ms: float) -> int:
    """The ``torch.cuda._sleep`` argument that keeps the current GPU busy for about ``ms`` (measured once per
    device)."""
    device = torch.cuda.current_device()
    if device not in _CYCLES_PER_MS:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1 << 20)  # (warm: the first launch loads the kernel)
        start.record()
        torch.cuda._sleep(1 << 22)
        end.record()
        torch.cuda.synchronize()
        _CYCLES_PER_MS[device] = (1 << 22) / max(start.elapsed_time(end), 1e-3)
    return int(ms * _CYCLES_PER_MS[device])


def graph_timed_tuning(on: bool):
    """A context in which the measured choice ranks plans as a graph replayed as CUDA graphs runs them
    (``mode="reduce-overhead"``): device time alone. A bench that times every method by CUDA-graph replay must
    rank them the same way: with the default mode (``inner_backend="eager"``) the tuner adds each call's host
    time, which a replay does not pay (a window plan's three ops cost more host time than one SDPA call). ``on``
    False: a null context."""
    import contextlib

    from attnopt.tuning import Tuner, TuningCache, use_tuner

    if not on:
        return contextlib.nullcontext()

    class GraphTimed(Tuner):
        def choose(self, site, ranked, **kw):
            return super().choose(site, ranked, **{**kw, "graphed": True})

    return use_tuner(GraphTimed(cache=TuningCache()))


def host_us(fn: Callable[[], Any], iters: int = 300, *, repeats: int = 5, warmup: int = 5,
            sync: Callable[[], Any] | None = None, sync_in_timing: bool = False,
            after_warmup: Callable[[], Any] | None = None) -> float:
    """Time per call in µs, median over ``repeats`` of ``iters`` calls.

    By default the host time: the calls are issued without syncing (the GPU runs behind unless it is the slower
    side). ``sync_in_timing`` counts each repeat up to its ``sync``: the wall time per call, host and GPU
    together. ``sync`` (default ``torch.cuda.synchronize``) runs after the warm-up and after each repeat;
    ``after_warmup`` runs once after the warm-up's sync (a distributed caller's barrier, so that no rank times
    its peers' warm-up)."""
    sync = sync or torch.cuda.synchronize
    for _ in range(warmup):
        fn()
    sync()
    if after_warmup is not None:
        after_warmup()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        if sync_in_timing:
            sync()
        out.append((time.perf_counter() - t0) / iters * 1e6)
        if not sync_in_timing:
            sync()
    return statistics.median(out)


def host_profile(fn: Callable[[], Any], iters: int = 500, top: int = 22) -> str:
    """cProfile of ``iters`` calls (after a warm-up), the ``top`` functions by own time, as text."""
    import cProfile
    import io
    import pstats

    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(iters):
        fn()
    pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(top)
    return s.getvalue()


def copy_bandwidth_TBps(nbytes: int = 1 << 30, mode: str = "eager") -> float:
    """Device-to-device copy bandwidth, counting bytes read plus bytes written, TB/s."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").uniform_()
    dst = torch.empty_like(src)
    us = time_us(lambda: dst.copy_(src), mode)
    del src, dst
    return 2 * nbytes / (us * 1e-6) / 1e12


@functools.lru_cache(maxsize=None)
def _read_kernel():
    """A streaming read: each program sums its contiguous chunk with wide loads and writes one float."""
    import triton
    import triton.language as tl

    @triton.jit
    def _stream_read_kernel(x_ptr,  # input, int32 view of the buffer
                            out_ptr,  # (programs,) fp32 partial sums (kept so the loads are not dead code)
                            n,  # elements in x
                            per_prog,  # elements per program (a multiple of BLOCK)
                            BLOCK: tl.constexpr):  # elements per load step
        pid = tl.program_id(0)
        start = pid.to(tl.int64) * per_prog
        acc = tl.zeros([BLOCK], dtype=tl.int32)
        for off in range(0, per_prog, BLOCK):
            idx = start + off + tl.arange(0, BLOCK)
            acc += tl.load(x_ptr + idx, mask=idx < n, other=0, eviction_policy="evict_first")
        tl.store(out_ptr + pid, tl.sum(acc, axis=0).to(tl.float32))

    return _stream_read_kernel


def read_bandwidth_TBps(nbytes: int = 1 << 30, mode: str = "eager") -> dict[str, float]:
    """Read-only bandwidth, TB/s (the floor for decode attention, which only reads): ``torch_sum`` is a bf16 sum,
    ``triton_stream`` a streaming read kernel over several programs per SM; ``best`` the larger."""
    x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").uniform_()
    out = {"torch_sum": nbytes / (time_us(lambda: x.sum(dtype=torch.float32), mode) * 1e-6) / 1e12}
    try:
        kern = _read_kernel()
        xi = x.view(torch.int32)
        n = xi.numel()
        block = 16384  # 64 KB per program per step: 16 independent 16-byte loads per thread in flight
        programs = torch.cuda.get_device_properties(0).multi_processor_count * 8
        per_prog = -(-n // programs // block) * block
        programs = -(-n // per_prog)
        partial = torch.empty(programs, device="cuda", dtype=torch.float32)
        us = time_us(lambda: kern[(programs,)](xi, partial, n, per_prog, BLOCK=block, num_warps=8), mode)
        out["triton_stream"] = nbytes / (us * 1e-6) / 1e12
    except Exception as exc:  # keep the suite running; the torch number still stands
        out["triton_stream_error"] = f"{type(exc).__name__}: {exc}"[:200]
    del x
    out["best"] = max(v for k, v in out.items() if isinstance(v, float))
    return out


def cycle(calls: Sequence[Callable[[], Any]]) -> Callable[[], Any]:
    """A function that runs ``calls`` in turn, one per invocation, starting with the first."""
    idx = [0]

    def fn():
        c = calls[idx[0]]
        idx[0] = (idx[0] + 1) % len(calls)
        return c()
    return fn


class Rotation:
    """Cycle through several input sets so repeated calls miss in L2 (sets together span several L2 sizes)."""

    def __init__(self, make: Callable[[int], Any], set_bytes: int, l2_bytes: int | None, *, factor: int = 4,
                 max_sets: int = 8):
        l2 = l2_bytes or (50 << 20)
        self.count = int(max(1, min(max_sets, -(-factor * l2 // max(set_bytes, 1)))))
        self.sets = [make(i) for i in range(self.count)]
        self._i = 0

    def next(self):
        s = self.sets[self._i]
        self._i = (self._i + 1) % self.count
        return s


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64 (inf when out has NaN)."""
    o = out.double()
    if not torch.isfinite(o).all():
        return float("inf")
    r = ref.double()
    return float((o - r).norm() / r.norm().clamp_min(1e-30))


def results_header(suite: str, *, commit: str | None = None, world_size: int = 1, **extra: Any) -> dict[str, Any]:
    """The top of a results file (DESIGN.md format), with the device and versions filled in."""
    info = device_info()
    head = {"suite": suite, "device": info["device"], "world_size": world_size, "torch": info["torch"],
            "triton": info["triton"], "commit": git_commit(commit), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                          time.gmtime()),
            "sm_count": info["sm_count"], "l2_bytes": info["l2_bytes"]}
    head.update(extra)
    head.setdefault("rows", [])
    return head


def write_results(path: str | os.PathLike, results: dict[str, Any]) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(results, indent=1, sort_keys=False) + "\n")
    return p


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str, str]]) -> str:
    """Plain-text table: ``columns`` is (key, header, format spec)."""
    cells = [[h for _, h, _ in columns]]
    for r in rows:
        line = []
        for key, _, spec in columns:
            val = r.get(key)
            if val is None:
                line.append("-")
            elif isinstance(val, float) and spec:
                line.append(format(val, spec))
            else:
                line.append(str(val))
        cells.append(line)
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)) for line in cells)
