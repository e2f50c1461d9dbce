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

import os
import time
from typing import Any, Callable

from .plan import Plan, uses_valid_len  # noqa: F401  (re-exported)
from .site import AttentionSite

#: The fill a static cache (valid-length mask) is timed at: full. Its valid length is a device tensor, unknown at
#: compile time, and one plan serves every fill (choosing by it would sync). A step is longest near full, and a
#: Hugging Face StaticCache sized to the prompt plus the new tokens runs there (the e2e caches: 94-99 % full).
#: Tuning version 3 timed half-full caches and kept SmolLM2's 1k site on S=5/256/8/2 (10 µs in the e2e step), where
#: a forced sweep found S=16/64/4/3 at 6.2 µs (H100, c761f67): how many keys each split gets changes the ranking.
STATIC_FILL = 1.0
#: The input sets of one timing span this many L2 sizes.
L2_FACTOR = 4
#: At most this many input sets (small shapes need many to span the L2; each is a few hundred kB there).
MAX_SETS = 256
#: Eager calls of the first candidate of a shape before any timing, in ms: clocks ramp up after idle.
WARM_MS = 20.0
#: Host timing: calls issued per repeat (few enough that the launch queue never fills and blocks the host).
HOST_CALLS = 50
#: The op's site key for the calls the timer makes (its call count is not a model's).
TUNING_SITE = "attnopt-tuning"
#: CUDA-graph timing: about this many ms of calls per graph, the median over this many replays.
TARGET_MS = 2.0
REPLAYS = 5
#: In a background tuning the timed replays wait behind this many ms of GPU sleep (``bench.common.replayed_us``):
#: the host pauses up to a GIL switch interval (5 ms) at each replay beside the inner compile's Python.
BACKGROUND_PREROLL_MS = 20.0
#: Threads that make a shape's candidates' first calls at once before any is timed (``GpuTimer.warm_up``). A cold
#: Triton compile takes about a second per configuration on the H100 machine's host, mostly in MLIR/LLVM passes and
#: ptxas, which do not hold the GIL (a separate process).
WARM_WORKERS = 16
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


def synthetic_inputs(site: AttentionSite, index: int, device: str = "cuda", reduce: bool = True) -> dict[str, Any]:
    """One input set of ``site``'s shape: q (B, Hq, L, D), k (B, Hkv, N, D), v (B, Hkv, N, Dv) in its dtype; for a
    valid-length or arbitrary mask a bool mask (B, 1, L, N) keeping the first ``STATIC_FILL * N`` keys and the
    (B,) int32 ``valid_len`` that ``attnopt::valid_len_from_mask`` makes of it (computed here, once). A sliding
    window's mask keeps only the last ``window`` of those keys, with its ``key_start`` (also computed once).
    ``reduce=False``: the same two written down, not computed (equal, and no kernel launched: the timer's sets,
    whose mask reduction would otherwise compile anew for each length timed)."""
    import torch

    dtype = getattr(torch, site.dtype)
    b, L, n = int(site.batch), int(site.q_len), int(site.kv_len)
    g = torch.Generator(device=device).manual_seed(4321 + index)
    s = {"q": torch.randn(b, site.q_heads, L, site.head_dim, device=device, dtype=dtype, generator=g),
         "k": torch.randn(b, site.kv_heads, n, site.head_dim, device=device, dtype=dtype, generator=g),
         "v": torch.randn(b, site.kv_heads, n, site.v_head_dim or site.head_dim, device=device, dtype=dtype,
                          generator=g),
         "mask": None, "valid_len": None}
    if site.mask_kind in ("valid_length", "arbitrary"):
        keep = max(1, int(n * STATIC_FILL))
        cols = torch.arange(n, device=device)
        band = cols < keep
        if site.window is not None:  # a sliding window's band: the last ``window`` keys before ``keep``
            band &= cols >= keep - site.window
        s["mask"] = band[None, None, None, :].expand(b, 1, L, n).contiguous()
        if not reduce:  # the mask's valid range written down, as the reduction computes it (no kernel launched)
            s["valid_len"] = torch.full((b,), keep, device=device, dtype=torch.int32)
            if site.window is not None:
                s["key_start"] = torch.full((b,), max(0, keep - site.window), device=device, dtype=torch.int32)
            return s
        from attnopt.runtime import ops  # noqa: F401  (registers torch.ops.attnopt.*)

        if site.window is not None:  # as the lowered graph computes both ends of a window site's keys
            s["key_start"], s["valid_len"] = torch.ops.attnopt.key_range_from_mask(s["mask"], b)
        else:
            s["valid_len"] = torch.ops.attnopt.valid_len_from_mask(s["mask"], b)
    return s


def mask_reduction(site: AttentionSite) -> str:
    """The op the lowered graph runs over a masked site's mask for a kernel plan: ``key_range_from_mask`` at a
    sliding window (its start and valid length), else ``valid_len_from_mask``."""
    return "key_range_from_mask" if site.window is not None else "valid_len_from_mask"


def site_call(plan: Plan, site: AttentionSite, s: dict[str, Any], state: Any = None) -> Callable[[], Any]:
    """A call of ``plan`` on input set ``s`` as the lowered op runs it: ``strategy.run`` only, with the set's mask
    and, for a plan that reads one, its precomputed valid length, its output in the op's layout (``fake_layout``).
    ``state``: the strategy's prepared state (prepared here, before the call is made, when ``None``)."""
    from attnopt.runtime.strategies import get_strategy

    strategy = get_strategy(plan.kind)
    if state is None:
        state = strategy.prepare(plan, s["q"], s["k"], s["v"])
    scale = site.scale if site.scale is not None else site.head_dim ** -0.5
    if hasattr(strategy, "timed_call"):  # a plan whose op takes other inputs than (q, k, v): the cascade
        return strategy.timed_call(plan, site, s, state, scale)
    q, k, v, mask = s["q"], s["k"], s["v"], s["mask"]
    valid_len = s.get("valid_len") if uses_valid_len(plan, site) else None
    if uses_valid_len(plan, site) and valid_len is None and mask is not None:
        raise ValueError("site_call: the input set has a mask but no precomputed valid_len (synthetic_inputs "
                         "makes one)")

    # the layout the op hands back (its fake's): a dense plan at q_len > 1 pays a copy of SDPA's transposed output
    from attnopt.runtime.ops import fake_layout

    variant = _variant(strategy, site, s)
    if variant:
        def call_variant():
            return fake_layout(strategy.run(state, plan, q, k, v, mask, valid_len, scale, site.is_causal, **variant))
        return call_variant

    def call():
        return fake_layout(strategy.run(state, plan, q, k, v, mask, valid_len, scale, site.is_causal))
    return call


def _variant(strategy, site: AttentionSite, s: dict[str, Any]) -> dict[str, Any]:
    """The variant keywords the lowered op gives ``strategy`` at ``site``: the set's window start, the cap, and for
    ALiBi Bloom's slopes for the site's heads (the kernels' time does not depend on their values)."""
    import torch

    from attnopt.runtime.strategies.base import variant_kwargs

    slopes = (torch.tensor([2.0 ** -(8 * (h + 1) / site.q_heads) for h in range(site.q_heads)], device=s["q"].device)
              if site.alibi else None)
    return variant_kwargs(strategy, s.get("key_start"), site.softcap or 0.0, slopes)


def error_text(exc: BaseException) -> str:
    """One line naming an exception: ``error: Type: first line of its message`` (at most 160 characters of it)."""
    text = str(exc).splitlines()[0][:160] if str(exc) else ""
    return f"error: {type(exc).__name__}: {text}"


def run_concurrently(pooled: dict[str, Callable[[], Any]], here: dict[str, Callable[[], Any]] | None = None,
                     workers: int = WARM_WORKERS) -> dict[str, str]:
    """Run the ``pooled`` calls on up to ``workers`` threads while the ``here`` calls run, one after another, on
    the calling thread (for state that is kept per thread, as PyTorch keeps cuDNN's graphs); wait for all. Returns
    the error text (``error_text``) of each call that raised, by key; the others' results are dropped."""
    from concurrent.futures import ThreadPoolExecutor

    errors: dict[str, str] = {}
    with ThreadPoolExecutor(max(1, min(workers, len(pooled))), thread_name_prefix="attnopt-warm") as pool:
        futures = {key: pool.submit(call) for key, call in pooled.items()}
        for key, call in (here or {}).items():
            try:
                call()
            except Exception as exc:  # noqa: BLE001 - reported by key, like the pooled calls' errors
                errors[key] = error_text(exc)
    for key, future in futures.items():
        if future.exception() is not None:
            errors[key] = error_text(future.exception())
    return errors


def set_count(set_bytes: int, l2_bytes: int | None, free_bytes: int) -> int:
    """Input sets for one timing: enough to span ``L2_FACTOR`` L2 sizes, at most ``MAX_SETS`` and at most what
    half the free memory holds. ``MemoryError`` when not even one set fits there."""
    if set_bytes > free_bytes // 2:
        raise MemoryError(f"one input set needs {set_bytes / 1e9:.2f} GB, {free_bytes / 1e9:.1f} GB free")
    l2 = l2_bytes or (50 << 20)
    want = -(-L2_FACTOR * l2 // max(set_bytes, 1))
    return int(max(1, min(MAX_SETS, want, free_bytes // 2 // max(set_bytes, 1))))


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
        #: Per runtime key at the current shape: (graph, calls, prepared state) of its timing, replayed again in the
        #: tuner's later rounds instead of captured again (a capture is the host's work: a launch per input set,
        #: which beside a background tuning's inner compile competes for the GIL).
        self._graphs: dict[str, tuple[Any, int, Any]] = {}

    def release(self) -> None:
        """Drop the input sets and hand their memory back to the driver (they can take GBs at long contexts, and
        the model being compiled needs its memory next)."""
        had_sets = bool(self._sets)
        self._shape, self._sets, self._warm, self._graphs = None, [], False, {}
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
        item = getattr(torch, site.dtype).itemsize
        set_bytes = int(site.batch) * site.kv_heads * int(site.kv_len) * (
            site.head_dim + (site.v_head_dim or site.head_dim)) * item
        free, _ = torch.cuda.mem_get_info()
        l2 = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "L2_cache_size", None)
        count = set_count(set_bytes, l2, free)
        # the valid ranges written down, not computed: a static cache's low fill (``tuning.STATIC_LOW_FILL``) would
        # otherwise cold-compile the mask reduction for its length (its tile is the length's power of two)
        self._shape, self._sets = shape, [synthetic_inputs(site, i, reduce=False) for i in range(count)]
        return self._sets

    def _time(self, calls: list[Callable[[], Any]]) -> float:
        graph, n = self._capture(calls)
        return self._replayed(graph, n)

    def _replayed(self, graph: Any, n: int) -> float:
        from .bench.common import replayed_us
        from .tuning_defer import in_background

        return replayed_us(graph, n, self.replays, BACKGROUND_PREROLL_MS if in_background() else 0.0)

    def _capture(self, calls: list[Callable[[], Any]]) -> tuple[Any, int]:
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
        return common.captured_calls(common.cycle(calls), target_ms=self.target_ms, min_calls=len(calls),
                                     capture_error_mode="thread_local")

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
                kept = self._graphs[key] = (*self._capture([site_call(plan, site, s, state) for s in sets]), state)
            return self._replayed(kept[0], kept[1])

    def warm_up(self, plans: list[Plan], site: AttentionSite, eager: bool = False) -> dict[str, str]:
        """Compile every candidate of ``site``'s shape at once, before any is timed: each kernel plan's first call
        (prepare and run on one input set, in the variant a captured graph runs; ``eager``: the eager variant too)
        on a thread of its own (``run_concurrently``), while other threads make the timing's input sets and compile
        the mask reduction (``valid_len_us``) and this one makes the dense and distributed plans' first calls
        (``_warmed_here``). Returns the error text of each first call that failed, by runtime key: such a
        candidate is still timed, and fails there if the error is its own."""
        from .tuning_defer import in_background

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

        here = {p.runtime_key(): first_call(p) for p in plans if _warmed_here(p)}
        pooled = {"input sets": input_sets, **{p.runtime_key(): first_call(p) for p in plans if not _warmed_here(p)}}
        if warm_set["mask"] is not None and any(uses_valid_len(p, site) for p in plans):
            pooled["mask reduction"] = mask_reduction_call
        return run_concurrently(pooled, here, workers)

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
            return self._host([lambda s=s, kw=_variant(strategy, site, s): op(
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
        from .bench.common import cycle, host_us

        return host_us(cycle(calls), iters=max(HOST_CALLS, len(calls)), repeats=3, warmup=max(5, len(calls)))


def warm_workers(default: int = WARM_WORKERS) -> int:
    """The warm-up's threads: ``$ATTNOPT_TUNE_WARM_WORKERS`` where set, else ``default``; 0 = no warm-up."""
    text = os.environ.get(WARM_WORKERS_ENV, "").strip()
    if not text:
        return default
    if not text.isdigit():
        raise ValueError(f"{WARM_WORKERS_ENV}={text!r}: expected a whole number of threads >= 0 (0: no warm-up, 1: "
                         f"the candidates compiled one after another before timing)")
    return int(text)


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
