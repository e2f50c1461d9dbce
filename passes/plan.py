"""``plan`` pass: ask every registered strategy for a verdict and candidates, rank them by estimated µs."""
from __future__ import annotations

import math

import torch.fx as fx

from attnopt.plan import Rejection, SiteReport

from .context import PassContext


def check_strategies(config) -> None:
    """``ValueError`` when ``config.force_plan`` or ``config.strategies`` names a plan kind that no registered
    strategy implements (the config checked the kinds against the plan types; a type can exist without its
    strategy, e.g. ``saap`` before its strategy lands)."""
    from attnopt.runtime.strategies import STRATEGIES

    asked = ([config.force_plan] if config.force_plan is not None else []) + list(config.strategies or ())
    missing = [kind for kind in dict.fromkeys(asked) if kind not in STRATEGIES]
    if missing:
        which = "force_plan" if config.force_plan in missing else "strategies"
        raise ValueError(f"{which}: plan kind {', '.join(map(repr, missing))} has a plan type but no strategy implements "
                         f"it in this build; kinds with a strategy: {', '.join(sorted(STRATEGIES))}")


def plan_site(site, hw, plan_ctx, config) -> SiteReport:
    """Rank every applicable strategy at one site. ``config.force_plan`` wins when it is applicable."""
    from attnopt.runtime.strategies import STRATEGIES

    report = SiteReport(site=site)
    if site.unsupported:
        return report
    check_strategies(config)
    allowed = set(config.strategies) if config.strategies is not None else None
    for kind, strategy in STRATEGIES.items():
        if allowed is not None and kind not in allowed and kind != "dense":
            report.rejected.append(Rejection(kind, "not in config.strategies"))
            continue
        if strategy.distributed != (plan_ctx.world_size > 1):
            if strategy.distributed:
                report.rejected.append(Rejection(kind, "needs a process group (world size 1)"))
            continue
        reason = strategy.check(site, hw, plan_ctx)
        if reason is not None:
            report.rejected.append(Rejection(kind, reason))
            continue
        for cand in strategy.candidates(site, hw, plan_ctx):
            report.candidates.append(cand.with_estimate(strategy.estimate_us(cand, site, hw, plan_ctx)))
    report.candidates.sort(key=lambda p: (math.inf if math.isnan(p.est_us) else p.est_us))
    if config.force_plan is not None:
        forced = [c for c in report.candidates if c.kind == config.force_plan]
        if forced:
            report.chosen = forced[0]
        else:
            why = next((r.reason for r in report.rejected if r.kind == config.force_plan), "no candidate")
            report.site = report.site.__class__(**{**report.site.to_dict(),
                                                   "unsupported": f"force_plan={config.force_plan!r} does not apply: {why}; "
                                                                  "the site is left as the original attention"})
        return report
    if report.candidates:
        report.chosen = report.candidates[0]
    return report


def plan(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    ctx.report.profile = ctx.hardware.name + ("" if not ctx.hardware.calibrated else " (calibrated)")
    ctx.report.graph = ctx.graph_id
    ctx.report.config = ctx.config.to_dict()
    for match in ctx.matches:
        ctx.report.sites.append(plan_site(match.site, ctx.hardware, ctx.plan_context, ctx.config))
    return gm
