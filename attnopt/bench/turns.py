"""Taking turns between the isolated runs of ``attnopt bench e2e --parallel``, and timing the host side of
``generate()``'s decode calls.

Parallel runs compile at the same time, and each run's timed sections must have the machine to itself: a decode
step and ``generate()`` are bound by host time (about half of a ``generate()`` token is Python and CUDA-graph
launch work), so a timed section beside another run's CPU work (imports, building a random-init model, a prefill,
inductor's compile and its worker processes, the plan tuner's kernel compiles and GPU timings, a profile, the
interpreter's exit) measures the contention. An ``flock`` on one file orders them:

* ``gpu_turn()``, around timed sections and profiles: exclusive;
* ``compile_turn()``, around the first (compiling) calls and prefills: shared, so compiles overlap each other but
  never a timed section. A compile that waits for its turn does so before its clock starts.
* a worker of ``--isolate`` holds the shared turn for its whole life, from before its first import to its exit
  (``WORKER_BOOT`` takes it; ``gpu_turn`` converts it to the exclusive one and back): whatever a run does outside
  its timed sections, no other run's timed section runs beside it. So a worker's timed sections wait for every
  other worker's compiles: ``e2e.run_one`` prepares all of a row first (prefill, compiles, ``generate()``'s first
  calls) and times all of it in one exclusive turn, so the workers compile together and then time one after
  another (a prefill under the exclusive turn, before the compile, had serialised the compiles: H100, 3f41936).

Turns nest (an inner turn that the held one covers is a no-op) and are per thread (the tests stand threads in for
processes). All are no-ops unless ``$ATTNOPT_BENCH_GPU_LOCK`` names the lock file (``--parallel`` sets it).
"""
from __future__ import annotations

import contextlib
import os
import statistics
import threading
import time
from typing import Any, Callable, Iterator

#: The lock file shared by the isolated runs of one ``--parallel`` suite.
LOCK_ENV = "ATTNOPT_BENCH_GPU_LOCK"
#: The descriptor on which ``WORKER_BOOT`` took the shared turn before the worker's imports.
BOOT_FD_ENV = "ATTNOPT_BENCH_BOOT_FD"
#: ``python -c`` program of an isolated worker: the shared turn first, then ``attnopt.cli`` with the arguments.
WORKER_BOOT = (
    "import os, sys\n"
    f"path = os.environ.get({LOCK_ENV!r})\n"
    "if path:\n"
    "    import fcntl\n"
    "    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)\n"
    "    fcntl.flock(fd, fcntl.LOCK_SH)\n"
    f"    os.environ[{BOOT_FD_ENV!r}] = str(fd)\n"
    "from attnopt.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n")

_held = threading.local()  # per thread: fd (the lock file's descriptor), mode (0, LOCK_SH or LOCK_EX)
#: The boot's descriptor, taken out of the environment at import (no child process inherits the variable).
_BOOT_FD = os.environ.pop(BOOT_FD_ENV, None)


def _state(path: str) -> Any:
    global _BOOT_FD
    if getattr(_held, "path", None) != path:  # (another lock file: a test's; the old one is not held)
        if _BOOT_FD is not None and threading.current_thread() is threading.main_thread():
            import fcntl  # the worker's boot took the shared turn: the main thread holds it from now on

            _held.fd, _held.mode, _BOOT_FD = int(_BOOT_FD), fcntl.LOCK_SH, None
        else:
            _held.fd, _held.mode = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644), 0
        _held.path = path
    return _held


@contextlib.contextmanager
def _turn(exclusive: bool) -> Iterator[None]:
    path = os.environ.get(LOCK_ENV)
    if not path:
        yield
        return
    import fcntl

    held = _state(path)
    want = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
    before = held.mode
    if before in (want, fcntl.LOCK_EX):  # already covered
        yield
        return
    fcntl.flock(held.fd, want)  # (from shared: flock drops it, then waits for the exclusive turn)
    held.mode = want
    try:
        yield
    finally:
        fcntl.flock(held.fd, before or fcntl.LOCK_UN)
        held.mode = before


def gpu_turn():
    """Hold the machine alone for a timed section (exclusive)."""
    return _turn(True)


def compile_turn():
    """Compile beside other compiles, never beside a timed section (shared)."""
    return _turn(False)


def end_helper_processes() -> dict[str, Any]:
    """End the helper processes a prepared run leaves idle, before its timed sections: attnopt's compile and timing
    workers (``attnopt.tuning_procs``; each holds a CUDA context) and inductor's compile worker pool (HF's rows have
    one too). Whatever a later compile needs starts again. Returns what was ended (for the row)."""
    from attnopt import tuning_procs

    ended: dict[str, Any] = {"attnopt_workers": tuning_procs.shutdown()}
    try:
        from torch._inductor import async_compile

        stop = getattr(async_compile, "shutdown_compile_workers", None)
        if stop is not None:
            stop()
            ended["inductor_compile_workers"] = True
    except Exception as exc:  # noqa: BLE001 - the row is still timed; say why the pool stayed
        ended["inductor_compile_workers"] = f"{type(exc).__name__}: {exc}"[:160]
    return ended


def spread(values: list[float]) -> dict[str, float]:
    """min, median and max of repeated measurements (one noisy repeat moves the median by at most one rank)."""
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


class DecodeCallTimer:
    """Host time of each decode forward call that ``generate()`` makes, HF's compiled path and attnopt's alike, and the
    period from one such call to the next (``token_seconds``).

    ``generate()`` calls ``model._compiled_call`` when it compiles by itself (HF's static-cache path) and
    ``model.__call__`` otherwise (attnopt's optimized copy, whose forward is attnopt's graphs); its prefill calls
    ``model(...)``, which neither wrapper sees. The time runs from the call to its return: dynamo's guards, the
    wrappers around the graph, the CUDA-graph replay's launch and the output's construction, but not the GPU's
    work, which a replay does not wait for. Install after the first (compiling) ``generate()`` call; ``hf_compiles``:
    whether that call compiled through HF's own path (then ``model._compiled_call`` exists).
    """

    def __init__(self, model: Any, hf_compiles: bool):
        self.model = model
        self.seconds: list[float] = []
        self.starts: list[list[float]] = []  # per recorded generate() call, its decode forward calls' start times
        self.recording = False
        self.attribute = "_compiled_call" if hf_compiles else "__call__"
        if hf_compiles and "_compiled_call" not in vars(model):
            raise RuntimeError("generate() did not compile through HF's path (no model._compiled_call): on the CPU "
                               "it compiles only with compile_config._compile_all_devices")
        self.original: Callable = getattr(model, self.attribute)
        setattr(model, self.attribute, self._timed(self.original))

    def _timed(self, fn: Callable) -> Callable:
        seconds, clock = self.seconds, time.perf_counter

        def call(*args: Any, **kwargs: Any) -> Any:
            if not self.recording:
                return fn(*args, **kwargs)
            t0 = clock()
            self.starts[-1].append(t0)
            out = fn(*args, **kwargs)
            seconds.append(clock() - t0)
            return out

        return call

    @contextlib.contextmanager
    def record(self) -> Iterator[None]:
        """Around one ``generate()`` call: its decode forward calls' host times and start times."""
        self.starts.append([])
        self.recording = True
        try:
            yield
        finally:
            self.recording = False

    def token_seconds(self) -> list[float]:
        """The seconds from each decode forward call's start to the next one's, inside each recorded ``generate()``:
        one generated token's whole period (the forward, generate()'s own work, and the wait for the GPU where the
        loop syncs, as HF's does at every token to check whether to stop). A period cannot come out shorter than the
        work it spans, as the difference of two noisy ``generate()`` calls could (H100, 4bab739: 0.57 ms a token
        for HF at 1k, whose step alone is 2.1 ms)."""
        return [b - a for starts in self.starts for a, b in zip(starts, starts[1:])]

    def remove(self) -> None:
        if self.attribute == "__call__":
            vars(self.model).pop("__call__", None)
        else:
            setattr(self.model, self.attribute, self.original)

    def median_ms(self) -> float | None:
        return 1e3 * statistics.median(self.seconds) if self.seconds else None
