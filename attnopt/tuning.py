"""Measured plan choice: time the cost model's best few candidates on the real shape, keep the fastest, remember it.

A cost model cannot rank configurations that move the same bytes within a few per cent of each other, so on a
GPU the planner times, before a site shape's first use, the model's ``top_k`` kernel plans and every SDPA
backend that applies (called explicitly), on synthetic inputs of the site's shape, dtype and mask kind, and keeps
the fastest. It never tunes while a CUDA graph is being captured: there it takes a cached result or the model's
pick. Under the Triton interpreter or on the CPU tuning is off.

How a candidate is timed is ``attnopt.timer``'s business (CUDA-graph replay of ``run()`` alone over inputs that
miss in L2, ``prepare()`` outside; the methodology of ``attnopt bench kernels``). What this module adds for a fair
comparison: the candidates are timed in ``ROUNDS`` round-robin rounds and each keeps its median, so clock or
thermal drift during the tuning does not favour whichever ran first or last (after the first round only those
within ``PRUNE`` of the best go on, after the second only those within ``PRUNE_LATE``, to spend the rounds where they
can change the winner; those within ``DUEL_WITHIN`` at the end are re-timed in alternating order, the duel); a kernel
plan at a
masked site is charged its share of the device valid-length computation that the lowered graph does once per step for every
site reading that mask (``valid_len_sharing`` sites; measured once by ``timer.valid_len_us``).

The results persist in ``<user cache>/attnopt/tuning/tuning.json`` (``$ATTNOPT_CACHE_DIR/tuning`` when set),
keyed by the environment (device, driver, torch, triton and attnopt versions, and ``TUNING_VERSION``, bumped
whenever the way of measuring changes so that older measurements are not reused) and the shape, so a process
reuses what another measured. Writers replace the file atomically (temporary file + ``os.replace``); a corrupt
file is reported in one warning line and treated as empty.

A site whose KV length is symbolic (a growing cache) is tuned per length bucket (``BUCKETS``: powers of two from
1k to 512k), at the bucket's geometric middle (``bucket_length``; the hint's bucket at the hint, ``hint_length``),
from the trace-time hint's bucket outwards within one shared compile budget; where its two fastest are within
``TIE`` (``HINT_TIE`` at the hint), or the fastest dense plan within ``PEER_SPAN`` of a kernel winner, both are also
timed at the bucket's ends and the one with the smaller worst ratio wins. The other grids of the fastest kernel
configurations are timed after the first round (``grid_siblings``: compiled already, a timing each), then the grids
of further close configurations nearest the fastest plan's, and the fastest plan's twins (``variant_twins``: L2
prefetch, head chunks; a compile each, in the hint's bucket only). A kernel plan is chosen over the fastest dense
plan, the peer's own kernel, only when it is ahead by more than
``PEER_MARGIN`` (timing noise) wherever it was judged. The op picks the bucket's plan by ``k.shape[2]`` at run time
(``BucketedPlan``), with no sync. A static cache is timed full (``timer.STATIC_FILL``); a near tie there is also
judged at ``STATIC_LOW_FILL``.

What keeps the first call cheap: a shape is measured once per process (``_PROCESS_TUNERS``: one tuner shared by
the graphs of a model) and once per machine (the file); every candidate is compiled at once before any is timed
(``timer.warm_up``: a first call per candidate, each on a thread of its own; the budget counts the timing after it,
so every compiled candidate is timed); the rounds stop when one candidate is more than ``PRUNE`` ahead of all
others; configurations the model puts over ``EXTRA_WITHIN`` behind are not compiled; ``budget_s`` caps a shape's
timing and ``BUCKETED_BUDGET_FACTOR`` budgets cap the compiling of all buckets of a symbolic length.

Where the compiled graph replays as CUDA graphs, the plan pass runs the choice on a background thread beside the inner
backend's compile (``attnopt.tuning_defer``); the timing rounds, tie-break and warm-up live in ``tuning_rounds``.

This module imports nothing from ``runtime/`` at import time; the GPU timer does so when it runs.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from .plan import BucketedPlan, Plan, plan_from_dict, reads_valid_keys
from .site import AttentionSite
from .timer import GpuTimer, gpu_timer, site_call, synthetic_inputs, uses_valid_len  # noqa: F401  (re-exported)
from .timer import error_text as _error_text
from .tuning_candidates import (DEFAULT_EXTRA_FAMILIES, DEFAULT_TOP_K, EXTRA_WITHIN, PEER_MARGIN,  # noqa: F401
                                PEER_SPAN, _family, compile_key, most_parallel, near_peer, prefer_peer,
                                to_time)  # (re-exported for the tuner's users)
from .tuning_rounds import (DUEL_WITHIN, FRESH_LENGTH_SLACK_US, HINT_TIE, PRUNE, PRUNE_LATE,  # noqa: F401
                            STATIC_DENSE_TIE, STATIC_READERS, TIE, TIE_MAX, TimingRounds, _median)  # (re-exported: the timing's constants)
from .tuning_buckets import BUCKETS, bucket_length, bucket_of, bucket_span, hint_length  # noqa: F401  (re-exported)
from .tuning_cache import (TUNING_VERSION, ShapeKey, TuningCache, _driver_version, cache_path,  # noqa: F401
                           environment_key)  # (re-exported: the cache's names, where the tuner's users import them)

log = logging.getLogger("attnopt.tuning")

#: ``0`` turns tuning off (the cost model alone plans, and cached measurements are not used).
TUNE_ENV = "ATTNOPT_TUNE"
#: Whether the measured choice is on when ``ATTNOPT_TUNE`` is unset (see ``default_tuner``).
TUNE_BY_DEFAULT = True
#: Seconds one site shape may spend being timed after its warm-up (new candidates stop starting after it).
BUDGET_ENV = "ATTNOPT_TUNE_BUDGET_S"
DEFAULT_BUDGET_S = 4.0  # a cap: a timing takes 0.05-0.3 s; the cold compiles (about a second each) run before it
#: A symbolic length's buckets together may compile new kernels for this many times the per-shape budget; the
#: buckets nearest the trace-time hint go first, and once it is spent the rest compile nothing new: they time the
#: candidates whose kernels earlier buckets compiled (``compile_key``), the SDPA backends and the model's pick. The
#: hint's bucket compiles 4-8 of the 9-14 configurations all buckets time (H100 planner parts, dynamic cases), so two
#: budgets reach the bucket beside it while later buckets still find most of their candidates compiled.
BUCKETED_BUDGET_FACTOR = 2.0
#: A symbolic length's buckets within this many of the hint's time the grid siblings and re-time their near ties (the
#: duel; ``choose``'s ``thorough``): a grid that fits the tiles of the bucket's middle length fits no other length of
#: a 2x bucket better than its neighbours', and the siblings were a third of a growing cache's timings (9 of 31 a
#: bucket, CPU count with the datasheet model's candidates at lhs04's shape); the site runs at the hint's bucket now.
#: Only the hint's bucket times the nearest grids of further close configurations and the twins of its fastest plan
#: (``grid_siblings``'s ``near``, ``_time_twins``): their warm-ups took 1-5 s each on the H100 (ef39938).
NEAR_HINT_BUCKETS = 1
#: Round-robin rounds over the candidates; each candidate's time is the median of its rounds.
ROUNDS = 3
#: The low fill a static cache's near tie is also judged at (the timer times it full): the planner bench's static
#: cases and the issue's 4k of 32k. A kernel plan reads only the valid keys, so it is timed over that many keys; a
#: dense plan reads the whole cache at any fill and keeps its full time.
STATIC_LOW_FILL = 1 / 8


#: ``timer(plan, site) -> µs`` of one call of ``plan`` on ``site``'s shape (``site.kv_len`` is set).
Timer = Callable[[Plan, AttentionSite], float]


def tunable_reason(site: AttentionSite) -> str | None:
    """Why ``site`` cannot be timed (an unknown size), or ``None``."""
    if site.batch is None or site.q_len is None or not site.q_heads or not site.kv_heads or not site.head_dim:
        return f"a size is unknown at compile time ({site.shape_str()})"
    return None


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


class Tuner(TimingRounds):
    """Chooses plans by measurement where it may, else from the cache, else by the cost model.

    Parameters
    ----------
    timer
        ``timer(plan, site) -> µs`` of one call; optionally ``timer.valid_len_us(site)`` (µs of one device
        valid-length computation over the site's mask) and ``timer.release()``. Default ``gpu_timer``
        (``attnopt.timer``). Tests inject a fake one.
    cache
        A ``TuningCache``, or ``None`` for no persistence.
    enabled
        Whether new measurements may be taken (the cache is read either way).
    budget_s
        Seconds per shape; once spent, no new candidate starts and no new round begins (the model's pick and one
        SDPA backend are always timed once).
    rounds
        Round-robin rounds over the candidates; a candidate's time is the median of its rounds.
    capturing
        ``() -> bool``: whether a CUDA graph is being captured now (default: the current stream's state).
    env
        The environment key (default ``environment_key()``).
    """

    def __init__(self, timer: Timer | None = None, cache: TuningCache | None = None, *, enabled: bool = True,
                 budget_s: float | None = None, top_k: int = DEFAULT_TOP_K, rounds: int = ROUNDS,
                 capturing: Callable[[], bool] | None = None, env: dict[str, str] | None = None,
                 buckets: Sequence[int] = BUCKETS):
        self.timer = timer or gpu_timer
        self.cache = cache
        self.enabled = enabled
        self.budget_s = float(os.environ.get(BUDGET_ENV, DEFAULT_BUDGET_S)) if budget_s is None else budget_s
        if self.budget_s < 0:
            raise ValueError(f"the tuning budget must be >= 0 s, got {self.budget_s}")
        if rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {rounds}")
        self.top_k, self.rounds = top_k, rounds
        self.capturing = capturing or _stream_capturing
        self.env = env
        self.buckets = tuple(buckets)
        #: This tuner's own measurements by shape: the sites of one model share a shape, and a cache that cannot
        #: be written must not make each of them measure again.
        self._measured: dict[ShapeKey, tuple[str, float, dict[str, Any]]] = {}
        #: ``timer.fresh_length_us`` of a cuDNN plan per site apart from its length: [new µs, known µs] or an error.
        self._fresh: dict[tuple, Any] = {}
        #: ``choose_bucketed``'s answers by site shape (node and module path aside) and how it runs.
        self._bucketed: dict[tuple, Choice] = {}

    def environment(self) -> dict[str, str]:
        if self.env is None:
            self.env = environment_key()
        return self.env

    # ------------------------------------------------------------------------------------- one shape
    def choose(self, site: AttentionSite, ranked: Sequence[Plan], *, bucketed: bool = False,
               valid_len_sharing: int = 1, graphed: bool = True, deadline: float | None = None,
               span: tuple[int, ...] | None = None, compiled: set | None = None, tie: float = TIE,
               thorough: bool = True, twins: bool | None = None) -> Choice:
        """The plan for ``site`` (``kv_len`` set) among ``ranked`` (the candidates, lowest estimate first).
        ``valid_len_sharing``: how many sites of the graph read this site's mask, and so share the one valid-length
        computation that kernel plans need there. ``graphed``: whether the graph replays as CUDA graphs; if not, a
        call costs the longer of its device time and its host time (``timer.host_us``, where the timer has it).
        ``deadline``: a ``time.perf_counter()`` value after which no new kernel configuration is compiled (a symbolic
        length's buckets share one): past it only the candidates whose kernels ``compiled`` holds (``compile_key``),
        the dense plans and the two always timed are timed. ``compiled``: the compile keys warmed so far, updated
        here. ``span``: other lengths the plan will run at (a bucket's ends); when another candidate is within
        ``tie`` of the fastest, or the fastest dense plan within ``PEER_SPAN`` of a kernel winner, they are timed
        there too (``_tie_break``). A kernel plan must beat the fastest dense plan by ``PEER_MARGIN`` to be chosen
        over it. After the first timing, the other grids of the fastest kernel configurations are timed as well
        (``_time_siblings``), with a budget, then the nearest grids of further close configurations and the twins of
        the fastest (``_time_twins``: L2 prefetch, head chunks; each a compile) unless ``twins`` is false (default:
        ``thorough``), and the near ties re-timed (``_duel``), unless ``thorough`` is false.

        The budget counts from the end of the warm-up: the warm-up compiles every candidate at once, and a budget that
        it had spent left compiled candidates untimed (H100: SmolLM2's 1k static site kept S=5/256/8/2 at 7.35 µs with
        S=17/64/4/3 compiled but skipped, tune_s 4.47 of a 4 s budget)."""
        if not ranked:
            raise ValueError("no candidate to choose from")
        eager = not graphed and hasattr(self.timer, "host_us")
        twins = thorough if twins is None else twins
        shape = ShapeKey.of(site, site.kv_len, bucketed, valid_len_sharing, graphed)
        by_key = {p.runtime_key(): p for p in ranked}
        known = self.cached(site, ranked, bucketed=bucketed, valid_len_sharing=valid_len_sharing, graphed=graphed)
        if known is not None:
            return known
        if not self.enabled or self.capturing():
            return Choice(ranked[0], "model")
        start, cpu_start = time.perf_counter(), time.thread_time()  # (this thread's CPU: what it takes from others)
        plans = to_time(ranked, self.top_k)
        late = deadline is not None and start > deadline
        if late:  # compile nothing new: time what earlier buckets compiled, the SDPA backends and the two always timed
            seen = compiled or set()
            plans = [p for i, p in enumerate(plans) if i < 2 or p.kind == "dense" or compile_key(p) in seen]
        # a backend seen to build per length at an earlier bucket of this site is not compiled or timed again
        per_length = {p.runtime_key(): self._per_length_us(p, site) for p in plans} if bucketed else {}
        per_length = {k: v for k, v in per_length.items() if v is not None}
        plans = [p for p in plans if p.runtime_key() not in per_length] or plans
        extra: dict[str, Any] = self._warm_up(plans, site, eager)
        if late:
            extra["late"] = True
        if compiled is not None:
            compiled.update(compile_key(p) for p in (plans if self.budget_s > 0 else plans[:2]))
        valid_len_us = 0.0
        if any(uses_valid_len(p, site) for p in plans) and hasattr(self.timer, "valid_len_us"):
            try:
                valid_len_us = float(self.timer.valid_len_us(site, eager=True) if eager else
                                     self.timer.valid_len_us(site))
            except Exception as exc:  # noqa: BLE001 - then kernel plans are charged nothing extra; say so
                extra["valid_len_error"] = _error_text(exc)
            extra.update(valid_len_us=valid_len_us, valid_len_sharing=shape.valid_len_sharing)
        share = valid_len_us / max(shape.valid_len_sharing, 1)
        charge = {p.runtime_key(): share if uses_valid_len(p, site) else 0.0 for p in plans}
        if bucketed:  # every step of a growing cache runs a new length
            extra.update(self._fresh_length_charge(plans, site, charge))
        end = time.perf_counter() + self.budget_s  # after the warm-up and the valid length: timing alone
        measure_start = time.perf_counter()
        samples, timings, measure_extra = self._measure(plans, site, end, eager, charge)
        if self.budget_s > 0 and thorough:
            measure_extra.update(self._time_siblings(ranked, site, samples, timings, charge, end, eager, twins))
        if self.budget_s > 0 and twins:
            measure_extra.update(self._time_twins(ranked, site, samples, timings, charge, end, eager))
        if self.budget_s > 0 and thorough and not eager:  # (an eager sample adds the host time: host-bound alike)
            measure_extra.update(self._duel(by_key, site, samples, charge))
        extra["measure_s"] = round(time.perf_counter() - measure_start, 3)
        extra.update(measure_extra)
        for key, us in per_length.items():
            if key not in timings and key not in samples:
                timings[key] = f"skipped: a new KV length costs {us:.0f} µs more (built per length)"
        for key, times in samples.items():
            timings[key] = _median(times) + charge[key]
        measured = {k: v for k, v in timings.items() if isinstance(v, float) and math.isfinite(v)}
        best = min(measured, key=measured.get) if measured else None
        static = span is None and not bucketed and _static_cache(site)
        if static:
            span = (min(site.kv_len, max(64, int(round(site.kv_len * STATIC_LOW_FILL / 64)) * 64)),)
        # a static cache's dense winner is judged at a low fill, and a kernel winner against a close dense plan over
        # the span, even past the budget: a few timings of compiled plans
        dense_static = static and best is not None and not reads_valid_keys(by_key[best], site)
        close_peer = best is not None and span is not None and near_peer(best, measured, by_key) is not None
        if best is not None and span is not None and not eager and (time.perf_counter() < end or dense_static
                                                                     or close_peer):
            tie_start = time.perf_counter()
            best, extra["span_us"] = self._tie_break(best, measured, by_key, site, span, charge, static, extra, tie)
            extra["tie_break_s"] = round(time.perf_counter() - tie_start, 3)
        elif best is not None and not static:  # (a static cache's reader beats the peer at a low fill)
            best = prefer_peer(best, measured, by_key)
        release = getattr(self.timer, "release", None)
        if release is not None:  # free the timer's input sets (GBs at long contexts) before the model runs
            release()
        tune_s = time.perf_counter() - start
        if best is None:
            return Choice(ranked[0], "model", timings=timings, tune_s=tune_s)
        choice = Choice(by_key[best], "measured", measured[best], timings, tune_s)
        self._measured[shape] = (best, measured[best], timings)
        if self.cache is not None:
            self.cache.save(self.environment(), shape, {
                "winner": by_key[best].to_dict(), "measured_us": measured[best], "timings": timings,
                "samples": samples, **extra,
                "predicted_us": {k: by_key[k].est_us for k in timings if not math.isnan(by_key[k].est_us)},
                "tune_s": round(tune_s, 3), "tune_cpu_s": round(time.thread_time() - cpu_start, 3),
                "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
        return choice

    def cached(self, site: AttentionSite, ranked: Sequence[Plan], *, bucketed: bool = False, valid_len_sharing: int = 1,
               graphed: bool = True) -> Choice | None:
        """The measured winner among ``ranked`` that this tuner or the cache file already knows for ``site``'s shape
        (``choice == "cached"``), else ``None``: no timing, no GPU work (the plan pass asks before it starts a
        background choice)."""
        shape = ShapeKey.of(site, site.kv_len, bucketed, valid_len_sharing, graphed)
        by_key = {p.runtime_key(): p for p in ranked}
        mine = self._measured.get(shape)
        if mine is not None and mine[0] in by_key:
            return Choice(by_key[mine[0]], "cached", mine[1], dict(mine[2]))
        record = self.cache.get(self.environment(), shape) if self.cache is not None else None
        if record is None:
            return None
        try:
            winner = plan_from_dict(record["winner"])
        except (KeyError, TypeError, ValueError):
            return None
        if winner.runtime_key() not in by_key:
            return None
        # kept for this process too: the other sites of the shape then skip re-reading the file
        measured_us, timings = float(record.get("measured_us", math.nan)), dict(record.get("timings", {}))
        self._measured[shape] = (winner.runtime_key(), measured_us, timings)
        return Choice(by_key[winner.runtime_key()], "cached", measured_us, dict(timings))

    # ------------------------------------------------------------------------------------- symbolic length
    def choose_bucketed(self, site: AttentionSite, rank: Callable[[AttentionSite], list[Plan]], *,
                        valid_len_sharing: int = 1, graphed: bool = True) -> Choice:
        """A ``BucketedPlan`` for a site of symbolic KV length: ``rank(site at a bucket's length)`` (``bucket_length``)
        gives that bucket's ranked candidates, ``choose`` picks among them. The buckets are tuned from the one
        holding the trace-time hint outwards (nearer lengths run first), within ``BUCKETED_BUDGET_FACTOR`` budgets
        together (past that, a bucket times only what is compiled already). The hint's bucket is timed at the hint
        (``hint_length``: the length the site runs at now), its near ties (within ``HINT_TIE``) judged at the
        bucket's ends and middle: a plan's time steps with its tiles per split between the lengths judged (H100,
        B=7 4/2 heads D=96, S=8 of 128-key tiles: 12.50 µs at 2880 keys, 13.29 at 4096, 14.03 at the case's 3264,
        where cuDNN ran 13.15). Its estimate and measurement are those of the hint's
        bucket. Returns the bucket's plan itself when every bucket chose the same."""
        hint = bucket_of(site.kv_len_hint or self.buckets[0], self.buckets)
        h = self.buckets.index(hint)
        # the layers of a model are one site shape: the first one tunes, the others take its choice after one ranking
        # (the candidates at the hint's bucket tell whether the same options planned them), not one per bucket
        ranked_here = rank(dataclasses.replace(site, kv_len=bucket_length(hint, self.buckets), kv_len_hint=None))
        memo = (dataclasses.replace(site, node="", module_path=""), valid_len_sharing, graphed,
                tuple(p.runtime_key() for p in ranked_here))
        known = self._bucketed.get(memo)
        if known is not None:
            return Choice(known.plan, "cached", known.measured_us, dict(known.timings))
        deadline = time.perf_counter() + BUCKETED_BUDGET_FACTOR * self.budget_s
        compiled: set[str] = set()
        by_bound: dict[int, Choice] = {}
        for i in sorted(range(len(self.buckets)), key=lambda i: (abs(i - h), i)):
            bound = self.buckets[i]
            n, span, tie = bucket_length(bound, self.buckets), bucket_span(bound, self.buckets), TIE
            at = dataclasses.replace(site, kv_len=n, kv_len_hint=None)
            if i == h and site.kv_len_hint:
                here = dataclasses.replace(at, kv_len=hint_length(site.kv_len_hint, bound, self.buckets))
                if not self._known_at_middle(at, here, rank, valid_len_sharing, graphed):
                    at, span, tie = here, (span[0], n, span[1]), HINT_TIE
            ranked = rank(at)
            if not ranked:
                raise ValueError(f"no candidate plan at KV length {at.kv_len} for {site.shape_str()}")
            by_bound[bound] = self.choose(at, ranked, bucketed=True, valid_len_sharing=valid_len_sharing,
                                          graphed=graphed, deadline=deadline, span=span, compiled=compiled, tie=tie,
                                          thorough=abs(i - h) <= NEAR_HINT_BUCKETS, twins=i == h)
        choices = [by_bound[b] for b in self.buckets]
        here = choices[h]
        timings = {f"N<={b}": c.timings for b, c in zip(self.buckets, choices) if c.timings}
        how = "measured" if any(c.choice == "measured" for c in choices) else (
            "cached" if any(c.choice == "cached" for c in choices) else "model")
        keys = [c.plan.runtime_key() for c in choices]
        tune_s = sum(c.tune_s for c in choices)
        if len(set(keys)) == 1:
            chosen = Choice(here.plan, how, here.measured_us, timings, tune_s)
        else:
            plan = BucketedPlan(bounds=self.buckets, plans=tuple(keys)).with_estimate(here.plan.est_us)
            chosen = Choice(plan, how, here.measured_us, timings, tune_s)
        if how != "model":
            self._bucketed[memo] = chosen
        return chosen

    def _known_at_middle(self, middle: AttentionSite, here: AttentionSite, rank: Callable[[AttentionSite], list[Plan]],
                         valid_len_sharing: int, graphed: bool) -> bool:
        """Whether the hint's bucket is measured at its ``middle`` and not at the hint (``here``): a bucket tuned
        before at its middle, by ``attnopt tune --symbolic`` or a process whose hint fell in another bucket, is
        reused, not timed again."""
        kw = dict(bucketed=True, valid_len_sharing=valid_len_sharing, graphed=graphed)
        return self.cached(here, rank(here), **kw) is None and self.cached(middle, rank(middle), **kw) is not None


def _static_cache(site: AttentionSite) -> bool:
    """A static cache read through its mask (the kernels read only its valid keys), not a sliding window's band."""
    return site.mask_kind in ("valid_length", "arbitrary") and site.window is None and site.kv_len is not None


def _stream_capturing() -> bool:
    import torch

    return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


_OVERRIDE: list[Tuner] = []


@contextlib.contextmanager
def use_tuner(tuner: Tuner):
    """Within this block the planner uses ``tuner`` on every device (tests drive the measured choice on the CPU
    with a fake timer; ``attnopt tune`` passes its progress-reporting tuner). A tuner answers
    ``choose(site, ranked, **kw)`` and, for a symbolic length, ``choose_bucketed(site, rank, **kw)``; ``kw`` is
    what the planner knows of how the site runs (``valid_len_sharing``, ``graphed``), so take ``**kw``."""
    _OVERRIDE.append(tuner)
    try:
        yield tuner
    finally:
        _OVERRIDE.remove(tuner)


def default_tuner(device_type: str, triton_available: bool) -> Tuner | None:
    """The tuner the planner uses: the one of an enclosing ``use_tuner`` block; else ``None`` (cost model alone)
    off CUDA, under the Triton interpreter, with ``ATTNOPT_TUNE=0``, or with it unset while ``TUNE_BY_DEFAULT`` is
    off; else measuring, with the persistent cache. Any other ``ATTNOPT_TUNE`` value is an error naming the valid ones.

    On by default since tuning version 2 measured on the H100 (``attnopt bench planner`` part 0 of 2 at 18ffcc3,
    24 cases of the widened grid): the tuned pick at least 0.99x the best SDPA peer on 22 cases (worst 0.978x),
    the cost model's pick alone on 15 (worst 0.589x). Tuning version 1 had charged every kernel plan a whole
    ``valid_len_from_mask`` that the lowered graph computes once per step for all layers, and chose cuDNN dense
    for SmolLM2's static cache (21 µs against split-KV's 9.2 µs at 1k); version 2 times the valid length apart and
    charges each site its share. ``ATTNOPT_TUNE=0`` plans by the cost model alone.
    """
    if _OVERRIDE:
        return _OVERRIDE[-1]
    setting = os.environ.get(TUNE_ENV, "").strip().lower()
    if setting in ("0", "false", "no", "off") or (not setting and not TUNE_BY_DEFAULT):
        return None
    if setting and setting not in ("1", "true", "yes", "on"):
        raise ValueError(f"{TUNE_ENV}={setting!r}: expected 1/true/yes/on or 0/false/no/off")
    if device_type != "cuda" or not triton_available:
        return None
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return None
    # One tuner per cache file, budget and device for the process: the graphs of one model (graph breaks, recompiles
    # for a new batch size) share its measurements even where the cache file cannot be written.
    import torch

    cache = TuningCache()
    device = torch.cuda.current_device() if torch.cuda.is_available() else -1
    key = (str(cache.path), os.environ.get(BUDGET_ENV, ""), device)
    if key not in _PROCESS_TUNERS:
        _PROCESS_TUNERS[key] = Tuner(cache=cache)
    return _PROCESS_TUNERS[key]


_PROCESS_TUNERS: dict[tuple[str, str, int], Tuner] = {}
