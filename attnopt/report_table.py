"""The cells of the plan table (``PlanReport.rich_table``): a plan's kind and parameters, the alternatives of a group
of sites (the fastest of each kind, rejections merged by reason), and a group's module paths in one string
(``model.layers.{0..29}.self_attn``).
"""
from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from .plan import BucketedPlan, Plan

if TYPE_CHECKING:
    from .report import SiteReport


#: The module column of a site with no module path: dynamo records no module stack for attention called in the
#: compiled module's own ``forward`` (its path in ``named_modules()`` is "") or in a compiled function.
TOP_LEVEL = "(top level)"


def _esc(text: str) -> str:
    from rich.markup import escape

    return escape(text)


def _est(plan: Plan) -> float:
    return math.inf if math.isnan(plan.est_us) else plan.est_us


def _plan_cell(plan: Plan) -> str:
    """``kind`` then its parameters, dimmed: narrower than ``describe()`` and wraps at the commas."""
    if isinstance(plan, BucketedPlan):  # its fields are JSON strings: show the per-length rule instead
        return f"[bold]{plan.kind}[/bold]\n[dim]{_esc(plan.describe()[len(plan.kind) + 1:-1])}[/dim]"
    args = ", ".join(f"{f.name}={getattr(plan, f.name)}" for f in dataclasses.fields(plan) if f.name != "est_us")
    note = plan.runtime_note() if hasattr(plan, "runtime_note") else ""
    return (f"[bold]{plan.kind}[/bold]" + (f"\n[dim]{_esc(args)}[/dim]" if args else "")
            + (f"\n{_esc(note)}" if note else ""))


def _alternatives(group: list[SiteReport], chosen: Plan | None, limit: int | None) -> list[str]:
    """The lines of the alternatives cell. ``limit=None``: every candidate (with its parameters) and every
    rejection. Otherwise the fastest candidate of each kind (the chosen plan left out), then the rejections
    merged by reason (``tree, ring: needs a process group``), ``limit`` lines at most, then ``+N more``."""
    best: dict[str, Plan] = {}  # runtime key -> candidate (the lowest estimate seen in the group)
    for s in group:
        for c in s.candidates:
            k = c.runtime_key()
            if k not in best or _est(c) < _est(best[k]):
                best[k] = c
    skip = chosen.runtime_key() if chosen is not None else None
    others = sorted((c for k, c in best.items() if k != skip), key=_est)
    rejected: dict[str, list[str]] = {}  # reason -> kinds
    for s in group:
        for r in s.rejected:
            kinds = rejected.setdefault(r.reason, [])
            if r.kind not in kinds:
                kinds.append(r.kind)
    base = chosen.est_us if chosen is not None and chosen.est_us > 0 else math.nan

    def est_text(c: Plan) -> str:
        if math.isnan(c.est_us):
            return "not estimated"
        ratio = f" ({c.est_us / base:.1f}x)" if math.isfinite(base) and math.isfinite(c.est_us) else ""
        return f"{c.est_us:.1f} µs{ratio}"

    if limit is None:
        return ([f"{_esc(c.describe())}: {est_text(c)}" for c in others]
                + [f"{_esc(r.kind)}: {_esc(r.reason)}" for s in group for r in s.rejected])
    items: list[tuple[str, int]] = []  # (line, how many alternatives it stands for)
    seen: set[str] = set()
    for c in others:
        if c.kind not in seen:  # the fastest of each kind; the other parameters count in "+N more"
            seen.add(c.kind)
            items.append((f"{c.kind}: {est_text(c)}", 1))
    items += [(f"{', '.join(kinds)}: {_esc(reason)}", len(kinds)) for reason, kinds in rejected.items()]
    shown = items[:limit]
    total = len(others) + sum(len(k) for k in rejected.values())
    hidden = total - sum(n for _, n in shown)
    return [line for line, _ in shown] + ([f"[dim]+{hidden} more[/dim]"] if hidden > 0 else [])


def _ranges(nums: list[int]) -> str:
    """``[0, 1, 2, 3, 5, 7, 8, 9]`` -> ``0..3,5,7..9``."""
    out, i = [], 0
    while i < len(nums):
        j = i
        while j + 1 < len(nums) and nums[j + 1] == nums[j] + 1:
            j += 1
        out.append(f"{nums[i]}..{nums[j]}" if j - i >= 2 else ",".join(str(n) for n in nums[i:j + 1]))
        i = j + 1
    return ",".join(out)


def compact_paths(paths: list[str]) -> str:
    """Module paths of a group in one string: ``model.layers.{0..29}.self_attn`` when they differ in one
    numeric component, else the first path and ``(+N more)``. An empty path is ``TOP_LEVEL``."""
    uniq = list(dict.fromkeys(p or TOP_LEVEL for p in paths))
    if len(uniq) == 1:
        return uniq[0]
    parts = [u.split(".") for u in uniq]
    if len({len(p) for p in parts}) == 1:
        diff = [i for i in range(len(parts[0])) if len({p[i] for p in parts}) > 1]
        if len(diff) == 1 and all(p[diff[0]].isdigit() for p in parts):
            i = diff[0]
            nums = sorted({int(p[i]) for p in parts})
            return ".".join(parts[0][:i] + ["{" + _ranges(nums) + "}"] + parts[0][i + 1:])
    return f"{uniq[0]} (+{len(uniq) - 1} more)"
