"""The measured choice in the background: tuning overlaps the inner backend's compile instead of preceding it.

On a GPU the tuner (``attnopt.tuning``) spent 4-10 s per site shape before inductor began compiling (H100, c717e9f:
SmolLM2's 30 layers at 8k 5.4 s of attnopt's pass and 28.6 s of inductor; llama3-8b's 4 layers at 32k 10.2 s and
8.7 s), which made the first call slower than Hugging Face's compiled path. Here the plan pass fixes the lowering's
structure and starts the measured choice on one worker thread; the lowered op carries a *pending key*
(``PENDING_PREFIX`` + a number) that resolves to the winner, and the callable the backend returns waits for every
pending choice (``join_all``) before its first call. So no tuner GPU work overlaps a CUDA-graph capture or the
model's kernels, and nothing waits inside a capture; the inner compile, which is host work, runs beside the tuning.

The structure is what the lowering builds around the op for a plan: whether it computes a device valid length from
the mask (``plan.uses_valid_len``). The deferred choice times only the candidates that take none (split-KV outside a
sliding window and the SDPA backends), so the graph is exact whatever wins. Every measured winner of the committed H100
planner bench (both parts) was one of them: of its 107 tuning records, stream-K was timed in 3 and fastest in none. ``passes.plan.deferral_reason`` says where the choice
stays synchronous and why (a window's key range and a cascade are lowered per plan; host-timed choices need a quiet
host; SAAP, export and multi-GPU planning resolve at once).

A failed background tuning resolves to the cost model's pick among those candidates, with the reason recorded in
the site's report (every candidate is exact, so this is never a wrong answer). The persisted tuning cache is read
before any thread starts: a hit is resolved at once.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

log = logging.getLogger("attnopt.tuning")

#: The op's plan argument of a deferred choice starts with this (a plan's runtime key is JSON and starts with ``{``).
PENDING_PREFIX = "attnopt-pending:"
#: Serializes every use of a tuner: the background worker's and a synchronous choice in the plan pass share the
#: process's ``GpuTimer`` (its input sets) and must not time at once.
TUNE_LOCK = threading.RLock()

_ids = itertools.count()
_lock = threading.Lock()
#: Every pending choice of the process by its key (resolved ones stay: the op resolves a key once, then caches it).
_PENDING: dict[str, "PendingChoice"] = {}
#: Jobs by what they tune, so the sites of one shape (every layer of a decoder, and later graphs of the same model
#: while the first job runs) share one.
_JOBS: dict[Any, "PendingChoice"] = {}
_BACKGROUND = threading.local()


@dataclass(eq=False)  # one job is one object: compared and hashed by identity
class PendingChoice:
    """One measured choice running in the background. ``fallback``: the cost model's pick among the candidates timed
    (what a failed tuning resolves to)."""

    key: str
    fallback: Any
    started: float = field(default_factory=time.perf_counter)
    finished: float | None = None
    #: The tuner's ``Choice`` once done; ``None`` when the tuning failed (``error`` says why).
    choice: Any = None
    error: str = ""
    #: The site reports that show this choice (updated when it resolves).
    reports: list[Any] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    @property
    def plan(self) -> Any:
        """The resolved plan (waits for the tuning): the measured winner, else the fallback."""
        self.done.wait()
        return self.choice.plan if self.choice is not None else self.fallback

    @property
    def wall_s(self) -> float:
        """Seconds from the start of the job to its end (so far, while it runs)."""
        return (self.finished if self.finished is not None else time.perf_counter()) - self.started

    def attach(self, report: Any) -> None:
        """Show this choice in ``report`` (a ``SiteReport``): pending now, resolved when the tuning ends."""
        with _lock:
            self.reports.append(report)
            if self.done.is_set():
                self._show(report)
            else:
                report.choice = "pending"

    def _resolve(self, choice: Any, error: str) -> None:
        with _lock:
            self.choice, self.error, self.finished = choice, error, time.perf_counter()
            for report in self.reports:
                self._show(report)
        self.done.set()

    def _show(self, report: Any) -> None:
        plan = self.choice.plan if self.choice is not None else self.fallback
        report.chosen = plan
        report.tune_s = round(self.wall_s, 3)
        if self.choice is not None:
            report.choice, report.measured_us = self.choice.choice, self.choice.measured_us
            report.tuning = "in the background, beside the inner compile"
        else:
            report.choice = "model"
            report.tuning = f"background tuning failed ({self.error}); the cost model's pick among the timed candidates"


def submit(job_key: Any, fallback: Any, work: Callable[[], Any]) -> PendingChoice:
    """The pending choice of ``job_key``: the running or finished one, else a new one running ``work()`` (which
    returns a ``tuning.Choice``) on a thread of its own under ``TUNE_LOCK`` (jobs run one at a time). The thread
    ends with its job, and ``join_all`` joins it: after the join no tuner thread is left to make a CUDA call
    during a capture."""
    with _lock:
        pending = _JOBS.get(job_key)
        if pending is not None:
            return pending
        pending = PendingChoice(key=f"{PENDING_PREFIX}{next(_ids)}", fallback=fallback)
        _JOBS[job_key] = _PENDING[pending.key] = pending

    def run() -> None:
        choice, error = None, "the tuning was interrupted"
        _BACKGROUND.on = True
        try:
            with TUNE_LOCK:
                pending.started = time.perf_counter()  # from when it may time: not while another job holds the lock
                choice = work()
            error = "" if getattr(choice, "plan", None) is not None else "the tuner returned no plan"
        except Exception as exc:  # noqa: BLE001 - a failed measurement must not fail the model: the model's pick
            from .timer import error_text

            error = error_text(exc)
            log.warning("attnopt: measuring plans in the background failed (%s); using the cost model's choice", error)
        finally:  # whatever happened, the first call waiting on it goes on
            pending._resolve(choice if not error else None, error)

    # not a daemon: the interpreter's exit waits for a tuning in flight rather than tear CUDA down under it
    pending.thread = threading.Thread(target=run, name=f"attnopt-tune-{pending.key[len(PENDING_PREFIX):]}")
    pending.thread.start()
    return pending


def in_background() -> bool:
    """Whether the calling thread is a background tuning (``GpuTimer.warm_up`` then compiles with fewer threads)."""
    return getattr(_BACKGROUND, "on", False)


def job(job_key: Any) -> PendingChoice | None:
    """The pending choice already made for ``job_key`` (running or done), else ``None``."""
    return _JOBS.get(job_key)


def is_pending(plan_key: str) -> bool:
    return plan_key.startswith(PENDING_PREFIX)


def resolved_key(plan_key: str) -> str:
    """The runtime key a pending key stands for (waits for its tuning: the backend's callable has joined it before
    the first call, so this is a dict lookup there). ``KeyError`` for an unknown pending key."""
    pending = _PENDING.get(plan_key)
    if pending is None:
        raise KeyError(f"unknown pending plan {plan_key!r}: it was made by another process or a reset runtime")
    return pending.plan.runtime_key()


def lookup(plan_key: str) -> PendingChoice | None:
    """The pending choice of a pending key (``None`` for another string)."""
    return _PENDING.get(plan_key)


def lowering_plan(plan_key: str) -> Any:
    """The plan a pending key's site is lowered as, whether or not its choice has ended: the fallback, which every
    candidate it times lowers like (a winner that is a ``BucketedPlan`` would not say so itself)."""
    return _PENDING[plan_key].fallback


def unfinished() -> list[PendingChoice]:
    """The pending choices whose tuning, or thread, has not ended."""
    with _lock:
        return [p for p in _PENDING.values()
                if not p.done.is_set() or (p.thread is not None and p.thread.is_alive())]


def join_all() -> float:
    """Wait for every pending choice of the process and for its thread to end; returns the seconds waited (0 when
    none was running)."""
    waiting = unfinished()
    if not waiting:
        return 0.0
    start = time.perf_counter()
    for pending in waiting:
        pending.done.wait()
        if pending.thread is not None and pending.thread is not threading.current_thread():
            pending.thread.join()
    return time.perf_counter() - start


def forget_jobs() -> None:
    """Let later compiles tune again instead of sharing finished jobs (tests; a new tuning cache)."""
    join_all()
    with _lock:
        _JOBS.clear()
