"""The ``attnopt`` dynamo backend: run the passes, then hand the graph to the inner backend.

Registered through the entry-point group ``torch_dynamo_backends`` (see pyproject.toml), so
``torch.compile(model, backend="attnopt")`` works in a fresh process without ``import attnopt``.
``torch.compile(..., backend="attnopt", options={...})`` passes ``OptimizeConfig`` fields as options.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from .config import OptimizeConfig, check_call
from .report import PlanReport

log = logging.getLogger("attnopt")

#: Every report of this process, newest last (``attnopt.last_plans()`` with no argument reads these).
_ALL_REPORTS: list[PlanReport] = []
_log_lock = threading.Lock()


def _compile_inner(name: str, gm: fx.GraphModule, example_inputs: Sequence[Any], mode: str | None) -> Callable:
    if name == "eager":
        return gm.forward
    if name == "inductor":
        from torch._inductor.compile_fx import compile_fx

        patches = {"triton.cudagraphs": True} if mode == "reduce-overhead" else {}
        return compile_fx(gm, list(example_inputs), config_patches=patches)
    from torch._dynamo.backends.registry import lookup_backend

    return lookup_backend(name)(gm, list(example_inputs))


def replays_as_cuda_graphs(name: str, mode: str | None) -> bool:
    """Whether ``_compile_inner(name, ..., mode)`` makes a graph that replays as CUDA graphs (then a plan's host
    launch cost is gone at run time; otherwise the measured choice counts it)."""
    return (name == "inductor" and mode == "reduce-overhead") or name == "cudagraphs"


def append_plan_log(path: str, report: PlanReport) -> None:
    """Append one report as one JSON line; ``attnopt plans PATH`` reads and merges them."""
    p = Path(path)
    if p.parent and not p.parent.exists():
        p.parent.mkdir(parents=True, exist_ok=True)
    with _log_lock, p.open("a") as fh:
        fh.write(report.to_json() + "\n")


class Backend:
    """A dynamo backend bound to one ``OptimizeConfig`` (and, for multi-GPU plans, one process group).

    Each compiled graph adds one ``PlanReport`` to ``self.reports``.
    """

    def __init__(self, config: OptimizeConfig | None = None, process_group: Any = None, mode: str | None = None):
        self.config = config or OptimizeConfig()
        check_call(self.config, process_group, mode)
        self.process_group = process_group
        self.mode = mode
        self.reports: list[PlanReport] = []
        #: Calls of the graphs this backend compiled, and calls of the optimized object that ran none of them.
        self.graph_calls = 0
        self.uncompiled_calls = 0
        #: Seconds spent in attnopt's passes (detection, planning, tuning, lowering) and in the inner backend's
        #: compile, over every graph so far: what attnopt adds to a first call, beside dynamo's tracing.
        self.pass_seconds = 0.0
        self.inner_compile_seconds = 0.0
        #: Measured choices that ran in the background beside the inner compile (``attnopt.tuning_defer``), and the
        #: seconds first calls waited for them: the tuning that the inner compile did not hide.
        self.background_tunings: list[Any] = []
        self.tune_wait_seconds = 0.0
        self.__name__ = "attnopt"

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        return self.compile(gm, example_inputs, self.mode)

    def with_mode(self, mode: str | None, graphed: bool | None = None) -> Callable:
        """A backend that compiles like this one, into its reports and call counts, with another inner ``mode``.
        ``graphed``: whether the compiled graphs will replay inside CUDA graphs (default: as ``mode`` makes them;
        True for ``attnopt.step_graphs``, which records them itself)."""
        check_call(self.config, self.process_group, mode)

        def backend(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
            return self.compile(gm, example_inputs, mode, graphed)

        backend.__name__ = "attnopt"
        return backend

    def compile(self, gm: fx.GraphModule, example_inputs: Sequence[Any], mode: str | None,
                graphed: bool | None = None) -> Callable:
        """Run the passes over ``gm``, record its report, and compile it with the inner backend in ``mode``."""
        from attnopt.passes import make_context, run_passes

        world_size, topology = 1, None
        if self.process_group is not None:
            from attnopt.runtime import distributed

            world_size = distributed.register_group(self.process_group).world
            topology = self.config.topology
        t0 = time.perf_counter()
        if graphed is None:
            graphed = replays_as_cuda_graphs(self.config.inner_backend, mode)
        # the returned callable waits for pending choices before its first call: measuring may overlap the inner
        # compile (multi-GPU plans are never measured)
        ctx = make_context(self.config, example_inputs, world_size=world_size, topology=topology,
                           graphed=graphed, defer_tuning=world_size == 1)
        gm, report = run_passes(gm, example_inputs, ctx=ctx)
        self.pass_seconds += time.perf_counter() - t0
        self.reports.append(report)
        _ALL_REPORTS.append(report)
        if world_size > 1:
            check_no_decode_left_over_shards(report)
        pending = pending_choices(report)
        self.background_tunings += [p for p in pending if p not in self.background_tunings]
        t0 = time.perf_counter()
        try:
            compiled = _compile_inner(self.config.inner_backend, gm, example_inputs, mode)
        except Exception as exc:  # noqa: BLE001 - the original graph, if the rewrite is what the inner backend fails on
            if not report.rewritten or ctx.original_graph is None:
                raise
            from attnopt.passes.guard import graph_failed

            stage = f"the {self.config.inner_backend} compile of the rewritten graph"
            gm = graph_failed(gm, ctx, ctx.original_graph, stage, exc)
            if world_size > 1:  # the original attends to this rank's shard alone: raise, naming why
                check_no_decode_left_over_shards(report)
            compiled = _compile_inner(self.config.inner_backend, gm, example_inputs, mode)
        ctx.original_graph = None
        self.inner_compile_seconds += time.perf_counter() - t0
        if not pending:
            self._log_report(report)
        return self._counted(compiled, report if pending else None, graphed)

    def _log_report(self, report: PlanReport) -> None:
        path = self.config.resolved_plan_log()
        if path:
            append_plan_log(path, report)
        log.info("attnopt: %s (graph %s)", report.summary(), report.graph)

    def join_tuning(self) -> float:
        """Wait for every measured choice still running in the background (``attnopt.tuning_defer``); returns the
        seconds waited, also added to ``tune_wait_seconds``."""
        from .tuning_defer import join_all

        waited = join_all()
        self.tune_wait_seconds += waited
        return waited

    def _counted(self, compiled: Callable, pending_report: PlanReport | None = None, graphed: bool = False) -> Callable:
        """``compiled``, counting its calls in ``graph_calls`` (one attribute increment per call). With
        ``pending_report`` (a report whose choices run in the background), the first call first waits for every
        pending choice of the process, so that no tuning runs beside the model's kernels or a CUDA-graph capture
        (which the first call's own warm-up precedes), then writes the resolved report to the plan log.

        ``graphed`` (the graph replays as CUDA graphs): its calls outside a capture, the warm-up calls before a
        recording, launch the kernels' captured variant (``tma_as_captured``: TMA tiles), the one the tuner compiled
        and timed. Eager calls otherwise take pointer tiles (less host time per launch), another kernel that the first
        call compiled cold on its critical path, for two calls (H100, llama3's layers: first call minus inner compile
        4.2-6.7 s at 3f41936 and 4bab739)."""
        unresolved = [pending_report] if pending_report is not None else []
        as_captured = _as_captured_flag() if graphed else None

        def run(*args: Any) -> Any:
            if unresolved:
                self.join_tuning()
                self._log_report(unresolved.pop())
            self.graph_calls += 1
            if as_captured is None or getattr(as_captured, "on", False):
                return compiled(*args)
            as_captured.on = True
            try:
                return compiled(*args)
            finally:
                as_captured.on = False

        if getattr(compiled, "_boxed_call", False):
            run._boxed_call = True  # type: ignore[attr-defined]
        return run

    def note_graph_replay(self) -> None:
        """A whole-step CUDA graph of this backend's compiled code replayed (``attnopt.step_graphs``)."""
        self.graph_calls += 1

    def note_uncompiled_call(self, what: str) -> None:
        """Count a call of an optimized object that ran no graph of this backend; warn at the first."""
        self.uncompiled_calls += 1
        if self.uncompiled_calls == 1:
            import warnings

            from .api import FallbackWarning

            msg = (f"attnopt: a call of {what} ran without attnopt: dynamo ran it eagerly (a recompile limit was hit, "
                   "a compile error was suppressed, or the frame was skipped), so its attention was not rewritten. "
                   "attnopt.last_plans(...).calls_without_attnopt counts these calls; TORCH_LOGS=recompiles shows "
                   "why dynamo recompiled")
            log.warning(msg)
            warnings.warn(msg, FallbackWarning, stacklevel=3)

    def report(self) -> PlanReport:
        """All graphs compiled by this backend so far, merged, with live op call counts."""
        report = with_call_counts(PlanReport.merge(self.reports) if self.reports else PlanReport())
        report.calls_without_attnopt = self.uncompiled_calls
        return report

    def reset(self) -> None:
        self.reports.clear()


def _as_captured_flag() -> Any:
    """The runtime's per-thread flag that ``tma_as_captured`` sets (``None`` where the kernels cannot be imported:
    then nothing launches them either)."""
    try:
        from attnopt.runtime.kernels import common
    except ImportError:
        return None
    return common._AS_CAPTURED


def pending_choices(report: PlanReport) -> list[Any]:
    """The background choices (``tuning_defer.PendingChoice``) that ``report``'s sites wait on, one each."""
    from .tuning_defer import lookup

    found = [lookup(s.pending_key) for s in report.sites if s.pending_key]
    return list(dict.fromkeys(p for p in found if p is not None))


def check_no_decode_left_over_shards(report: PlanReport) -> None:
    """With a sequence-sharded cache, a decode site left as it was would attend to this rank's shard only: a
    wrong answer. Raise instead, naming the sites and why they were not rewritten. Prefill sites are fine: the
    sharded cache hands the whole prompt to the prefill attention."""
    from attnopt.runtime.distributed import DistributedDecodeError

    bad = [s for s in report.sites if not s.rewritten and not (s.reason_untouched or "").startswith("prefill")]
    if bad:
        lines = "; ".join(f"{s.site.node} ({s.site.module_path or '?'}): {s.reason_untouched}" for s in bad[:4])
        raise DistributedDecodeError(
            f"attnopt with a process group: {len(bad)} attention site(s) could not be rewritten into tree/ring "
            f"decode, and left as they are they would attend to this rank's KV shard only: {lines}"
            + (f" (+{len(bad) - 4} more)" if len(bad) > 4 else ""))


def with_call_counts(report: PlanReport) -> PlanReport:
    from attnopt.runtime.ops import CALL_COUNTS

    for s in report.sites:
        if s.key:
            s.calls = CALL_COUNTS.get(s.key, 0)
            s.verified = CALL_COUNTS.get("verified:" + s.key, 0)
    return report


def options_from_env() -> dict[str, Any]:
    """``ATTNOPT_OPTIONS`` may hold a JSON object of config options for the plain string backend."""
    text = os.environ.get("ATTNOPT_OPTIONS")
    if not text:
        return {}
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"ATTNOPT_OPTIONS is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError("ATTNOPT_OPTIONS must be a JSON object of OptimizeConfig options")
    return data


def string_backend_entry(gm: fx.GraphModule, example_inputs: Sequence[Any], options: dict[str, Any] | None = None,
                         mode: str | None = None) -> Callable:
    """Entry point of ``torch.compile(..., backend="attnopt", options={...}, mode=...)``: the graphs of one
    (options, mode) go to one ``Backend``, whose reports ``attnopt.last_plans(compiled)`` reads."""
    from .string_backend import backend_for

    return backend_for(options, mode)(gm, example_inputs)


def __getattr__(name: str) -> Any:
    # The entry point ``attnopt.backend:attnopt_backend`` (pyproject.toml) is looked up by dynamo when
    # torch.compile(..., backend="attnopt") first runs, with dynamo imported: the moment to make
    # ``compiled.generate`` warn, without importing dynamo (1.6 s) with attnopt.
    if name == "attnopt_backend":
        from .string_backend import install_generate_warning

        install_generate_warning()
        return string_backend_entry
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
