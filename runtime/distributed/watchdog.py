"""The collective watchdog: timeouts for collectives replayed from a CUDA graph.

A replayed graph's collectives bypass the process group's own watchdog (NCCL's), so a replay stuck on a dead peer
would hang. :class:`_ReplayWatchdog` watches each replay from a thread in CUDA's thread-local capture mode (it
never disturbs a graph being captured in another thread) and aborts the communicator past the group's timeout;
the next call on any rank raises :class:`~.groups.CollectiveError`.
"""
from __future__ import annotations

import threading

import torch

from .groups import CollectiveError, DistGroup


def _cudart():
    """The CUDA runtime library this process has loaded (the one PyTorch uses), through ctypes; None if none."""
    import ctypes

    try:
        lib = ctypes.CDLL(None)
        lib.cudaThreadExchangeStreamCaptureMode  # noqa: B018 - resolves only if libcudart is in the global scope
        return lib
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart.so" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


def thread_local_capture_mode() -> bool:
    """Put the calling thread in CUDA's thread-local stream-capture mode (``cudaStreamCaptureModeThreadLocal``):
    its CUDA calls then neither fail nor invalidate graph captures running in other threads. True on success."""
    import ctypes

    lib = _cudart()
    if lib is None:
        return False
    mode = ctypes.c_int(1)  # cudaStreamCaptureModeThreadLocal
    try:
        return lib.cudaThreadExchangeStreamCaptureMode(ctypes.byref(mode)) == 0
    except (AttributeError, OSError):
        return False


class _ReplayWatchdog:
    """Timeouts for collectives replayed from a CUDA graph, which the process group's own watchdog does not see.

    Each replay records an event (reused once the watchdog has seen it complete) and appends it, with its
    deadline, to a queue; nothing else happens on the caller's path, so the decode step pays no lock and no
    thread wake-up. A daemon thread wakes every ``poll_s``, drops the completed events at the head of the queue
    and checks the first pending one against its deadline. If that passes, the group is marked failed and its
    communicator aborted (NCCL kernels poll the abort flag, so a replay stuck on a dead peer returns), and the
    next call on any rank raises :class:`CollectiveError`. Only the caller appends and only the thread pops, so
    the deque's own atomic operations are all the synchronisation needed."""

    def __init__(self, group: "DistGroup", poll_s: float = 0.2):
        import collections
        import time

        self._time = time.monotonic
        self.group = group
        self.pending: collections.deque = collections.deque()
        self.free: collections.deque = collections.deque()  # completed events, ready to be recorded again
        self.poll_s = poll_s
        started = threading.Event()
        self.capture_safe = False
        threading.Thread(target=self._run, args=(started,), name=f"attnopt-watchdog-{group.name}",
                         daemon=True).start()
        started.wait(10.0)

    def watch(self, what: str, stream: "torch.cuda.Stream | None" = None) -> None:
        """Queue an event recorded on ``stream`` (default: the current stream) with its deadline."""
        try:
            ev = self.free.pop()
        except IndexError:
            ev = torch.cuda.Event()
        ev.record(stream)
        self.pending.append((ev, self._time() + self.group.timeout.total_seconds(), what))

    def _run(self, started: threading.Event) -> None:
        import time

        # Event queries from this thread must not touch another thread's graph capture: in CUDA's default
        # (global) capture mode any thread's "unsafe" call, cudaEventQuery included, invalidates a capture in
        # progress. Thread-local mode makes this thread ignore other threads' captures (as PyTorch's own NCCL
        # watchdog does). Without it the watchdog does not run and the combine is not replayed.
        self.capture_safe = thread_local_capture_mode()
        started.set()
        if not self.capture_safe:
            return
        while True:
            time.sleep(self.poll_s)
            while self.pending:
                ev, deadline, what = self.pending[0]
                if ev.query():
                    self.pending.popleft()
                    self.free.append(ev)
                    continue
                if self._time() > deadline:
                    self.group.failure = CollectiveError(
                        f"attnopt distributed decode: {what} (replayed from a CUDA graph) did not finish within "
                        f"{self.group.timeout.total_seconds():g}s on {self.group.describe()}: a peer rank died or "
                        f"stalled; the communicator was aborted")
                    try:
                        self.group.pg.abort()
                    except Exception:  # noqa: BLE001 - best effort: the error above is what the caller sees
                        pass
                    self.pending.clear()
                    return
                break
