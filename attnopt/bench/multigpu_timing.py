"""Step timers of ``attnopt bench multigpu``: host-driven (``eager_us``, lock-step across ranks behind a barrier;
``local_eager_us`` on one rank) and CUDA-graph replay (``graph_us``, every rank agreeing that its capture succeeded
before any replays).
"""
from __future__ import annotations

from typing import Any, Callable


def _sync(cuda: bool) -> None:
    if cuda:
        import torch

        torch.cuda.synchronize()


def eager_us(fn: Callable[[], Any], g, iters: int, cuda: bool) -> float:
    """Mean wall time per step of ``iters`` lock-step calls (host overhead included), after warm-up: the ranks
    meet at a barrier before timing, so no rank's time includes waiting for a slower peer's warm-up."""
    import torch

    def barrier():
        g.all_reduce(torch.zeros(1, device="cuda" if cuda else "cpu"), _sum(), what="bench barrier")
        _sync(cuda)

    return local_eager_us(fn, iters, cuda, after_warmup=barrier)


def local_eager_us(fn: Callable[[], Any], iters: int, cuda: bool,
                   after_warmup: Callable[[], Any] | None = None) -> float:
    """Median over 3 repeats of the mean wall time per call of ``iters`` calls, after 3 warm-up calls."""
    from .common import host_us

    return host_us(fn, iters, repeats=3, warmup=3, sync=lambda: _sync(cuda), sync_in_timing=True,
                   after_warmup=after_warmup)


def graph_us(fn: Callable[[], Any], steps: int, g=None, replays: int = 7) -> float:
    """Median per-step time of a CUDA graph holding ``steps`` calls (identical on every rank: lock-step).

    With a group ``g``, the ranks agree that every capture succeeded before any replays (a replay of captured
    collectives on one rank alone would wait on its peers)."""
    import torch
    import torch.distributed as dist

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = None
    error = None
    try:
        with torch.cuda.stream(stream):
            for _ in range(3):
                fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(steps):
                fn()
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001
        error = exc
    if g is not None:
        flag = torch.tensor([0.0 if error is None else 1.0], device="cuda")
        g.all_reduce(flag, dist.ReduceOp.MAX, what="graph capture agreement")
        if flag.item() and error is None:
            error = RuntimeError("a peer rank failed to capture the graph")
    if error is not None:
        raise error
    from .common import replayed_us

    return replayed_us(graph, steps, replays)


def _sum():
    import torch.distributed as dist

    return dist.ReduceOp.SUM
