"""Plan types, the plan-kind registry, and the ``PlanReport`` that every consumer reads.

A plan is a frozen dataclass that says *how* one attention site runs. It round-trips through JSON as
``{"kind": ..., "version": ..., "data": {...}}``. New kinds register with ``@register_plan_kind``.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterable, TypeVar

from .site import AttentionSite

PLAN_KINDS: dict[str, type["Plan"]] = {}

P = TypeVar("P", bound="Plan")


def register_plan_kind(cls: type[P]) -> type[P]:
    """Class decorator: make ``cls`` known to ``plan_from_dict`` under ``cls.kind``."""
    if not getattr(cls, "kind", None):
        raise TypeError(f"{cls.__name__} needs a class attribute 'kind'")
    if cls.kind in PLAN_KINDS and PLAN_KINDS[cls.kind] is not cls:
        raise ValueError(f"plan kind {cls.kind!r} is already registered by {PLAN_KINDS[cls.kind].__name__}")
    PLAN_KINDS[cls.kind] = cls
    return cls


def plan_kind(name: str) -> type["Plan"]:
    try:
        return PLAN_KINDS[name]
    except KeyError:
        raise ValueError(f"unknown plan kind {name!r}; registered kinds: {', '.join(sorted(PLAN_KINDS))}") from None


@dataclass(frozen=True)
class Plan:
    """Base of every plan. ``est_us`` is the cost model's estimate (NaN when not estimated)."""

    kind: ClassVar[str] = ""
    version: ClassVar[int] = 1

    est_us: float = math.nan

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        if isinstance(data.get("est_us"), float) and math.isnan(data["est_us"]):
            data["est_us"] = None
        return {"kind": self.kind, "version": self.version, "data": data}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    def with_estimate(self: P, est_us: float) -> P:
        return dataclasses.replace(self, est_us=float(est_us))

    def describe(self) -> str:
        """Short human form, e.g. ``split_kv(splits=16, block_n=64)``."""
        skip = {"est_us"}
        args = ", ".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self) if f.name not in skip)
        return f"{self.kind}({args})"

    def runtime_key(self) -> str:
        """The string the lowered op carries; it ignores the estimate so equal plans share state."""
        d = self.to_dict()
        d["data"].pop("est_us", None)
        return json.dumps(d, sort_keys=True)


def plan_from_dict(data: dict[str, Any]) -> Plan:
    for key in ("kind", "version", "data"):
        if key not in data:
            raise ValueError(f"plan JSON lacks {key!r}: {data!r}")
    cls = plan_kind(data["kind"])
    if data["version"] != cls.version:
        raise ValueError(f"plan kind {cls.kind!r} version {data['version']} is not supported (this build reads {cls.version})")
    payload = dict(data["data"])
    if payload.get("est_us") is None:
        payload["est_us"] = math.nan
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(payload) - names)
    if unknown:
        raise ValueError(f"unknown field(s) {unknown} for plan kind {cls.kind!r}; valid: {sorted(names)}")
    for f in dataclasses.fields(cls):
        if isinstance(payload.get(f.name), list):
            payload[f.name] = tuple(payload[f.name])
    return cls(**payload)


def plan_from_json(text: str) -> Plan:
    return plan_from_dict(json.loads(text))


# --------------------------------------------------------------------------------------------- plan kinds
@register_plan_kind
@dataclass(frozen=True)
class DensePlan(Plan):
    """Leave the attention as one SDPA call over the un-expanded K/V (``enable_gqa``)."""

    kind: ClassVar[str] = "dense"
    reason: str = ""


@register_plan_kind
@dataclass(frozen=True)
class SplitKVPlan(Plan):
    """FlashDecoding: ``num_splits`` programs per (batch, KV head), each over an equal share of the valid
    keys in ``block_n`` tiles, then a merge of (o, lse).

    The grid is fixed; the share of each split follows the valid length at run time, so a captured CUDA
    graph stays correct as the cache grows.
    """

    kind: ClassVar[str] = "split_kv"
    num_splits: int = 16
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    #: The last split to finish a tile merges it in the same launch (arrival counter), instead of a second launch.
    fused_merge: bool = False


@register_plan_kind
@dataclass(frozen=True)
class StreamKPlan(Plan):
    """LeanAttention: a persistent grid of ``grid`` programs cutting (batch x KV head x KV tile) into
    equal contiguous shares; the last program to finish an output tile merges it."""

    kind: ClassVar[str] = "stream_k"
    grid: int = 132
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2


@register_plan_kind
@dataclass(frozen=True)
class TreePlan(Plan):
    """Tree Attention: local attention over the sequence shard, one collective of softmax states, local merge.

    ``collective``: ``all_gather`` of packed (o, lse); ``all_reduce`` of the max then of [num | den];
    ``all_reduce3`` the paper's three all-reduces (baseline).
    """

    kind: ClassVar[str] = "tree"
    world: int = 2
    collective: str = "all_gather"
    hierarchical: bool = False
    local: str = "auto"


@register_plan_kind
@dataclass(frozen=True)
class RingPlan(Plan):
    """Ring Attention at decode: ``pass_kv`` rotates K/V shards; ``pass_q`` rotates the query and partial states."""

    kind: ClassVar[str] = "ring"
    world: int = 2
    variant: str = "pass_kv"


@register_plan_kind
@dataclass(frozen=True)
class SaapPlan(Plan):
    """SAAP sparse attention (opt-in): sink + recent window + the top-``probes`` key clusters."""

    kind: ClassVar[str] = "saap"
    index: str = ""
    probes: int = 8
    sink: int = 4
    window: int = 256


# --------------------------------------------------------------------------------------------- reports
@dataclass(frozen=True)
class Rejection:
    """A strategy that did not apply at a site, and why."""

    kind: str
    reason: str


@dataclass
class SiteReport:
    """Per site: the chosen plan (``None`` = left untouched), every ranked candidate, every rejection."""

    site: AttentionSite
    chosen: Plan | None = None
    candidates: list[Plan] = field(default_factory=list)
    rejected: list[Rejection] = field(default_factory=list)
    rewritten: bool = False
    calls: int = 0
    #: Key the lowered op counts its calls under (``graph_id:node``); empty when not rewritten.
    key: str = ""

    @property
    def reason_untouched(self) -> str | None:
        if self.rewritten:
            return None
        if self.site.unsupported:
            return self.site.unsupported
        if self.chosen is None:
            return "; ".join(f"{r.kind}: {r.reason}" for r in self.rejected) or "no applicable plan"
        return "not lowered"

    def to_dict(self) -> dict[str, Any]:
        return {
            "site": self.site.to_dict(),
            "chosen": self.chosen.to_dict() if self.chosen else None,
            "candidates": [c.to_dict() for c in self.candidates],
            "rejected": [dataclasses.asdict(r) for r in self.rejected],
            "rewritten": self.rewritten,
            "calls": self.calls,
            "key": self.key,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SiteReport":
        return cls(
            site=AttentionSite.from_dict(data["site"]),
            chosen=plan_from_dict(data["chosen"]) if data.get("chosen") else None,
            candidates=[plan_from_dict(c) for c in data.get("candidates", [])],
            rejected=[Rejection(**r) for r in data.get("rejected", [])],
            rewritten=bool(data.get("rewritten", False)),
            calls=int(data.get("calls", 0)),
            key=data.get("key", ""),
        )


@dataclass
class PlanReport:
    """Everything attnopt decided for one compiled graph (or several, merged)."""

    sites: list[SiteReport] = field(default_factory=list)
    profile: str = ""
    graph: str = ""
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def rewritten(self) -> list[SiteReport]:
        return [s for s in self.sites if s.rewritten]

    @property
    def untouched(self) -> list[SiteReport]:
        return [s for s in self.sites if not s.rewritten]

    def to_dict(self) -> dict[str, Any]:
        return {"version": 1, "profile": self.profile, "graph": self.graph, "config": self.config,
                "sites": [s.to_dict() for s in self.sites]}

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "PlanReport":
        if data.get("version") != 1:
            raise ValueError(f"plan report version {data.get('version')!r} is not supported (expected 1)")
        return cls(sites=[SiteReport.from_dict(s) for s in data.get("sites", [])], profile=data.get("profile", ""),
                   graph=data.get("graph", ""), config=data.get("config", {}))

    @classmethod
    def from_json(cls, text: str) -> "PlanReport":
        return cls.from_dict(json.loads(text))

    @classmethod
    def merge(cls, reports: Iterable["PlanReport"]) -> "PlanReport":
        reports = list(reports)
        out = cls(profile=reports[0].profile if reports else "", graph="+".join(r.graph for r in reports if r.graph))
        for r in reports:
            out.sites.extend(r.sites)
            out.config = out.config or r.config
        return out

    def summary(self) -> str:
        return f"{len(self.sites)} attention site(s), {len(self.rewritten)} rewritten, {len(self.untouched)} left alone"

    def rich_table(self, title: str | None = None):
        """A ``rich.table.Table`` with one row per site."""
        from rich.table import Table

        table = Table(title=title or f"attnopt plans ({self.summary()}; profile {self.profile or '?'})", show_lines=True)
        for col in ("site", "module", "shape", "dtype", "mask", "plan", "est µs", "alternatives / reason"):
            table.add_column(col, overflow="fold")
        for s in self.sites:
            site = s.site
            plan = s.chosen.describe() if (s.chosen and s.rewritten) else "[yellow]untouched[/yellow]"
            est = f"{s.chosen.est_us:.1f}" if (s.chosen and s.rewritten and not math.isnan(s.chosen.est_us)) else "-"
            alts = [f"{c.kind}: {c.est_us:.1f} µs" for c in s.candidates if c is not s.chosen and not math.isnan(c.est_us)]
            alts += [f"{r.kind}: {r.reason}" for r in s.rejected]
            if not s.rewritten:
                alts.insert(0, f"[yellow]why: {s.reason_untouched}[/yellow]")
            table.add_row(site.node, site.module_path, site.shape_str(), site.dtype, site.mask_kind, plan, est,
                          "\n".join(alts))
        return table

    def format_table(self, width: int = 160) -> str:
        from rich.console import Console

        console = Console(width=width, force_terminal=False, color_system=None)
        with console.capture() as cap:
            console.print(self.rich_table())
        return cap.get()
