"""The tuner's Triton compiles in worker processes: a background tuning's warm-up without the GIL of the process.

A background tuning (``attnopt.tuning_defer``) runs beside the inner backend's compile, and both are Python on one
GIL. Its warm-up (``GpuTimer.warm_up``) makes every candidate's first call, and a cold first call compiles the
candidate's Triton kernels: Triton's front end (the kernel's AST to its first IR) is Python, and its MLIR passes run
under the GIL too. On the H100 (e052280) that warm-up took 8-8.7 s on 4 threads, and inductor's compile of SmolLM2
ran 35-37 s beside the tuning against 26-28 s without it.

Here the same first calls run first in ``procs`` worker processes (``python -m attnopt.tuning_procs PAYLOAD``, the site and the plans in JSON), each on the
site's shape with the same input set, so Triton compiles each kernel exactly as the tuner's own first call would (same
source, specialisation, options and target) and writes it to its on-disk cache; the tuner's own first calls then find
the kernels there and only load them. The calling thread waits on the workers' pipes, which holds no GIL. The worker
processes make their own CUDA context on the same device and exit when done: nothing of theirs is left when the
model's first call runs.

Anything that goes wrong in a worker (no CUDA, a failed import, a kernel that does not compile) only costs the time:
the tuner's own first calls compile what is missing and report their own errors, as before.
"""
from __future__ import annotations

import atexit
import json
import subprocess
import sys
import threading
import time
from typing import Any

from .plan import Plan, plan_from_json
from .site import AttentionSite

#: Worker processes a background tuning compiles its candidates in (``$ATTNOPT_TUNE_COMPILE_PROCS``; 0: in-process
#: threads only, as before). Each costs an interpreter, torch's import and a CUDA context (2-4 s on the H100 host)
#: beside the compile, against about a second of Triton compile per candidate.
BACKGROUND_COMPILE_PROCS = 3
PROCS_ENV = "ATTNOPT_TUNE_COMPILE_PROCS"
#: Seconds the workers may take at most (then they are ended: the tuner's own first calls compile what is missing).
TIMEOUT_S = 120.0


def compile_procs(default: int = BACKGROUND_COMPILE_PROCS) -> int:
    """Worker processes for the warm-up's compiles: ``$ATTNOPT_TUNE_COMPILE_PROCS`` where set, else ``default``."""
    from .timer_calls import count_from_env

    return count_from_env(PROCS_ENV, default, "worker processes >= 0 (0: compile the tuner's candidates in this "
                                              "process)")


def split(plans: list[Plan], procs: int) -> list[list[Plan]]:
    """``plans`` dealt round-robin into at most ``procs`` non-empty groups (the candidates come ranked, so each
    worker gets some of the likeliest winners early)."""
    groups = [plans[i::procs] for i in range(max(1, min(procs, len(plans))))]
    return [g for g in groups if g]


def first_calls_in_processes(plans: list[Plan], site: AttentionSite, *, eager: bool = False, device: Any = None,
                             procs: int = BACKGROUND_COMPILE_PROCS, timeout_s: float = TIMEOUT_S) -> dict[str, Any]:
    """Make ``plans``' warm-up first calls in up to ``procs`` worker processes at once and wait for them (workers that
    ``prestart`` started, where some are idle, else new ones; they go back to the pool after).

    Returns ``{"procs": n, "procs_s": wall seconds, "errors": {runtime key: error text}, "pids": the workers'}``: a
    plan's error is its first call's in the worker; a worker that failed as a whole gives each of its plans its
    error."""
    started = time.perf_counter()
    groups = split(list(plans), procs)
    workers = _take(len(groups))
    for group, worker in zip(groups, workers):
        worker.send({"site": site.to_dict(), "plans": [p.runtime_key() for p in group], "eager": eager,
                     "device": device})
    errors: dict[str, str] = {}
    deadline = started + timeout_s
    for group, worker in zip(groups, workers):
        got = worker.receive(deadline)
        if got is None or "job" in got:  # (it died, timed out, or could not read the job)
            problem = worker.problem() if got is None else got["job"]
            errors.update({p.runtime_key(): f"error: compile worker: {problem[:160]}" for p in group})
        else:
            errors.update({k: v for k, v in got.items() if v})
    _give_back(workers)
    return {"procs": len(groups), "procs_s": round(time.perf_counter() - started, 3), "errors": errors,
            "pids": [w.proc.pid for w in workers]}


class _Worker:
    """One compile worker process (``python -m attnopt.tuning_procs --serve``): a JSON line in (a site, its plans),
    a JSON line out (each plan's error, "" where its first call ran); it exits at the end of its input or after
    ``IDLE_S`` seconds without a job."""

    def __init__(self):
        import tempfile

        self.log = tempfile.TemporaryFile("w+")  # its stderr (a pipe nobody reads could fill and block it)
        self.proc = subprocess.Popen([sys.executable, "-m", "attnopt.tuning_procs", "--serve"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, bufsize=1)
        self.timed_out = False

    def alive(self) -> bool:
        return self.proc.poll() is None and not self.timed_out

    def send(self, payload: dict[str, Any]) -> None:
        try:
            self.proc.stdin.write(json.dumps(payload) + "\n")
            self.proc.stdin.flush()
        except OSError:  # it has exited: ``receive`` says so
            pass

    def receive(self, deadline: float) -> dict[str, str] | None:
        """Its answer, or None (it exited, answered nonsense, or the deadline passed: then it is ended)."""
        import select

        ready = select.select([self.proc.stdout], [], [], max(0.0, deadline - time.perf_counter()))[0]
        if not ready:
            self.timed_out = True
            self.close()
            return None
        return _result(self.proc.stdout.readline())

    def problem(self) -> str:
        if self.timed_out:
            return f"no answer within {TIMEOUT_S:.0f} s"
        self.log.seek(0)
        tail = self.log.read().strip().splitlines()[-1:]
        return tail[0] if tail else f"exit {self.proc.poll()}"

    def close(self) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


#: Seconds an idle worker waits for a job before it exits (the tunings of one first call come within seconds).
IDLE_S = 180.0
_idle: list[_Worker] = []
_pool_lock = threading.Lock()


def prestart(n: int | None = None) -> int:
    """Start ``n`` (default ``compile_procs()`` and one more, the timing worker of ``timer_proc``; none when that is 0)
    workers now, so that a background tuning finds them ready: their interpreter, torch and CUDA context (about 2 s)
    start beside dynamo's tracing instead of after it. ``attnopt.optimize(model, mode="reduce-overhead")`` calls it on
    a GPU. Returns the number of idle workers."""
    if n is None:
        n = compile_procs() + 1 if compile_procs() else 0
    with _pool_lock:
        _idle[:] = [w for w in _idle if w.alive()]
        while len(_idle) < n:
            _idle.append(_Worker())
        return len(_idle)


def prestart_for_tuning(mode: str | None) -> None:
    """``prestart`` where a background tuning is likely to follow: ``mode="reduce-overhead"`` on a GPU with Triton
    compiling (not interpreting), tuning on (``ATTNOPT_TUNE``) and no tuning cache file yet (a first run on this
    machine: with one, the shapes are most likely measured already, and a miss starts its workers at its warm-up).
    Never raises: without workers the warm-up starts its own."""
    import os

    if mode != "reduce-overhead" or os.environ.get("ATTNOPT_TUNE", "").strip().lower() in ("0", "false", "no", "off"):
        return
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return
    from .tuning_cache import cache_path

    if cache_path().exists():
        return
    try:
        import torch

        if torch.cuda.is_available() and compile_procs() > 0:
            prestart()
    except (OSError, ValueError):  # (a bad ATTNOPT_TUNE_COMPILE_PROCS is reported where the tuning reads it)
        pass


def _take(n: int) -> list[_Worker]:
    with _pool_lock:
        ready = [w for w in _idle if w.alive()]
        taken, _idle[:] = ready[:n], ready[n:]
    return taken + [_Worker() for _ in range(n - len(taken))]


def _give_back(workers: list[_Worker]) -> None:
    with _pool_lock:
        for w in workers:
            (_idle.append(w) if w.alive() else w.close())


def shutdown() -> None:
    """End the idle workers (at exit, and where a caller knows no tuning follows)."""
    with _pool_lock:
        workers, _idle[:] = list(_idle), []
    for w in workers:
        w.close()


atexit.register(shutdown)


def _result(line: str) -> dict[str, str] | None:
    """A worker's answer: one JSON object on one line (None when there is none)."""
    try:
        got = json.loads(line or "")
    except ValueError:
        return None
    return got if isinstance(got, dict) else None


def run_first_calls(payload: dict[str, Any]) -> dict[str, str]:
    """In the worker: the warm-up's first call of each plan (``GpuTimer.warm_up``'s ``first_call``: the captured
    variant, unless ``captured`` is false, and the eager one where ``eager``), on the site's input set; returns the
    error text of each, "" where it ran."""
    import torch
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from .timer import error_text, site_call, synthetic_inputs

    site = AttentionSite.from_dict(payload["site"])
    device_type = "cuda" if payload.get("device") is not None else "cpu"
    if device_type == "cuda":
        torch.cuda.set_device(int(payload["device"]))
    from attnopt.runtime.kernels.common import tma_as_captured

    with unset_fake_temporarily(), torch.no_grad():
        warm_set = synthetic_inputs(site, 0, device=device_type, reduce=False)
        errors = {}
        for key in payload["plans"]:
            try:
                plan = plan_from_json(key)
                if payload.get("captured", True):
                    with tma_as_captured():
                        site_call(plan, site, warm_set)()
                if payload.get("eager"):
                    site_call(plan, site, warm_set)()
                if device_type == "cuda":
                    torch.cuda.synchronize()
                errors[key] = ""
            except Exception as exc:  # noqa: BLE001 - reported; the tuner's own first call will say it again
                errors[key] = error_text(exc)
    return errors


def serve() -> int:
    """The worker: the imports and the CUDA context first (while its parent traces), then one job per input line: a
    site's first calls (``run_first_calls``) or one call of a ``timer_proc.ProcessTimer`` (a line with ``"timer"``)."""
    import os
    import select

    answers = os.fdopen(os.dup(1), "w")  # the answers' channel; anything else printed goes to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    import torch

    from . import timer
    from .timer_proc import serve_timer_call

    if torch.cuda.is_available():
        torch.cuda.init()
    try:  # the runtime too, before the first job (a failure shows in that job's answer)
        from attnopt.runtime import ops, strategies  # noqa: F401
    except Exception:  # noqa: BLE001
        pass
    while True:
        if not select.select([sys.stdin], [], [], IDLE_S)[0]:
            return 0  # nobody needed it
        line = sys.stdin.readline()
        if not line:
            return 0
        try:
            job = json.loads(line)
            answer = serve_timer_call(job, timer.gpu_timer) if "timer" in job else run_first_calls(job)
        except Exception as exc:  # noqa: BLE001 - a job it cannot read: every plan of it fails with the reason
            from .timer import error_text

            answer = {"job": error_text(exc)}
        print(json.dumps(answer), file=answers, flush=True)


if __name__ == "__main__":
    sys.exit(serve())
