"""A background tuning's timer in a worker process: the GPU timer's calls made there, off the inner compile's GIL.

A background tuning (``attnopt.tuning_defer``) runs beside the inner backend's compile, both Python on one GIL. Its
compiles moved to worker processes (``attnopt.tuning_procs``), but the timing stayed: each candidate's timing captures
a CUDA graph of one call per input set (up to ``MAX_SETS``, each a few Python frames that drop and retake the GIL),
and the warm-up's first calls load every kernel. Beside inductor's compile each retake waits up to a switch interval:
on the H100 (4bab739) SmolLM2's 1k site (256 input sets) took 22.2 s to time 7 candidates in one round (4.4 s for
the same work after the compile), and the tuning's own CPU (1.5-4.5 s at llama3's 32k) was taken from the compile.

``ProcessTimer`` answers the tuner's timer calls (``timer(plan, site)``, ``at_fill``, ``valid_len_us``, ``warm_up``,
``host_us``, ``fresh_length_us``, ``release``) by sending each to one worker process (``tuning_procs``' pool),
which runs them on its own ``GpuTimer`` (its input sets and captured graphs live there) and answers in one JSON line;
the tuning thread waits on the pipe without the GIL. The tuner itself, its rounds, pruning, tie-break and choice,
runs unchanged in this process. Its warm-up first compiles the candidates in the pool's other workers, as the GPU
timer's does in a background tuning, then lets the timing worker make its first calls (they load those kernels).

A candidate that fails in the worker fails here with the worker's error text. A worker that dies or stops answering
costs only time: the rest of the job runs on this process's own ``GpuTimer``, as before.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator

from .plan import Plan, plan_from_json
from .site import AttentionSite

#: Seconds one timer call may take in the worker (a warm-up that compiles everything included).
CALL_TIMEOUT_S = 300.0


class WorkerTimerError(RuntimeError):
    """A timer call that failed in the worker; ``worker_text`` is its error text there (``timer.error_text``)."""

    def __init__(self, text: str):
        super().__init__(text)
        self.worker_text = text


class ProcessTimer:
    """The GPU timer's calls, made in a worker process (see the module docstring). ``local``: this process's timer,
    which takes over if the worker fails as a whole; ``device``: the CUDA device index both use."""

    def __init__(self, local: Any, device: int | None):
        self.local, self.device = local, device
        self._worker: Any = None
        self.failed = ""  # why the worker was given up (then every call is ``local``'s)
        self.last_warm_up: dict[str, Any] = {}
        self._connect()  # now: a worker that must start boots while the compile workers compile

    def _connect(self) -> None:
        if not self.failed and self._worker is None:
            from . import tuning_procs

            try:
                self._worker = tuning_procs._take(1)[0]
            except OSError as exc:
                self.failed = f"no timing worker: {exc}"

    # ------------------------------------------------------------------------------------- the calls
    def __call__(self, plan: Plan, site: AttentionSite) -> float:
        return self._ask("time", lambda: self.local(plan, site), plan=plan.runtime_key(), site=site.to_dict())

    def at_fill(self, plan: Plan, site: AttentionSite, keys: int) -> float:
        return self._ask("at_fill", lambda: self.local.at_fill(plan, site, keys), plan=plan.runtime_key(),
                         site=site.to_dict(), keys=int(keys))

    def valid_len_us(self, site: AttentionSite, eager: bool = False) -> float:
        return self._ask("valid_len_us", lambda: self.local.valid_len_us(site, eager=eager), site=site.to_dict(),
                         eager=eager)

    def host_us(self, plan: Plan, site: AttentionSite) -> float:
        return self._ask("host_us", lambda: self.local.host_us(plan, site), plan=plan.runtime_key(),
                         site=site.to_dict())

    def fresh_length_us(self, plan: Plan, site: AttentionSite) -> tuple[float, float]:
        got = self._ask("fresh_length_us", lambda: self.local.fresh_length_us(plan, site), plan=plan.runtime_key(),
                        site=site.to_dict())
        return float(got[0]), float(got[1])

    def warm_up(self, plans: list[Plan], site: AttentionSite, eager: bool = False) -> dict[str, str]:
        """The candidates' kernels compiled in the pool's compile workers, then their first calls in the timing
        worker (which load them), its input sets and its mask reduction; ``last_warm_up`` as ``GpuTimer``'s."""
        from . import tuning_procs
        from .timer import _warmed_here

        self.last_warm_up = {}
        kernel_plans = [p for p in plans if not _warmed_here(p)]
        procs = tuning_procs.compile_procs()
        if procs and kernel_plans and not self.failed:
            try:
                self.last_warm_up = tuning_procs.first_calls_in_processes(kernel_plans, site, eager=eager,
                                                                          device=self.device, procs=procs)
            except OSError as exc:  # (no process could start: the timing worker's first calls compile)
                from .timer import error_text

                self.last_warm_up = {"procs": 0, "procs_s": 0.0, "errors": {"compile workers": error_text(exc)}}
        got = self._ask("warm_up", lambda: self.local.warm_up(plans, site, eager=eager),
                        plans=[p.runtime_key() for p in plans], site=site.to_dict(), eager=eager)
        if self.failed:  # (``local`` made the first calls)
            self.last_warm_up = {**self.last_warm_up, **getattr(self.local, "last_warm_up", {}),
                                 "timer": f"this process ({self.failed})"}
            return got
        self.last_warm_up = {**self.last_warm_up, "calls_cpu_s": got.get("calls_cpu_s", 0.0), "timer": "worker"}
        return dict(got["errors"])

    def release(self) -> None:
        """Free the worker's input sets and graphs (and this process's, which a failed worker left to ``local``)."""
        if self._worker is not None and not self.failed:
            with contextlib.suppress(WorkerTimerError):
                self._ask("release", lambda: None)
        self.local.release()

    # ------------------------------------------------------------------------------------- the channel
    def _ask(self, what: str, local_call, **payload: Any) -> Any:
        """The worker's answer to one call, or ``local_call()`` once the worker has failed as a whole."""
        self._connect()
        if self.failed:
            return local_call()
        self._worker.send({"timer": what, "device": self.device, **payload})
        got = self._worker.receive(time.perf_counter() + CALL_TIMEOUT_S)
        if got is None or not ("value" in got or "error" in got):
            self.failed = f"the timing worker stopped answering ({self._worker.problem()})" if got is None else \
                f"the timing worker answered {str(got)[:120]}"
            return local_call()
        if "error" in got:
            raise WorkerTimerError(str(got["error"]))
        return got["value"]

    def close(self) -> None:
        """Hand the worker back to the pool (or end it, if it failed)."""
        from . import tuning_procs

        if self._worker is not None:
            if self.failed:
                self._worker.close()
            else:
                tuning_procs._give_back([self._worker])
            self._worker = None


@contextlib.contextmanager
def timing_in_worker(tuner: Any, device: int | None) -> Iterator[None]:
    """Within this block ``tuner`` (its lock held by the caller) times through a ``ProcessTimer`` when its timer is
    the process's ``GpuTimer`` on a GPU and the compile workers are on (``$ATTNOPT_TUNE_COMPILE_PROCS`` not 0);
    otherwise as it is."""
    from . import timer, tuning_procs

    if device is None or getattr(tuner, "timer", None) is not timer.gpu_timer or tuning_procs.compile_procs() == 0:
        yield
        return
    proxy = ProcessTimer(timer.gpu_timer, device)
    tuner.timer = proxy
    try:
        yield
    finally:
        tuner.timer = timer.gpu_timer
        proxy.release()
        proxy.close()


def serve_timer_call(payload: dict[str, Any], gpu_timer: Any) -> dict[str, Any]:
    """In the worker: one timer call of ``ProcessTimer`` on ``gpu_timer`` (the worker's ``GpuTimer``); returns
    ``{"value": answer}`` or ``{"error": its error text}``. Timed as in a background tuning (the replays behind a
    GPU-side wait: this host is busy with the inner compile's processes) with no compile workers of its own."""
    from .timer import error_text
    from .tuning_defer import _BACKGROUND

    # timed as a background tuning (GpuTimer: a longer preroll before timed replays, fewer warm-up threads), for
    # this call only: served in-process (tests, a fallback) the caller's thread must not stay marked as background
    was_background = getattr(_BACKGROUND, "on", False)
    _BACKGROUND.on = True
    what = payload["timer"]
    try:
        if payload.get("device") is not None:
            import torch

            torch.cuda.set_device(int(payload["device"]))
        site = AttentionSite.from_dict(payload["site"]) if "site" in payload else None
        plan = plan_from_json(payload["plan"]) if "plan" in payload else None
        if what == "time":
            value: Any = float(gpu_timer(plan, site))
        elif what == "at_fill":
            value = float(gpu_timer.at_fill(plan, site, int(payload["keys"])))
        elif what == "valid_len_us":
            value = float(gpu_timer.valid_len_us(site, eager=bool(payload.get("eager"))))
        elif what == "host_us":
            value = float(gpu_timer.host_us(plan, site))
        elif what == "fresh_length_us":
            value = [float(x) for x in gpu_timer.fresh_length_us(plan, site)]
        elif what == "warm_up":
            plans = [plan_from_json(k) for k in payload["plans"]]
            errors = gpu_timer.warm_up(plans, site, eager=bool(payload.get("eager")), procs=0)
            value = {"errors": errors, "calls_cpu_s": gpu_timer.last_warm_up.get("calls_cpu_s", 0.0)}
        elif what == "release":
            gpu_timer.release()
            value = None
        else:
            raise ValueError(f"unknown timer call {what!r}")
    except Exception as exc:  # noqa: BLE001 - the tuner sees the call fail with this text
        return {"error": error_text(exc)}
    finally:
        _BACKGROUND.on = was_background
    return {"value": value}
