"""What an unexpected exception inside the passes does (``OptimizeConfig.on_error``).

With "fallback" (the default) the failing site is left as the original attention (``detect``'s site building, the
plan of one site, the lowering of one site whose new nodes can be erased again), or, where the graph was changed
beyond one site's undo, the whole graph is restored from the copy taken before ``lower``. A graph warns once per
pass and exception (``PassErrorWarning``, naming the sites or the graph and the exception), and the reason is where
the plan report shows left-alone sites: the site's ``unsupported`` (``attnopt error in plan: KeyError: ...``) or
``PlanReport.errors``.
With "raise", or ``$ATTNOPT_STRICT=1``, the exception propagates. Errors the user must see are never caught:
``user_errors()``.
"""
from __future__ import annotations

import copy
import dataclasses
import warnings
from typing import Any

import torch.fx as fx

from attnopt.report import PassErrorWarning


def user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that are the user's to fix, raised whatever ``on_error`` says: a SAAP index that does not fit the
    model, a process group that cannot run the plan, ``verify``'s mismatch."""
    from attnopt.runtime.distributed.groups import DistributedDecodeError
    from attnopt.runtime.ops import VerificationError
    from attnopt.runtime.saap.index import SaapIndexError

    return SaapIndexError, DistributedDecodeError, VerificationError, KeyboardInterrupt


def reraise(ctx: Any, exc: BaseException) -> bool:
    """Whether ``exc``, raised inside a pass, must propagate (strict mode, or a user's error)."""
    return not isinstance(exc, Exception) or isinstance(exc, user_errors()) or ctx.config.strict()


def describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text[:200]}" if text else type(exc).__name__


def site_reason(stage: str, exc: BaseException) -> str:
    """The ``unsupported`` reason of a site left alone because ``stage`` raised ``exc``."""
    return f"attnopt error in {stage}: {describe(exc)} (left as the original attention)"


def _warn(what: str, stage: str, text: str) -> None:
    warnings.warn(f"attnopt: {stage} raised {text} at {what}; left as the original, run through the inner backend "
                  "(on_error='raise' or ATTNOPT_STRICT=1 makes this an error)", PassErrorWarning, stacklevel=3)


def site_failed(ctx: Any, site: Any, stage: str, exc: BaseException) -> Any:
    """``site`` (an ``AttentionSite``) left alone because ``stage`` raised ``exc``: re-raises where ``reraise`` says so,
    else keeps it for ``warn_site_errors`` and returns the site with the reason as its ``unsupported``."""
    if reraise(ctx, exc):
        raise exc
    ctx.site_errors.append((stage, describe(exc), f"{site.node} ({site.module_path or 'top level'})"))
    return dataclasses.replace(site, unsupported=site_reason(stage, exc))


def warn_site_errors(ctx: Any) -> None:
    """One warning per (pass, exception) over the sites ``site_failed`` left alone in this graph (every layer of a
    decoder is one shape: a bug at one is usually a bug at all of them)."""
    groups: dict[tuple[str, str], list[str]] = {}
    for stage, text, where in ctx.site_errors:
        groups.setdefault((stage, text), []).append(where)
    for (stage, text), sites in groups.items():
        names = ", ".join(sites[:3]) + (f" and {len(sites) - 3} more" if len(sites) > 3 else "")
        _warn(f"{len(sites)} site(s) of graph {ctx.graph_id}: {names}", stage, text)
    ctx.site_errors.clear()


def snapshot(gm: fx.GraphModule, ctx: Any) -> fx.Graph | None:
    """A copy of ``gm``'s graph to restore if ``lower`` fails beyond one site (None in strict mode or with no site:
    nothing would restore it). Nodes are new, their meta dicts shallow copies; tensors are not copied."""
    if ctx.config.strict() or not ctx.matches:
        return None
    return copy.deepcopy(gm.graph)


def graph_failed(gm: fx.GraphModule, ctx: Any, saved: fx.Graph | None, stage: str, exc: BaseException) -> fx.GraphModule:
    """Restore ``gm`` to ``saved`` (its graph before ``lower``; None: the failing pass changed nothing), mark every
    site not rewritten and record why in ``ctx.report.errors``; re-raises where ``reraise`` says so."""
    if reraise(ctx, exc):
        raise exc
    warn_site_errors(ctx)
    _warn(f"graph {ctx.graph_id}", stage, describe(exc))
    if saved is not None:
        gm.graph = saved
        gm.recompile()
        ctx.original_graph = None  # (now gm's own graph: a second restore would hand it the graph it has)
    reason = site_reason(stage, exc)
    for s in ctx.report.sites:
        if s.rewritten or not s.site.unsupported:
            s.rewritten, s.key = False, ""
            s.site = dataclasses.replace(s.site, unsupported=reason)
    ctx.report.errors.append(f"graph {ctx.graph_id}: {stage} raised {describe(exc)}")
    return gm


def undo_site(graph: fx.Graph, before: set[fx.Node], orig: fx.Node, ctx: Any) -> bool:
    """Erase the nodes a failed ``lower_site`` added (those not in ``before``), when nothing that was there before
    reads them and the original output is still in the graph; forget the shared ones ``ctx`` cached. Returns whether
    the graph is as it was (False: restore the whole graph)."""
    present = set(graph.nodes)
    added = [n for n in graph.nodes if n not in before]
    if len(present) - len(added) != len(before) or orig not in present:  # a node that was there is gone
        return False
    if any(u in before for n in added for u in n.users):  # an original node reads a new one: uses were replaced
        return False
    for n in reversed(added):
        graph.erase_node(n)
    gone = set(added)
    for key in [k for k, v in ctx.valid_lens.items() if _holds(v, gone)]:  # shared nodes this site made first
        del ctx.valid_lens[key]
    return True


def _holds(value: Any, nodes: set[fx.Node]) -> bool:
    if isinstance(value, fx.Node):
        return value in nodes
    if isinstance(value, (tuple, list)):
        return any(_holds(v, nodes) for v in value)
    return False
