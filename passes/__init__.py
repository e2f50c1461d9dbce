"""attnopt.passes: detect -> plan -> lower over an FX graph. ``lower`` is the only mutating pass and runs last."""
from __future__ import annotations

from typing import Any, Sequence

import torch.fx as fx

from attnopt.config import OptimizeConfig
from attnopt.report import PlanReport

from . import guard
from .context import PassContext
from .detect import detect
from .lower import lower
from .plan import plan

PASSES = (detect, plan, lower)


def make_context(config: OptimizeConfig, example_inputs: Sequence[Any] = (), world_size: int = 1,
                 topology: Any = None, graphed: bool | None = None, defer_tuning: bool = False) -> PassContext:
    """Resolve the hardware profile and the planning context for ``config`` on this machine. ``graphed``: whether
    the compiled graph will replay as CUDA graphs (``None``: not known; the measured choice then times device time
    alone), kept in ``plan_context.extras["graphed"]``. ``defer_tuning``: the caller waits for pending measured
    choices before the graph's first call (``attnopt.tuning_defer``), so the plan pass may measure in the
    background (``passes.plan.deferral_reason``)."""
    from attnopt.hardware import resolve_profile
    from attnopt.runtime.strategies import PlanContext

    device_type = "cpu"
    for x in example_inputs:
        if hasattr(x, "device"):
            device_type = x.device.type
            if device_type != "cpu":
                break
    hw = resolve_profile(config.hardware) if (config.hardware or device_type == "cuda") else resolve_profile("cpu")
    from attnopt.runtime.kernels import triton_usable

    extras: dict[str, Any] = {"saap": saap_options(config)} if config.saap else {}
    if graphed is not None:
        extras["graphed"] = bool(graphed)
    if defer_tuning:
        extras["defer_tuning"] = True
    plan_ctx = PlanContext(world_size=world_size, topology=topology, device_type=device_type,
                           triton_available=triton_usable(device_type), extras=extras)
    return PassContext(config=config, hardware=hw, plan_context=plan_ctx, example_inputs=list(example_inputs))


def saap_options(config: OptimizeConfig) -> dict[str, Any]:
    """The SAAP plan's options: the config's, with those left at None taken from the index's recommended
    operating point (``SaapIndex.decode_defaults``)."""
    from attnopt.runtime.saap.registry import get_index

    given = {"probes": config.saap_probes, "sink": config.saap_sink, "window": config.saap_window}
    defaults = get_index(config.saap).decode_defaults() if None in given.values() else {}
    return {"index": config.saap, **{k: defaults[k] if v is None else v for k, v in given.items()}}


def run_passes(gm: fx.GraphModule, example_inputs: Sequence[Any] = (), config: OptimizeConfig | None = None,
               ctx: PassContext | None = None) -> tuple[fx.GraphModule, PlanReport]:
    """Run ``PASSES`` in order over ``gm`` (a dynamo, aot_autograd or export graph). Returns (gm, report).

    An unexpected exception leaves its site, else the graph, as the original (``guard``; ``config.on_error``)."""
    ctx = ctx or make_context(config or OptimizeConfig(), example_inputs)
    strict = ctx.config.strict()  # (a bad $ATTNOPT_STRICT raises here, before any pass)
    if ctx.config.force_plan is not None or ctx.config.strategies:
        from .plan import check_strategies

        check_strategies(ctx.config)  # the user's error, raised whatever on_error says
    stage = "detect"
    try:
        for p in PASSES:
            stage = p.__name__
            if p is lower and not strict:
                ctx.original_graph = guard.snapshot(gm, ctx)
            gm = p(gm, ctx)
    except Exception as exc:  # noqa: BLE001 - guard.graph_failed re-raises what must be seen
        gm = guard.graph_failed(gm, ctx, ctx.original_graph, stage, exc)
    guard.warn_site_errors(ctx)
    return gm, ctx.report


__all__ = ["PASSES", "PassContext", "make_context", "run_passes", "detect", "plan", "lower"]
