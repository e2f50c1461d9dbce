"""The GPU timer of the measured plan choice (``attnopt.tuning``): one candidate plan, timed as the compiled model
will run it.

The methodology is ``attnopt bench kernels``'s (``bench.common.time_us`` and ``Rotation``), so that the tuner and
the benchmark rank plans alike:

* ``prepare()`` runs once per shape and plan, outside the timed region (the op prepares once per shape family);
* only ``run()`` is timed, by CUDA-graph replay of back-to-back calls (the way a decode step captured by
  ``mode="reduce-overhead"`` runs it), the median of several replays after an eager warm-up;
* the calls cycle over input sets that together span ``L2_FACTOR`` L2 sizes (as many small sets as that takes),
  and one replay reads every set, so K/V come from HBM as they do in a model whose other layers evict them;
* the inputs have the site's shape, dtype, mask kind and a valid length (``STATIC_FILL`` of a static cache: full);
* where the graph will not replay as CUDA graphs (``mode`` other than ``reduce-overhead``), a call also costs
  its host time (``host_us``: the op issued back to back, prepare done in the warm-up), so the tuner takes the
  longer of the two: at small shapes the host's launch cost, not the kernel, sets the pace;
* the valid length a kernel plan reads is set once per input set (as the mask reduction computes it), outside the
  timed region: the lowered graph computes it once per step for every site that reads that mask
  (``passes.lower_nodes._shared_valid_len``), so ``valid_len_us`` times it apart and the tuner charges each site its
  share. At a sliding window that computation is ``key_range_from_mask`` (the window's start too), and the input
  sets' mask is a band of ``window`` keys, so that a window plan is timed reading only its band, as it runs.

Nothing here runs at import time; torch and the runtime are imported by the calls.
"""
from __future__ import annotations

import time
from typing import Any, Callable

from .plan import Plan, uses_valid_len  # noqa: F401  (re-exported)
from .site import AttentionSite
from .timer_calls import (L2_FACTOR, MAX_SETS, STATIC_FILL, WARM_WORKERS, count_from_env, error_text,  # noqa: F401
                          mask_reduction, run_concurrently, set_count, site_call, synthetic_inputs, variant_of)

#: Eager calls of the first candidate of a shape before any timing, in ms: clocks ramp up after idle.
WARM_MS = 20.0
#: Host timing: calls issued per repeat (few enough that the launch queue never fills and blocks the host).
HOST_CALLS = 50
#: The op's site key for the calls the timer makes (its call count is not a model's).
TUNING_SITE = "attnopt-tuning"
#: CUDA-graph timing: about this many ms of calls per graph, the median over this many replays.
TARGET_MS = 2.0
REPLAYS = 5
#: A call at least this long (ms, eager, once warm) is timed in a graph of ``LONG_CALLS`` calls or more (one per input
#: set), replayed ``LONG_REPLAYS`` times, without the further eager calls that size a short call's graph: a replay of
#: several ms varies by far less than the 1 % the choice decides by, and at 0.1-1 GB of K/V per set the graph of four
#: calls, its five replays and eight eager calls made a candidate's timing 36 calls of milliseconds each (H100 planner
#: bench at 8e6ae2d: a growing cache's far buckets took 2-8 s each, the most of its 12-23 s first call).
LONG_CALL_MS = 1.0
LONG_CALLS = 2
LONG_REPLAYS = 3
#: The timed replays always wait behind a GPU sleep (``bench.common.REPLAY_PREROLL_MS``: each replay's time is the
#: GPU's, whatever the candidate's host time per call); in a background tuning behind this many ms: the host pauses
#: up to a GIL switch interval (5 ms) at each replay beside the inner compile's Python.
BACKGROUND_PREROLL_MS = 20.0
#: The same threads for a tuning in the background (``attnopt.tuning_defer``), beside the inner backend's compile on
#: the main thread: each thread's Python share of a Triton compile (its front end) takes the GIL from that compile.
#: On the H100 (batch 6805859) SmolLM2's inductor compile ran 28.4 -> 32.6 s at 1k and 26.8 -> 35.7 s at 32k beside
#: a 16-thread warm-up; the tuning, 11-16 s, had 17-23 s to spare.
BACKGROUND_WARM_WORKERS = 4
#: Fresh KV lengths (and as many repeated ones) ``GpuTimer.fresh_length_us`` calls a plan at.
FRESH_LENGTHS = 3
#: Overrides ``WARM_WORKERS`` (read at each warm-up): ``1`` compiles the candidates one after another, still before
#: timing; ``0`` skips the warm-up (each candidate compiles when it is first timed, as before it existed).
WARM_WORKERS_ENV = "ATTNOPT_TUNE_WARM_WORKERS"


class GpuTimer:
    """``timer(plan, site)`` -> µs of one ``run()`` of ``plan`` at ``site``'s shape (see the module docstring), and
    ``timer.valid_len_us(site)``: µs of one ``valid_len_from_mask`` over the site's mask.

    The input sets of the last shape are kept for the next candidate of the same shape (the tuner times several in
    turn, in rounds) and dropped by ``release()`` or a new shape."""

    def __init__(self, *, target_ms: float = TARGET_MS, replays: int = REPLAYS, warm_ms: float = WARM_MS,
                 warm_workers: int = WARM_WORKERS):
        self.target_ms, self.replays, self.warm_ms, self.warm_workers = target_ms, replays, warm_ms, warm_workers
        self._shape: Any = None
        self._sets: list[dict[str, Any]] = []
        self._warm = False
        #: Per runtime key at the current shape: (graph, calls, prepared state, eager ms a call) of its timing, replayed again in the
        #: tuner's later rounds instead of captured again (a capture is the host's work: a launch per input set,
        #: which beside a background tuning's inner compile competes for the GIL).
        self._graphs: dict[str, tuple[Any, int, Any, float]] = {}
        #: (valid keys, the sets at that fill) of the current shape (``at_fill``).
        self._fill: tuple[int, list[dict[str, Any]]] | None = None
        #: What the last warm-up's compile workers did (``attnopt.tuning_procs``): procs, procs_s, errors; or empty.
        self.last_warm_up: dict[str, Any] = {}

    def release(self) -> None:
        """Drop the input sets and hand their memory back to the driver (they can take GBs at long contexts, and
        the model being compiled needs its memory next)."""
        had_sets = bool(self._sets)
        self._shape, self._sets, self._warm, self._graphs, self._fill = None, [], False, {}, None
        if had_sets:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def _input_sets(self, site: AttentionSite) -> list[dict[str, Any]]:
        import torch

        from .tuning import ShapeKey

        shape = ShapeKey.of(site, site.kv_len, False)
        if shape == self._shape:
            return self._sets
        self.release()
        set_bytes, l2 = _set_bytes(site), _l2_bytes()
        free, _ = torch.cuda.mem_get_info()
        count = set_count(set_bytes, l2, free)
        # the valid ranges written down, not computed: a static cache's low fill (``tuning.STATIC_LOW_FILL``) would
        # otherwise cold-compile the mask reduction for its length (its tile is the length's power of two)
        self._shape, self._sets = shape, [synthetic_inputs(site, i, reduce=False) for i in range(count)]
        return self._sets

    def _fill_sets(self, site: AttentionSite, keys: int) -> list[dict[str, Any]]:
        """The input sets of ``site``'s shape holding ``keys`` valid keys each (one mask and valid length for all of
        them, as the layers of a model share one), with more sets of that shape where the keys read no longer span
        ``L2_FACTOR`` L2 sizes (within ``MAX_SETS`` and half the free memory)."""
        import torch

        sets = self._input_sets(site)
        if self._fill is not None and self._fill[0] == keys:
            return self._fill[1]
        b, L, n = int(site.batch), int(site.q_len), int(site.kv_len)
        set_bytes = _set_bytes(site)
        free, _ = torch.cuda.mem_get_info()
        want = set_count(max(1, set_bytes * keys // n), _l2_bytes(), free)
        more = max(0, min(want, len(sets) + free // 2 // max(set_bytes, 1)) - len(sets))
        sets = sets + [synthetic_inputs(site, len(sets) + i, reduce=False) for i in range(more)]
        device = sets[0]["k"].device
        mask = (torch.arange(n, device=device) < keys)[None, None, None, :].expand(b, 1, L, n).contiguous()
        valid = torch.full((b,), keys, device=device, dtype=torch.int32)
        self._fill = (keys, [dict(s, mask=mask, valid_len=valid) for s in sets])
        return self._fill[1]

    def _time(self, calls: list[Callable[[], Any]]) -> float:
        return self._replayed(*self._capture(calls))

    def _replayed(self, graph: Any, n: int, est_ms: float = 0.0) -> float:
        """µs per call of a captured graph of ``n`` calls, each about ``est_ms`` long when captured (``LONG_CALL_MS``
        or longer: ``LONG_REPLAYS`` replays)."""
        from .bench.common import REPLAY_PREROLL_MS, replayed_us
        from .tuning_defer import in_background

        replays = min(self.replays, LONG_REPLAYS) if est_ms >= LONG_CALL_MS else self.replays
        return replayed_us(graph, n, replays, BACKGROUND_PREROLL_MS if in_background() else REPLAY_PREROLL_MS)

    def _capture(self, calls: list[Callable[[], Any]]) -> tuple[Any, int, float]:
        import torch

        from .bench import common

        if not self._warm:  # the first timing of a shape: bring the clocks up first
            self._warm = True
            end = time.perf_counter() + self.warm_ms / 1e3
            while time.perf_counter() < end:
                for c in calls[:8]:
                    c()
                torch.cuda.synchronize()
        # thread_local: the choice may run beside the inner compile (``tuning_defer``), whose CUDA calls on the main
        # thread a global-mode capture here would refuse (and fail that compile)
        return common.captured_calls_estimated(common.cycle(calls), target_ms=self.target_ms, min_calls=len(calls),
                                               capture_error_mode="thread_local", floor=LONG_CALLS,
                                               long_ms=LONG_CALL_MS)

    def __call__(self, plan: Plan, site: AttentionSite) -> float:
        import torch
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        from attnopt.runtime.kernels.common import tma_as_captured
        from attnopt.runtime.strategies import get_strategy

        # the warm-up calls too take the variant the captured graph replays (one compile per candidate, not two)
        with unset_fake_temporarily(), torch.no_grad(), tma_as_captured():
            sets = self._input_sets(site)
            key = plan.runtime_key()
            kept = self._graphs.get(key)
            if kept is None:  # a later round replays the same calls again: same kernels, same sets, no capture
                state = get_strategy(plan.kind).prepare(plan, sets[0]["q"], sets[0]["k"], sets[0]["v"])
                torch.cuda.synchronize()
                graph, n, est_ms = self._capture([site_call(plan, site, s, state) for s in sets])
                kept = self._graphs[key] = (graph, n, state, est_ms)
            return self._replayed(kept[0], kept[1], kept[3])

    def at_fill(self, plan: Plan, site: AttentionSite, keys: int) -> float:
        """µs of one ``run()`` of ``plan`` over ``site``'s static cache (``site.kv_len`` slots) holding ``keys`` valid
        keys (``plan`` reads only the valid ones): the call the compiled graph makes at that fill, so the kernel that
        the measured length compiled, with the same cache shape and specialisation (only the device valid length
        differs), and no new compile (a smaller cache timed full compiled anew: split-KV's mask-tile chunking is a
        compile-time constant of the cache length; 4.4-5.9 s of tie-break warm-up at llama3's 32k/128k, H100 4bab739)."""
        import torch
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        from attnopt.runtime.kernels.common import tma_as_captured
        from attnopt.runtime.strategies import get_strategy

        with unset_fake_temporarily(), torch.no_grad(), tma_as_captured():
            sets = self._fill_sets(site, keys)
            kept = self._graphs.get(plan.runtime_key())
            state = kept[2] if kept is not None else get_strategy(plan.kind).prepare(
                plan, sets[0]["q"], sets[0]["k"], sets[0]["v"])
            torch.cuda.synchronize()
            return self._time([site_call(plan, site, s, state) for s in sets])

    def warm_up(self, plans: list[Plan], site: AttentionSite, eager: bool = False,
                procs: int | None = None) -> dict[str, str]:
        """Compile every candidate of ``site``'s shape at once, before any is timed: each kernel plan's first call
        (prepare and run on one input set, in the variant a captured graph runs; ``eager``: the eager variant too)
        on a thread of its own (``run_concurrently``), while other threads make the timing's input sets and compile
        the mask reduction (``valid_len_us``) and this one makes the dense and distributed plans' first calls
        (``_warmed_here``). Returns the error text of each first call that failed, by runtime key: such a
        candidate is still timed, and fails there if the error is its own. In a background tuning the kernel plans'
        first calls run in worker processes first (``attnopt.tuning_procs``: Triton's compiles leave this process's
        GIL to the inner compile), and the first calls here load what they compiled; ``last_warm_up`` says how
        that went. ``procs``: the compile workers to use (default: ``tuning_procs.compile_procs()`` in a background
        tuning, else none)."""
        from .tuning_defer import in_background
        from . import tuning_procs

        self.last_warm_up = {}
        workers = warm_workers(min(self.warm_workers, BACKGROUND_WARM_WORKERS) if in_background() else self.warm_workers)
        if workers == 0:
            return {}
        import torch
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        from attnopt.runtime.kernels.common import tma_as_captured

        device = torch.cuda.current_device()
        with unset_fake_temporarily():
            warm_set = synthetic_inputs(site, 0, reduce=False)
        _start_triton_driver()

        def first_call(plan: Plan) -> Callable[[], None]:
            def call():
                torch.cuda.set_device(device)
                with unset_fake_temporarily(), torch.no_grad():
                    with tma_as_captured():
                        site_call(plan, site, warm_set)()
                    if eager:
                        site_call(plan, site, warm_set)()
                    torch.cuda.synchronize()
            return call

        def input_sets():
            torch.cuda.set_device(device)
            with unset_fake_temporarily(), torch.no_grad():
                self._input_sets(site)
                torch.cuda.synchronize()

        def mask_reduction_call():  # what ``valid_len_us`` times
            from attnopt.runtime import ops  # noqa: F401  (registers torch.ops.attnopt.*)

            torch.cuda.set_device(device)
            with unset_fake_temporarily(), torch.no_grad():
                getattr(torch.ops.attnopt, mask_reduction(site))(warm_set["mask"], int(site.batch))
                torch.cuda.synchronize()

        if procs is None:
            procs = tuning_procs.compile_procs(tuning_procs.BACKGROUND_COMPILE_PROCS if in_background() else 0)
        kernel_plans = [p for p in plans if not _warmed_here(p)]
        if procs and kernel_plans:  # their Triton compiles in worker processes: below, the first calls load them
            try:
                self.last_warm_up = tuning_procs.first_calls_in_processes(kernel_plans, site, eager=eager,
                                                                          device=device, procs=procs)
            except OSError as exc:  # (no process could start: the first calls below compile, as before)
                self.last_warm_up = {"procs": 0, "procs_s": 0.0, "errors": {"compile workers": error_text(exc)}}
        here = {p.runtime_key(): first_call(p) for p in plans if _warmed_here(p)}
        pooled = {"input sets": input_sets, **{p.runtime_key(): first_call(p) for p in plans if not _warmed_here(p)}}
        if warm_set["mask"] is not None and any(uses_valid_len(p, site) for p in plans):
            pooled["mask reduction"] = mask_reduction_call
        cpu: list[float] = []  # each call's own thread's CPU seconds: what the warm-up takes from the GIL at most

        def counted(call: Callable[[], None]) -> Callable[[], None]:
            def run() -> None:
                start = time.thread_time()
                try:
                    call()
                finally:
                    cpu.append(time.thread_time() - start)
            return run

        errors = run_concurrently({k: counted(c) for k, c in pooled.items()}, {k: counted(c) for k, c in here.items()},
                                  workers)
        self.last_warm_up = {**self.last_warm_up, "calls_cpu_s": round(sum(cpu), 3)}
        return errors

    def valid_len_us(self, site: AttentionSite, eager: bool = False) -> float:
        """µs of one ``attnopt::valid_len_from_mask`` over the site's mask (at a sliding window the
        ``key_range_from_mask`` that gives its start too: ``mask_reduction``), timed like a plan (``eager``: the
        longer of that and its host time, as ``host_us``)."""
        import torch
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        from attnopt.runtime import ops  # noqa: F401  (registers torch.ops.attnopt.*: the input sets no longer do)

        with unset_fake_temporarily(), torch.no_grad():
            sets = self._input_sets(site)
            b = int(site.batch)
            op = getattr(torch.ops.attnopt, mask_reduction(site))
            calls = [lambda m=s["mask"]: op(m, b) for s in sets]
            device = self._time(calls)
            return max(device, self._host(calls)) if eager else device

    def host_us(self, plan: Plan, site: AttentionSite) -> float:
        """µs of host time per call of the ``attnopt::decode_attention`` op running ``plan``, the calls issued back
        to back without a sync (what a graph that is not replayed as a CUDA graph pays per call when the GPU keeps
        up). The op prepares its state on the first call, in the warm-up."""
        import torch
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        from attnopt.runtime import ops  # noqa: F401  (registers torch.ops.attnopt.*)

        from attnopt.runtime.strategies import get_strategy

        with unset_fake_temporarily(), torch.no_grad():
            sets = self._input_sets(site)
            strategy = get_strategy(plan.kind)
            if hasattr(strategy, "timed_call"):  # its own op and inputs (the cascade): its timed call, host side
                state = strategy.prepare(plan, sets[0]["q"], sets[0]["k"], sets[0]["v"])
                return self._host([site_call(plan, site, s, state) for s in sets])
            key, scale = plan.runtime_key(), site.scale if site.scale is not None else site.head_dim ** -0.5
            op = torch.ops.attnopt.decode_attention
            # the variant keywords too: their paths through the op (the key start, the slopes) cost host time
            return self._host([lambda s=s, kw=variant_of(strategy, site, s): op(
                s["q"], s["k"], s["v"], s["mask"], s["valid_len"] if uses_valid_len(plan, site) else None, scale,
                site.is_causal, key, TUNING_SITE, **kw) for s in sets])

    def fresh_length_us(self, plan: Plan, site: AttentionSite, lengths: int = FRESH_LENGTHS) -> tuple[float, float]:
        """(µs of a call at a KV length not called before, µs of a call at a length called before): wall time of one
        eager, synchronized call each, the median of ``lengths`` of each kind, over copies of the first input set a
        few keys shorter, made before each timed call (a growing cache is a new tensor a key longer every step). A symbolic length runs a new
        length every step: a backend that builds something per shape (cuDNN's SDPA graph is keyed by the lengths
        unless ``TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1``) pays the difference on every step."""
        import statistics

        import torch
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        from attnopt.runtime.strategies import get_strategy

        with unset_fake_temporarily(), torch.no_grad():
            s0 = self._input_sets(site)[0]
            state = get_strategy(plan.kind).prepare(plan, s0["q"], s0["k"], s0["v"])

            def call_at(n: int) -> float:
                s = dict(s0, k=s0["k"][:, :, :n].contiguous(), v=s0["v"][:, :, :n].contiguous(),
                         mask=None if s0["mask"] is None else s0["mask"][..., :n].contiguous())
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                site_call(plan, site, s, state)()
                torch.cuda.synchronize()
                return (time.perf_counter() - t0) * 1e6

            n = int(site.kv_len)
            fresh = [call_at(max(1, n - 1 - i)) for i in range(lengths)]
            repeat = [call_at(max(1, n - 1 - i)) for i in range(lengths)]
            return statistics.median(fresh), statistics.median(repeat)

    @staticmethod
    def _host(calls: list[Callable[[], Any]]) -> float:
        """Host µs per call over at most ``HOST_CALLS`` of the input sets' calls: the host's work does not depend on
        which set a call reads, and all of a short cache's sets (up to ``MAX_SETS``, 256) made a sample 1024 calls,
        enough launches to fill the queue this timing must not fill, and a growing cache's eager tuning took
        minutes (SmolLM2's shape at 8k, default mode, past 110 s on the H100 at cfdcb38)."""
        from .bench.common import cycle, host_us

        calls = calls[:HOST_CALLS]
        return host_us(cycle(calls), iters=HOST_CALLS, repeats=3, warmup=max(5, len(calls)))


def _set_bytes(site: AttentionSite) -> int:
    """Bytes of K and V in one input set of ``site``'s shape."""
    import torch

    item = getattr(torch, site.dtype).itemsize
    return int(site.batch) * site.kv_heads * int(site.kv_len) * (site.head_dim + (site.v_head_dim or site.head_dim)) * item


def _l2_bytes() -> int | None:
    import torch

    return getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "L2_cache_size", None)


def warm_workers(default: int = WARM_WORKERS) -> int:
    """The warm-up's threads: ``$ATTNOPT_TUNE_WARM_WORKERS`` where set, else ``default``; 0 = no warm-up."""
    return count_from_env(WARM_WORKERS_ENV, default, "threads >= 0 (0: no warm-up, 1: the candidates compiled one "
                                                     "after another before timing)")


def _warmed_here(plan: Plan) -> bool:
    """Whether ``GpuTimer.warm_up`` makes ``plan``'s first call on the calling thread: a dense plan (PyTorch keeps
    cuDNN's graphs per thread) and a distributed one (its collectives must run in the same order on every rank, so
    one after another, in the candidates' order)."""
    from attnopt.runtime.strategies import get_strategy

    return plan.kind == "dense" or bool(getattr(get_strategy(plan.kind), "distributed", False))


def _start_triton_driver() -> None:
    """Set up Triton's driver on this thread, before threads launch kernels: it is made on first use, unguarded (two
    threads could each build it, and its C helper, which a cold cache compiles)."""
    try:
        from triton.runtime import driver
    except ImportError:  # no Triton: the kernel plans' first calls fail and say why
        return
    driver.active.get_current_device()


#: The default timer of ``attnopt.tuning.Tuner``.
gpu_timer = GpuTimer()
