"""Taking turns between the isolated runs of ``attnopt bench e2e --parallel``, and timing the host side of
``generate()``'s decode calls.

Parallel runs compile at the same time, and each run's timed sections must have the machine to itself: a decode
step and ``generate()`` are bound by host time (about half of a ``generate()`` token is Python and CUDA-graph
launch work), so a timed section beside another run's compile (inductor's worker processes, the plan tuner's
kernel compiles and GPU timings) measures the contention. An ``flock`` on one file orders them:

* ``gpu_turn()``, around timed sections and long prefills: exclusive;
* ``compile_turn()``, around the first (compiling) calls: shared, so compiles overlap each other but never a timed
  section. A compile that waits for its turn does so before its clock starts.

Both are no-ops unless ``$ATTNOPT_BENCH_GPU_LOCK`` names the lock file (``--parallel`` sets it).
"""
from __future__ import annotations

import contextlib
import os
import statistics
import time
from typing import Any, Callable, Iterator

#: The lock file shared by the isolated runs of one ``--parallel`` suite.
LOCK_ENV = "ATTNOPT_BENCH_GPU_LOCK"


@contextlib.contextmanager
def _turn(exclusive: bool) -> Iterator[None]:
    path = os.environ.get(LOCK_ENV)
    if not path:
        yield
        return
    import fcntl

    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def gpu_turn():
    """Hold the machine alone for a timed section (exclusive)."""
    return _turn(True)


def compile_turn():
    """Compile beside other compiles, never beside a timed section (shared)."""
    return _turn(False)


class DecodeCallTimer:
    """Host time of each decode forward call that ``generate()`` makes, HF's compiled path and attnopt's alike.

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
            out = fn(*args, **kwargs)
            seconds.append(clock() - t0)
            return out

        return call

    @contextlib.contextmanager
    def record(self) -> Iterator[None]:
        self.recording = True
        try:
            yield
        finally:
            self.recording = False

    def remove(self) -> None:
        if self.attribute == "__call__":
            vars(self.model).pop("__call__", None)
        else:
            setattr(self.model, self.attribute, self.original)

    def median_ms(self) -> float | None:
        return 1e3 * statistics.median(self.seconds) if self.seconds else None
