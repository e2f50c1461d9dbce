"""``plan`` pass: ask every registered strategy for a verdict and candidates, rank them by estimated µs, and on a GPU
choose among the best few by measurement (``attnopt.tuning``)."""
from __future__ import annotations

import logging
import math

import torch.fx as fx

from attnopt.report import Rejection, SiteReport

from . import guard
from .context import PassContext

log = logging.getLogger("attnopt.tuning")


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


def rank_candidates(site, hw, plan_ctx, config) -> tuple[list, list[Rejection]]:
    """Every applicable strategy's candidates at ``site`` with their estimates, lowest first (ties keep the
    strategies' order), and the rejections with their reasons."""
    from attnopt.runtime.strategies import STRATEGIES
    from attnopt.runtime.strategies.base import variant_reason

    check_strategies(config)
    allowed = set(config.strategies) if config.strategies is not None else None
    candidates, rejected = [], []
    for kind, strategy in STRATEGIES.items():
        if not getattr(strategy, "ranked", True):
            continue
        if allowed is not None and kind not in allowed and kind != "dense":
            rejected.append(Rejection(kind, "not in config.strategies"))
            continue
        if strategy.distributed != (plan_ctx.world_size > 1):
            if strategy.distributed:
                rejected.append(Rejection(kind, "needs a process group (world size 1)"))
            continue
        reason = variant_reason(strategy, site) or strategy.check(site, hw, plan_ctx)
        if reason is not None:
            rejected.append(Rejection(kind, reason))
            continue
        for cand in strategy.candidates(site, hw, plan_ctx):
            candidates.append(cand.with_estimate(strategy.estimate_us(cand, site, hw, plan_ctx)))
    candidates.sort(key=lambda p: (math.inf if math.isnan(p.est_us) else p.est_us))
    return candidates, rejected


def plan_site(site, hw, plan_ctx, config, tuner=None, valid_len_sharing: int = 1, ranked=None) -> SiteReport:
    """Rank every applicable strategy at one site. ``config.force_plan`` wins when it is applicable; otherwise
    ``tuner`` (an ``attnopt.tuning.Tuner``, ``None`` = the cost model alone) picks among the best candidates, now or,
    where ``deferral_reason`` allows, on a background thread (the report then holds a pending key until it ends).
    ``valid_len_sharing``: the sites that share this site's valid-length computation (``valid_len_sharing``).
    ``ranked``: ``rank_candidates``'s answer for this site when the caller has it (from an identical site)."""
    report = SiteReport(site=site)
    if site.unsupported:
        return report
    candidates, rejected = ranked or rank_candidates(site, hw, plan_ctx, config)
    report.candidates, report.rejected = list(candidates), list(rejected)
    if config.force_plan is not None:
        forced = [c for c in report.candidates if c.kind == config.force_plan]
        if forced:
            report.chosen = forced[0]
            report.choice = "forced"
        else:
            why = next((r.reason for r in report.rejected if r.kind == config.force_plan), "no candidate")
            report.site = report.site.__class__(**{**report.site.to_dict(),
                                                   "unsupported": f"force_plan={config.force_plan!r} does not apply: {why}; "
                                                                  "the site is left as the original attention"})
        return report
    if not report.candidates:
        return report
    report.chosen = report.candidates[0]
    if tuner is not None and plan_ctx.world_size == 1:
        from attnopt.tuning import tunable_reason

        if tunable_reason(site) is None:
            # Unknown (a caller without a backend): device time alone, as a CUDA-graph replay runs it.
            graphed = plan_ctx.extras.get("graphed", True)
            if deferral_reason(site, plan_ctx, config, graphed) is None:
                _choose_in_background(report, site, hw, plan_ctx, config, tuner, valid_len_sharing, graphed)
            else:
                _choose_now(report, site, hw, plan_ctx, config, tuner, valid_len_sharing, graphed)
    return report


def _choose_now(report, site, hw, plan_ctx, config, tuner, valid_len_sharing: int, graphed: bool) -> None:
    """The measured choice, before the lowering (as before ``attnopt.tuning_defer``)."""
    from attnopt.tuning_defer import TUNE_LOCK

    try:
        with TUNE_LOCK:  # a background choice of an earlier graph may be timing on the shared GPU timer
            if site.kv_len is not None:
                picked = tuner.choose(site, report.candidates, valid_len_sharing=valid_len_sharing, graphed=graphed)
            else:
                picked = tuner.choose_bucketed(site, lambda at: rank_candidates(at, hw, plan_ctx, config)[0],
                                               valid_len_sharing=valid_len_sharing, graphed=graphed)
    except Exception as exc:  # noqa: BLE001 - a failed measurement must not fail the compile
        log.warning("attnopt: measuring plans for %s failed (%s: %s); using the cost model's choice",
                    site.shape_str(), type(exc).__name__, exc)
    else:
        report.chosen, report.choice, report.measured_us = picked.plan, picked.choice, picked.measured_us
        report.tune_s = round(float(getattr(picked, "tune_s", 0.0)), 3)


def deferral_reason(site, plan_ctx, config, graphed: bool) -> str | None:
    """Why the measured choice at ``site`` must finish before the lowering (``None``: it may run in the background,
    beside the inner compile; ``attnopt.tuning_defer``)."""
    if not plan_ctx.extras.get("defer_tuning"):
        return "the caller resolves plans at once (export, the CLI, a compile outside the backend)"
    if not graphed:
        # the choice adds each call's host time, which the inner compile's Python on the same GIL would inflate
        return "the graph does not replay as CUDA graphs: a call's host time is measured, on a quiet host"
    if site.window is not None:
        return "a sliding window's key range is lowered per plan (band, scan or the mask alone)"
    if site.shared_prefix is not None:
        return "a shared prefix is lowered per plan (cascade or not)"
    if config.saap:
        return "SAAP sites are planned knowing the index (opt-in, not exact): chosen before the lowering"
    return None


def without_valid_len(plans, site) -> list:
    """The plans whose lowering computes no device valid length (``uses_valid_len``): what a deferred choice times,
    so that the graph lowered before the choice is exact for whichever of them wins."""
    from attnopt.plan import uses_valid_len

    return [p for p in plans if not uses_valid_len(p, site)]


def _choose_in_background(report, site, hw, plan_ctx, config, tuner, valid_len_sharing: int, graphed: bool) -> None:
    """Lower now, choose later: the candidates that share one lowering (``without_valid_len``); a persisted
    measurement resolves at once (no thread), otherwise the site gets a pending key (``report.pending_key``) that the
    op resolves to the measured winner, or, if the tuning fails, to the cost model's pick among them."""
    from attnopt import tuning_defer

    timed = without_valid_len(report.candidates, site)
    if not timed:  # (not on any registered strategy: SDPA takes no valid length) then the model's pick, at once
        _choose_now(report, site, hw, plan_ctx, config, tuner, valid_len_sharing, graphed)
        return
    job = (tuner, ranking_key(site, plan_ctx), valid_len_sharing, graphed, tuple(p.runtime_key() for p in timed))
    earlier, cached = tuning_defer.job(job), getattr(tuner, "cached", None)
    if earlier is not None and earlier.done.is_set() and earlier.choice is not None:  # an earlier graph measured it
        report.chosen, report.choice, report.measured_us = earlier.plan, "cached", earlier.choice.measured_us
        return
    if earlier is None and site.kv_len is not None and cached is not None:  # (the file: once per shape)
        hit = cached(site, timed, valid_len_sharing=valid_len_sharing, graphed=graphed)
        if hit is not None:
            report.chosen, report.choice, report.measured_us = hit.plan, hit.choice, hit.measured_us
            return
    if site.kv_len is not None:
        def work():
            return tuner.choose(site, timed, valid_len_sharing=valid_len_sharing, graphed=graphed)
    else:  # each bucket times its own candidates that share the lowering; the worker reads the cache first
        def work():
            return tuner.choose_bucketed(site, lambda at: without_valid_len(
                rank_candidates(at, hw, plan_ctx, config)[0], at), valid_len_sharing=valid_len_sharing, graphed=graphed)
    pending = tuning_defer.submit(job, timed[0], _in_worker(work, plan_ctx, tuner, site if site.kv_len else None))
    report.chosen, report.pending_key = timed[0], pending.key
    pending.attach(report)


def _in_worker(work, plan_ctx, tuner, site=None):
    """``work`` as the worker thread runs it: on this thread's current CUDA device (a new thread starts on device 0),
    timing in a worker process where it can (``attnopt.timer_proc``: off the inner compile's GIL; then the winner's
    first call at ``site``, a fixed shape, is made here too, before the choice resolves: ``first_call_here``), and
    with the timer's input sets and captured graphs freed at its end, failed or not, on that thread (nothing of the
    timing is left for a later garbage collection, which could run on a thread that is capturing a CUDA graph)."""
    device = None
    if plan_ctx.device_type == "cuda":
        import torch

        device = torch.cuda.current_device()

    def run():
        if device is not None:
            import torch

            torch.cuda.set_device(device)
        from attnopt.timer_proc import first_call_here, timing_in_worker

        try:
            with timing_in_worker(tuner, device) as moved:
                choice = work()
            if moved and site is not None:
                first_call_here(getattr(choice, "plan", None), site)
            return choice
        finally:
            release = getattr(getattr(tuner, "timer", None), "release", None)
            if release is not None:
                release()

    return run


def plan(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    ctx.report.profile = ctx.hardware.name + ("" if not ctx.hardware.calibrated else " (calibrated)")
    ctx.report.graph = ctx.graph_id
    ctx.report.config = ctx.config.to_dict()
    tuner = ctx.plan_context.extras.get("tuner", _default)
    if tuner is _default:
        from attnopt.tuning import default_tuner

        tuner = default_tuner(ctx.plan_context.device_type, ctx.plan_context.triton_available)
    if getattr(ctx.config, "tune", None) is False:  # an OptimizeConfig ``tune`` option, where the config has one
        tuner = None
    sharing = valid_len_sharing(ctx.matches)
    # Every layer of a decoder is one site shape: the ranking (every strategy's candidates, each estimated) is
    # made once per shape, not once per layer (30 times for SmolLM2).
    ranked: dict = {}
    for match, shared in zip(ctx.matches, sharing):
        try:
            report = _plan_match(gm, ctx, match, shared, tuner, ranked)
        except Exception as exc:  # noqa: BLE001 - on_error: this site alone is left as the original
            match.site = guard.site_failed(ctx, match.site, "plan", exc)
            report = SiteReport(site=match.site)
        ctx.report.sites.append(report)
    return gm


def _plan_match(gm: fx.GraphModule, ctx: PassContext, match, shared: int, tuner, ranked: dict) -> SiteReport:
    """The report of one site; ``ranked`` holds the rankings made so far, by ``ranking_key``."""
    site = match.site
    key = ranking_key(site, ctx.plan_context)
    if not site.unsupported and key not in ranked:
        ranked[key] = rank_candidates(site, ctx.hardware, ctx.plan_context, ctx.config)
    here = ranked.get(key)
    if here is not None and any(c.kind == "saap" for c in here[0]):
        why = saap_site_reason(match, gm.graph)
        if why is not None:  # this site's mask, not its shape: the shared ranking stays as it is
            here = ([c for c in here[0] if c.kind != "saap"], list(here[1]) + [Rejection("saap", why)])
    return plan_site(site, ctx.hardware, ctx.plan_context, ctx.config, tuner, shared, ranked=here)


def saap_site_reason(m, graph: fx.Graph) -> str | None:
    """Why the SAAP plan would not compute this site's attention over the keys it selects (None: it does). Its
    kernels read one valid length per batch row and no mask, and place query row ``i`` of ``L`` at key position
    ``valid_len - L + i`` (causal inside the decode block). So: one query row (with several, a site without a mask
    lets every row see every key, and a mask's query positions cannot be proven consecutive), and a mask that is
    provably one prefix of the keys per batch row (a padding lookup, a window or an additive finfo.min mask would be
    read as its last visible key alone)."""
    from .mutation import MutationIndex
    from .patterns import meta_shape
    from .patterns.band import prefix_reason

    site = m.site
    if site.q_len != 1:
        return (f"q_len {site.q_len}: the SAAP kernels make the query rows causal inside the decode block, which "
                "the original " + ("does not" if m.attn_mask is None else "cannot be proven to do") +
                " (SAAP runs one query row per step)")
    if m.score_bias is not None:
        return "a score bias: the SAAP kernels read no mask or bias"
    if m.attn_mask is None:
        return None
    if m.mask_invert or not isinstance(m.attn_mask, fx.Node):
        return "an inverted or constant mask: the SAAP kernels read one valid length per batch row, not the mask"
    batch = site.batch if site.batch is not None else (meta_shape(m.q) or (None,))[0]
    why = prefix_reason(m.attn_mask, batch, MutationIndex(graph))
    return None if why is None else f"the SAAP kernels read one valid length per batch row, not the mask: {why}"


def ranking_key(site, plan_ctx):
    """What ``rank_candidates`` reads of a site: all of it but its node name, and but its module path unless SAAP is
    on (its index covers some layers, named by the path)."""
    from dataclasses import replace

    return replace(site, node="", module_path=site.module_path if plan_ctx.extras.get("saap") else "")


def valid_len_sharing(matches) -> list[int]:
    """Per match, how many matches share its device valid-length computation: the lowering makes one
    ``valid_len_from_mask`` per (mask node, static batch size) for every site reading that mask as it is
    (``lower_nodes._shared_valid_len``), and one of its own for a site with a symbolic batch, an inverted mask or a mask
    written for it alone. Every layer of a decoder reads the same mask, so the count is usually the layer count:
    the tuner charges each site ``1 / count`` of the computation's measured time."""
    def key(m):
        site = m.site
        if (site is None or site.mask_kind not in ("valid_length", "arbitrary") or m.attn_mask is None
                or site.batch is None or m.mask_invert or m.mask_written):
            return None
        return (m.attn_mask, int(m.site.batch))

    keys = [key(m) for m in matches]
    counts: dict = {}
    for k in keys:
        if k is not None:
            counts[k] = counts.get(k, 0) + 1
    return [counts[k] if k is not None else 1 for k in keys]


_default = object()

__all__ = ["plan", "plan_site", "rank_candidates", "ranking_key", "valid_len_sharing", "deferral_reason",
           "without_valid_len", "saap_site_reason"]
