"""How ``attnopt.step_graphs`` records and replays on a GPU: CUDA graphs in one memory pool."""
from __future__ import annotations

import gc
from typing import Any, Callable

import torch


class CudaGraphs:
    """How ``StepGraphs`` records and replays: CUDA graphs in one memory pool shared by all of its signatures (they
    never run at once, and every output a graph keeps stays allocated). Tests on the CPU pass a stand-in."""

    device_type = "cuda"

    def __init__(self) -> None:
        self._pool = None

    def record(self, fn: Callable[[], Any]) -> tuple[Any, Any]:
        """(graph, fn's output): ``fn`` recorded, not run; the output's tensors live in the graph's memory."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        # No garbage collection during the capture: a collection there can free an object that owns CUDA memory
        # of another pool (a tuner's timing graph, its input sets), whose release may call cudaFree from this very
        # thread and invalidate the capture. The suspect (not proven) of an intermittent failure on the H100:
        # cudaErrorStreamCaptureInvalidated in generate()'s recording with no other thread of ours alive and
        # capture_error_mode="thread_local" (8936801); none in the next run with this (e052280). No gc.collect()
        # first: it took 0.6-0.8 s a recording there (in a cProfile of generate()); the garbage can wait.
        collecting = gc.isenabled()
        gc.disable()
        try:
            # thread_local: a CUDA call that another thread of this process makes meanwhile (a Triton compile
            # loading its module) must not invalidate this capture; inductor's CUDA-graph trees capture the same way
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                output = fn()
        except Exception:
            self._abandon_pool()
            raise
        finally:
            if collecting:
                gc.enable()
        return graph, output

    def _abandon_pool(self) -> None:
        """After a failed capture: PyTorch skips ending the allocator's routing into the pool when the capture ends
        in an error, and every later capture into that pool then failed ("beginAllocateToPool: already recording
        to mempool_id"; H100, torch 2.11, a retried recording). End it, and record later graphs in a new pool (the
        recorded graphs keep theirs)."""
        end = getattr(torch._C, "_cuda_endAllocateToPool", None)
        if end is not None:
            try:
                end(torch.cuda.current_device(), self._pool)
            except Exception:  # noqa: BLE001 - nothing was routing any more: fine
                pass
        self._pool = None

    def replay(self, graph: Any) -> None:
        graph.replay()
