"""``plan`` pass: ask every registered strategy for a verdict and candidates, rank them by estimated µs."""
from __future__ import annotations

import math

import torch.fx as fx

from attnopt.plan import Rejection, SiteReport

from .context import PassContext


def plan_site(site, hw, plan_ctx, config) -> SiteReport:
    """Rank every applicable strategy at one site. ``config.force_plan`` wins when it is applicable."""
    from attnopt.runtime.strategies import STRATEGIES

    report = SiteReport(site=site)
    if site.unsupported:
        return report
    allowed = set(config.strategies) if config.strategies is not None else None
    if allowed is not None:
        unknown = allowed - set(STRATEGIES)
        if unknown:
            raise ValueError(f"unknown strategies {sorted(unknown)} in config; registered: {', '.join(sorted(STRATEGIES))}")
    if config.force_plan is not None and config.force_plan not in STRATEGIES:
        raise ValueError(f"force_plan={config.force_plan!r} is not a registered plan kind; valid: {', '.join(sorted(STRATEGIES))}")
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
                                                   "unsupported": f"force_plan={config.force_plan!r} does not apply: {why}"})
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
