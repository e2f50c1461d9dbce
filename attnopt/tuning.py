"""Measured plan choice: time the cost model's best few candidates on the real shape, keep the fastest, remember it.

A cost model cannot rank configurations that move the same bytes within a few per cent of each other, so on a
GPU the planner times, before a site shape's first use, the model's ``top_k`` kernel plans and every SDPA
backend that applies (called explicitly), on synthetic inputs of the site's shape, dtype and mask kind, and keeps
the fastest. It never tunes while a CUDA graph is being captured: there it takes a cached result or the model's
pick. Under the Triton interpreter or on the CPU tuning is off.

The results persist in ``<user cache>/attnopt/tuning/tuning.json`` (``$ATTNOPT_CACHE_DIR/tuning`` when set),
keyed by the environment (device, driver, torch, triton and attnopt versions) and the shape, so a process reuses
what another measured. Writers replace the file atomically (temporary file + ``os.replace``); a corrupt file is
reported in one warning line and treated as empty.

A site whose KV length is symbolic (a growing cache) is tuned per length bucket (``BUCKETS``: powers of two from
1k to 512k). The bucket's upper edge stands for it; the op picks the bucket's plan by ``k.shape[2]`` at run
time (``BucketedPlan``), with no sync.

This module imports nothing from ``runtime/`` at import time; the GPU timer does so when it runs.
"""
from __future__ import annotations

import bisect
import contextlib
import dataclasses
import json
import logging
import math
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from .plan import BucketedPlan, Plan, plan_from_dict
from .site import AttentionSite

TUNING_VERSION = 1
#: ``0`` turns tuning off (the cost model alone plans, and cached measurements are not used).
TUNE_ENV = "ATTNOPT_TUNE"
#: Seconds one site shape may spend being timed (new candidates stop starting after it).
BUDGET_ENV = "ATTNOPT_TUNE_BUDGET_S"
DEFAULT_BUDGET_S = 2.0
#: Kernel (non-SDPA) candidates timed per shape, best estimates first.
DEFAULT_TOP_K = 4
#: Upper edges of the KV-length buckets of a symbolic length; longer lengths take the last bucket.
BUCKETS: tuple[int, ...] = tuple(1 << i for i in range(10, 20))
#: The fill a static cache (valid-length mask) is timed at: half its capacity, the mean over its life.
STATIC_FILL = 0.5

log = logging.getLogger(__name__)

#: ``timer(plan, site) -> µs`` of one call of ``plan`` on ``site``'s shape (``site.kv_len`` is set).
Timer = Callable[[Plan, AttentionSite], float]


def bucket_of(n: int, bounds: Sequence[int] = BUCKETS) -> int:
    """The bucket (its upper edge) holding KV length ``n``: the first bound >= n, else the last bound."""
    if n < 1:
        raise ValueError(f"a KV length must be >= 1, got {n}")
    return bounds[min(bisect.bisect_left(bounds, n), len(bounds) - 1)]


# --------------------------------------------------------------------------------------------- keys
@dataclass(frozen=True)
class ShapeKey:
    """What a measurement depends on besides the environment. ``kv_len`` is the exact length, or the bucket's
    upper edge when ``bucketed``."""

    batch: int
    q_heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int
    q_len: int
    kv_len: int
    bucketed: bool
    dtype: str
    mask_kind: str
    valid_length: bool
    is_causal: bool
    #: Keys shared by every row (``AttentionSite.shared_prefix``): a cascade site measures differently from a plain
    #: site of the same shape. Left out of the key when None, so measurements of plain sites keep their keys.
    shared_prefix: int | None = None

    @classmethod
    def of(cls, site: AttentionSite, kv_len: int, bucketed: bool) -> "ShapeKey":
        return cls(batch=int(site.batch), q_heads=site.q_heads, kv_heads=site.kv_heads, head_dim=site.head_dim,
                   v_head_dim=site.v_head_dim or site.head_dim, q_len=int(site.q_len), kv_len=int(kv_len),
                   bucketed=bucketed, dtype=site.dtype, mask_kind=site.mask_kind,
                   valid_length=site.mask_kind in ("valid_length", "arbitrary"), is_causal=site.is_causal,
                   shared_prefix=site.shared_prefix)


def tunable_reason(site: AttentionSite) -> str | None:
    """Why ``site`` cannot be timed (an unknown size), or ``None``."""
    if site.batch is None or site.q_len is None or not site.q_heads or not site.kv_heads or not site.head_dim:
        return f"a size is unknown at compile time ({site.shape_str()})"
    return None


def _driver_version() -> str:
    try:
        with open("/proc/driver/nvidia/version") as f:
            words = f.readline().split()
        return next((w for w in words if w[:1].isdigit() and "." in w), "unknown")
    except OSError:
        return "unknown"


def environment_key(device_index: int | None = None) -> dict[str, str]:
    """Device name, driver, torch, triton and attnopt versions: a measurement holds only where all are equal."""
    import torch

    from . import __version__

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    device = "cpu"
    if torch.cuda.is_available():
        device = torch.cuda.get_device_name(torch.cuda.current_device() if device_index is None else device_index)
    return {"device": device, "driver": _driver_version(), "torch": torch.__version__, "triton": triton_version,
            "attnopt": __version__, "tuning": str(TUNING_VERSION)}


def cache_path() -> Path:
    """``$ATTNOPT_CACHE_DIR/tuning/tuning.json``, else under ``platformdirs.user_cache_dir("attnopt")``."""
    from .hardware import profile_cache_dir  # the one place that resolves attnopt's cache root

    return profile_cache_dir().parent / "tuning" / "tuning.json"


# --------------------------------------------------------------------------------------------- the cache
class TuningCache:
    """Measured choices, one JSON object ``{key: record}`` in one file; ``key`` = environment + shape."""

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = Path(path) if path is not None else cache_path()
        self._warned = False
        self._warned_write = False

    @staticmethod
    def key(env: dict[str, str], shape: ShapeKey) -> str:
        fields = {k: v for k, v in dataclasses.asdict(shape).items() if k != "shared_prefix" or v is not None}
        return json.dumps({"env": env, "shape": fields}, sort_keys=True)

    def load(self) -> dict[str, Any]:
        """Every record; ``{}`` when the file is missing or corrupt (then one warning line names the file)."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return {}
        except OSError as exc:
            self._warn(exc)
            return {}
        try:
            data = json.loads(text)
            if not isinstance(data, dict) or not isinstance(data.get("records"), dict):
                raise ValueError("not an attnopt tuning cache")
            return data["records"]
        except ValueError as exc:
            self._warn(exc)
            return {}

    def _warn(self, exc: Exception) -> None:
        if not self._warned:
            self._warned = True
            log.warning("attnopt: ignoring the unreadable tuning cache %s (%s: %s); tuning again",
                        self.path, type(exc).__name__, str(exc).splitlines()[0][:120] if str(exc) else "")

    def get(self, env: dict[str, str], shape: ShapeKey) -> dict[str, Any] | None:
        return self.load().get(self.key(env, shape))

    def save(self, env: dict[str, str], shape: ShapeKey, record: dict[str, Any]) -> bool:
        """``put``, but a file that cannot be written (read-only home, full disk) costs one warning line, not the
        compile: the measurement still holds for this process's choice. Returns whether it was written."""
        try:
            self.put(env, shape, record)
            return True
        except OSError as exc:
            if not self._warned_write:
                self._warned_write = True
                log.warning("attnopt: cannot write the tuning cache %s (%s); measurements are not kept", self.path, exc)
            return False

    def put(self, env: dict[str, str], shape: ShapeKey, record: dict[str, Any]) -> None:
        """Add one record: re-read the file, merge, write a temporary file beside it, ``os.replace`` it in (atomic,
        so a concurrent reader sees the old or the new file, never a torn one; the last writer's merge wins)."""
        records = self.load()
        records[self.key(env, shape)] = record
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=self.path.name + ".", suffix=".tmp", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"version": TUNING_VERSION, "records": records}, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise


# --------------------------------------------------------------------------------------------- the choice
@dataclass
class Choice:
    """What the tuner chose for one shape. ``choice``: ``measured``, ``cached`` or ``model``."""

    plan: Plan
    choice: str
    measured_us: float = math.nan
    #: runtime key -> measured µs (or the error text) of every candidate timed.
    timings: dict[str, Any] = field(default_factory=dict)
    tune_s: float = 0.0


def to_time(ranked: Sequence[Plan], top_k: int) -> list[Plan]:
    """The candidates worth timing, in the order they are timed: the model's pick, every explicit SDPA backend
    (cuDNN first: the fastest on Hopper), then the next kernel plans by estimate, ``top_k`` kernel plans in all.
    ``auto`` SDPA is timed only when no backend is named explicitly (it is one of them)."""
    if not ranked:
        return []
    explicit = [p for p in ranked if p.kind == "dense" and getattr(p, "backend", "auto") != "auto"]
    order = {"cudnn": 0, "flash": 1, "efficient": 2, "math": 3}
    dense = sorted(explicit, key=lambda p: order.get(p.backend, 9)) or [p for p in ranked if p.kind == "dense"][:1]
    kernels = [p for p in ranked if p.kind != "dense"][:top_k]
    out: list[Plan] = [ranked[0]]
    for p in dense + kernels:
        if all(p.runtime_key() != q.runtime_key() for q in out):
            out.append(p)
    return out


class Tuner:
    """Chooses plans by measurement where it may, else from the cache, else by the cost model.

    Parameters
    ----------
    timer
        ``timer(plan, site) -> µs``; default ``gpu_timer`` (CUDA-graph replay over rotating inputs). Tests inject a
        fake one.
    cache
        A ``TuningCache``, or ``None`` for no persistence.
    enabled
        Whether new measurements may be taken (the cache is read either way).
    budget_s
        Seconds per shape; once spent, no new candidate starts (the model's pick and one SDPA backend always run).
    capturing
        ``() -> bool``: whether a CUDA graph is being captured now (default: the current stream's state).
    env
        The environment key (default ``environment_key()``).
    """

    def __init__(self, timer: Timer | None = None, cache: TuningCache | None = None, *, enabled: bool = True,
                 budget_s: float | None = None, top_k: int = DEFAULT_TOP_K,
                 capturing: Callable[[], bool] | None = None, env: dict[str, str] | None = None,
                 buckets: Sequence[int] = BUCKETS):
        self.timer = timer or gpu_timer
        self.cache = cache
        self.enabled = enabled
        self.budget_s = float(os.environ.get(BUDGET_ENV, DEFAULT_BUDGET_S)) if budget_s is None else budget_s
        if self.budget_s < 0:
            raise ValueError(f"the tuning budget must be >= 0 s, got {self.budget_s}")
        self.top_k = top_k
        self.capturing = capturing or _stream_capturing
        self.env = env
        self.buckets = tuple(buckets)

    def environment(self) -> dict[str, str]:
        if self.env is None:
            self.env = environment_key()
        return self.env

    # ------------------------------------------------------------------------------------- one shape
    def choose(self, site: AttentionSite, ranked: Sequence[Plan], *, bucketed: bool = False) -> Choice:
        """The plan for ``site`` (``kv_len`` set) among ``ranked`` (the candidates, lowest estimate first)."""
        if not ranked:
            raise ValueError("no candidate to choose from")
        shape = ShapeKey.of(site, site.kv_len, bucketed)
        by_key = {p.runtime_key(): p for p in ranked}
        record = self.cache.get(self.environment(), shape) if self.cache is not None else None
        if record is not None:
            try:
                winner = plan_from_dict(record["winner"])
            except (KeyError, TypeError, ValueError):
                winner = None
            if winner is not None and winner.runtime_key() in by_key:
                return Choice(by_key[winner.runtime_key()], "cached", float(record.get("measured_us", math.nan)),
                              dict(record.get("timings", {})))
        if not self.enabled or self.capturing():
            return Choice(ranked[0], "model")
        start = time.perf_counter()
        timings: dict[str, Any] = {}
        plans = to_time(ranked, self.top_k)
        for i, p in enumerate(plans):
            # The model's pick and the first SDPA backend always run; the rest only within the budget.
            if i >= 2 and time.perf_counter() - start > self.budget_s:
                timings[p.runtime_key()] = "skipped: tuning budget spent"
                continue
            try:
                timings[p.runtime_key()] = float(self.timer(p, site))
            except Exception as exc:  # noqa: BLE001 - a backend that cannot run this shape is not a choice
                timings[p.runtime_key()] = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
        release = getattr(self.timer, "release", None)
        if release is not None:  # free the timer's input sets (GBs at long contexts) before the model runs
            release()
        measured = {k: v for k, v in timings.items() if isinstance(v, float) and math.isfinite(v)}
        tune_s = time.perf_counter() - start
        if not measured:
            return Choice(ranked[0], "model", timings=timings, tune_s=tune_s)
        best = min(measured, key=measured.get)
        choice = Choice(by_key[best], "measured", measured[best], timings, tune_s)
        if self.cache is not None:
            self.cache.save(self.environment(), shape, {
                "winner": by_key[best].to_dict(), "measured_us": measured[best], "timings": timings,
                "predicted_us": {k: by_key[k].est_us for k in timings if not math.isnan(by_key[k].est_us)},
                "tune_s": round(tune_s, 3), "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
        return choice

    # ------------------------------------------------------------------------------------- symbolic length
    def choose_bucketed(self, site: AttentionSite, rank: Callable[[AttentionSite], list[Plan]]) -> Choice:
        """A ``BucketedPlan`` for a site of symbolic KV length: ``rank(site at a bucket's edge)`` gives that
        bucket's ranked candidates, ``choose`` picks among them. Its estimate and measurement are those of the
        bucket holding the trace-time hint. Returns the bucket's plan itself when every bucket chose the same."""
        choices = []
        for bound in self.buckets:
            at = dataclasses.replace(site, kv_len=bound, kv_len_hint=None)
            ranked = rank(at)
            if not ranked:
                raise ValueError(f"no candidate plan at KV length {bound} for {site.shape_str()}")
            choices.append(self.choose(at, ranked, bucketed=True))
        hint = bucket_of(site.kv_len_hint or self.buckets[0], self.buckets)
        here = choices[self.buckets.index(hint)]
        timings = {f"N<={b}": c.timings for b, c in zip(self.buckets, choices) if c.timings}
        how = "measured" if any(c.choice == "measured" for c in choices) else (
            "cached" if any(c.choice == "cached" for c in choices) else "model")
        keys = [c.plan.runtime_key() for c in choices]
        tune_s = sum(c.tune_s for c in choices)
        if len(set(keys)) == 1:
            return Choice(here.plan, how, here.measured_us, timings, tune_s)
        plan = BucketedPlan(bounds=self.buckets, plans=tuple(keys)).with_estimate(here.plan.est_us)
        return Choice(plan, how, here.measured_us, timings, tune_s)


def _stream_capturing() -> bool:
    import torch

    return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


_OVERRIDE: list[Tuner] = []


@contextlib.contextmanager
def use_tuner(tuner: Tuner):
    """Within this block the planner uses ``tuner`` on every device (tests drive the measured choice on the CPU
    with a fake timer; ``attnopt tune`` passes its progress-reporting tuner)."""
    _OVERRIDE.append(tuner)
    try:
        yield tuner
    finally:
        _OVERRIDE.remove(tuner)


def default_tuner(device_type: str, triton_available: bool) -> Tuner | None:
    """The tuner the planner uses: the one of an enclosing ``use_tuner`` block; else ``None`` (cost model alone)
    off CUDA, under the Triton interpreter, or unless ``ATTNOPT_TUNE=1``; else measuring, with the persistent cache.

    Off by default: its first GPU run (H100, SmolLM2's shape in bf16, this session) chose cuDNN dense at every
    length, 21 µs alone against split-KV's 9.2 µs at 1k, and the steps of that run through
    ``mode="reduce-overhead"`` took 17-33 ms against 2.3-3.3 ms with the cost model's picks (the run also changed
    one inductor option; which change made the ops run outside the CUDA graphs was not established)."""
    if _OVERRIDE:
        return _OVERRIDE[-1]
    if os.environ.get(TUNE_ENV, "0").strip().lower() not in ("1", "true", "yes", "on"):
        return None
    if device_type != "cuda" or not triton_available:
        return None
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return None
    return Tuner(cache=TuningCache())


# --------------------------------------------------------------------------------------------- the GPU timer
def synthetic_inputs(site: AttentionSite, index: int, device: str = "cuda") -> dict[str, Any]:
    """One input set of ``site``'s shape: q (B, Hq, L, D), k (B, Hkv, N, D), v (B, Hkv, N, Dv) in its dtype, and for
    a valid-length or arbitrary mask a bool mask (B, 1, L, N) keeping the first ``STATIC_FILL * N`` keys."""
    import torch

    dtype = getattr(torch, site.dtype)
    b, L, n = int(site.batch), int(site.q_len), int(site.kv_len)
    g = torch.Generator(device=device).manual_seed(4321 + index)
    s = {"q": torch.randn(b, site.q_heads, L, site.head_dim, device=device, dtype=dtype, generator=g),
         "k": torch.randn(b, site.kv_heads, n, site.head_dim, device=device, dtype=dtype, generator=g),
         "v": torch.randn(b, site.kv_heads, n, site.v_head_dim or site.head_dim, device=device, dtype=dtype,
                          generator=g),
         "mask": None}
    if site.mask_kind in ("valid_length", "arbitrary"):
        keep = max(1, int(n * STATIC_FILL))
        cols = torch.arange(n, device=device)
        band = cols < keep
        if site.window is not None:  # a sliding window's band: the last ``window`` keys before ``keep``
            band &= cols >= keep - site.window
        s["mask"] = band[None, None, None, :].expand(b, 1, L, n).contiguous()
    return s


def site_call(plan: Plan, site: AttentionSite, s: dict[str, Any], state: Any = None) -> Callable[[], Any]:
    """A call of ``plan`` on input set ``s`` as the lowered op runs it: kernel plans take the valid length that
    ``attnopt::valid_len_from_mask`` computes from the mask on the device (its cost included), dense plans the
    mask itself. ``state``: the strategy's prepared state (prepared here when ``None``)."""
    import torch

    from attnopt.runtime import ops  # noqa: F401  (registers torch.ops.attnopt.*)
    from attnopt.runtime.strategies import get_strategy
    from attnopt.runtime.strategies.base import variant_kwargs

    strategy = get_strategy(plan.kind)
    if state is None:
        state = strategy.prepare(plan, s["q"], s["k"], s["v"])
    scale = site.scale if site.scale is not None else site.head_dim ** -0.5
    if hasattr(strategy, "timed_call"):  # a plan whose op takes other inputs than (q, k, v): the cascade
        return strategy.timed_call(plan, site, s, state, scale)
    q, k, v, mask = s["q"], s["k"], s["v"], s["mask"]
    needs_len = mask is not None and plan.kind not in ("dense", "tree", "ring")
    needs_start = mask is not None and site.window is not None and "window" in strategy.variants
    softcap = site.softcap or 0.0
    # ALiBi sites: Bloom's slopes for the site's heads (the kernels' time does not depend on their values)
    slopes = (torch.tensor([2.0 ** -(8 * (h + 1) / site.q_heads) for h in range(site.q_heads)], device=q.device)
              if site.alibi else None)

    def call():
        valid_len = torch.ops.attnopt.valid_len_from_mask(mask, q.shape[0]) if needs_len else None
        if needs_start or softcap or slopes is not None:
            key_start = torch.ops.attnopt.key_start_from_mask(mask, q.shape[0]) if needs_start else None
            return strategy.run(state, plan, q, k, v, mask, valid_len, scale, site.is_causal,
                                **variant_kwargs(strategy, key_start, softcap, slopes))
        return strategy.run(state, plan, q, k, v, mask, valid_len, scale, site.is_causal)
    return call


class GpuTimer:
    """``timer(plan, site)`` -> µs of one call of ``plan`` at ``site``'s shape: CUDA-graph replay
    (``bench.common.time_us``: a graph of about 2 ms of calls, median of 5 replays) cycling over input sets that
    together span several L2 sizes (``bench.common.Rotation``).

    The sets of the last shape are kept for the next candidate of the same shape (the tuner times several in a
    row) and dropped by ``release()`` or a new shape. Raises ``MemoryError`` before allocating when one set would
    take over half the free device memory (fewer sets are used when all of them would)."""

    def __init__(self):
        self._shape: ShapeKey | None = None
        self._sets: list[dict[str, Any]] = []

    def release(self) -> None:
        self._shape, self._sets = None, []

    def _input_sets(self, site: AttentionSite) -> list[dict[str, Any]]:
        import torch

        from .bench.common import Rotation

        shape = ShapeKey.of(site, site.kv_len, False)
        if shape == self._shape:
            return self._sets
        self.release()
        item = getattr(torch, site.dtype).itemsize
        set_bytes = int(site.batch) * site.kv_heads * int(site.kv_len) * (
            site.head_dim + (site.v_head_dim or site.head_dim)) * item
        free, _ = torch.cuda.mem_get_info()
        if set_bytes > free // 2:
            raise MemoryError(f"timing {site.shape_str()} needs {set_bytes / 1e9:.1f} GB, {free / 1e9:.1f} GB free")
        l2 = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "L2_cache_size", None)
        rotation = Rotation(lambda i: synthetic_inputs(site, i), set_bytes, l2,
                            max_sets=max(1, min(8, int(free // 2 // max(set_bytes, 1)))))
        self._shape, self._sets = shape, rotation.sets
        return self._sets

    def __call__(self, plan: Plan, site: AttentionSite) -> float:
        import torch
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        from .bench.common import cycle, time_us

        with unset_fake_temporarily(), torch.no_grad():
            from attnopt.runtime.strategies import get_strategy

            sets = self._input_sets(site)
            state = get_strategy(plan.kind).prepare(plan, sets[0]["q"], sets[0]["k"], sets[0]["v"])
            return time_us(cycle([site_call(plan, site, s, state) for s in sets]), "graph", target_ms=2.0, replays=5)


#: The default timer of ``Tuner``.
gpu_timer = GpuTimer()
