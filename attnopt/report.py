"""The ``PlanReport`` every consumer reads (``attnopt.last_plans``, the CLI, the bench suites): per site the chosen plan,
the ranked alternatives and the rejections, with the table and JSON forms.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable

from .plan import Plan, _expect, plan_from_dict
from .report_table import TOP_LEVEL, _alternatives, _esc, _plan_cell, compact_paths
from .site import AttentionSite

# --------------------------------------------------------------------------------------------- reports
class PassErrorWarning(UserWarning):
    """attnopt's passes raised an unexpected exception at a site or graph, which was left as the original
    (``OptimizeConfig.on_error="fallback"``); the plan report says where and why."""


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
    #: Calls that ``verify`` compared with the original attention and found within tolerance (a mismatch raises).
    verified: int = 0
    #: Key the lowered op counts its calls under (``graph_id:node``); empty when not rewritten.
    key: str = ""
    #: Id of the compiled graph the site is in (``g3``); ``PlanReport.merge`` fills it from its report.
    graph: str = ""
    #: How the plan was chosen: ``model`` (the cost model's lowest estimate), ``measured`` (timed on this device
    #: before first use), ``cached`` (a measurement from the tuning cache) or ``forced`` (``config.force_plan``);
    #: ``pending`` while a measured choice runs in the background (until the compiled graph's first call).
    choice: str = "model"
    #: Measured µs of the chosen plan (NaN when not measured); ``chosen.est_us`` is the prediction.
    measured_us: float = math.nan
    #: What ``attnopt.export_onnx`` wrote for the site (``onnx:Attention-24``, ``attnopt:decode_attention (function
    #: body)``); empty when not exported.
    exported_as: str = ""
    #: Seconds the measured choice took (NaN where none ran: the model's pick, a cached or forced plan).
    tune_s: float = math.nan
    #: How the measured choice ran where that is worth saying: in the background beside the inner compile, or why
    #: it fell back to the cost model's pick (``attnopt.tuning_defer``).
    tuning: str = ""
    #: The op's pending plan key while the choice runs in the background (not saved: it means nothing to another
    #: process).
    pending_key: str = field(default="", repr=False)

    @property
    def reason_untouched(self) -> str | None:
        if self.rewritten:
            return None
        if self.site.unsupported:
            return self.site.unsupported
        if self.chosen is None:
            return "; ".join(f"{r.kind}: {r.reason}" for r in self.rejected) or "no applicable plan"
        return "not lowered"

    @property
    def untouched_category(self) -> str | None:
        """A short class of ``reason_untouched`` for summaries (``prefill``, ``training``, ``no applicable plan``,
        ``kv_len < min_kv_len``, ...): the reason up to its first ``:`` or ``;``, without the numbers."""
        if self.rewritten:
            return None
        if not self.site.unsupported:
            return "no applicable plan" if self.chosen is None else "not lowered"
        head = re.split(r"[:;]", self.site.unsupported, maxsplit=1)[0].strip()
        head = re.sub(r"\s*\(\d+\)|=-?\d+(\.\d+)?", "", head).strip() or self.site.unsupported
        return head if len(head) <= 48 else head[:47] + "…"

    def to_dict(self) -> dict[str, Any]:
        return {
            "site": self.site.to_dict(),
            "chosen": self.chosen.to_dict() if self.chosen else None,
            "candidates": [c.to_dict() for c in self.candidates],
            "rejected": [dataclasses.asdict(r) for r in self.rejected],
            "rewritten": self.rewritten,
            "calls": self.calls,
            "verified": self.verified,
            "key": self.key,
            "graph": self.graph,
            "choice": self.choice,
            "measured_us": None if math.isnan(self.measured_us) else self.measured_us,
            "exported_as": self.exported_as,
            "tune_s": None if math.isnan(self.tune_s) else self.tune_s,
            "tuning": self.tuning,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SiteReport":
        _expect(data, dict, "a site report")
        return cls(
            site=AttentionSite.from_dict(_expect(data["site"], dict, "site")),
            chosen=plan_from_dict(data["chosen"]) if data.get("chosen") else None,
            candidates=[plan_from_dict(c) for c in _expect(data.get("candidates", []), list, "candidates")],
            rejected=[Rejection(**_expect(r, dict, "a rejection"))
                      for r in _expect(data.get("rejected", []), list, "rejected")],
            rewritten=bool(data.get("rewritten", False)),
            calls=int(data.get("calls", 0)),
            verified=int(data.get("verified", 0)),
            key=data.get("key", ""),
            graph=data.get("graph", ""),
            choice=data.get("choice", "model"),
            measured_us=math.nan if data.get("measured_us") is None else float(data["measured_us"]),
            exported_as=data.get("exported_as", ""),
            tune_s=math.nan if data.get("tune_s") is None else float(data["tune_s"]),
            tuning=data.get("tuning", ""),
        )


#: The headline of an empty report that no graph went into.
NOTHING_COMPILED = ("no graph compiled by attnopt yet: call the model (or function) returned by attnopt.optimize or "
                    "torch.compile(..., backend=\"attnopt\") first")


@dataclass
class PlanReport:
    """Everything attnopt decided for one compiled graph (or several, merged)."""

    sites: list[SiteReport] = field(default_factory=list)
    profile: str = ""
    graph: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    #: Calls of the optimized model or function that ran without any attnopt graph (dynamo fell back to eager).
    calls_without_attnopt: int = 0
    #: Graphs left whole as the original because a pass raised where no single site could be left alone instead
    #: (``on_error="fallback"``): one line each, naming the graph, the pass and the exception.
    errors: list[str] = field(default_factory=list)

    @property
    def rewritten(self) -> list[SiteReport]:
        return [s for s in self.sites if s.rewritten]

    @property
    def untouched(self) -> list[SiteReport]:
        return [s for s in self.sites if not s.rewritten]

    def to_dict(self) -> dict[str, Any]:
        return {"version": 1, "profile": self.profile, "graph": self.graph, "config": self.config,
                "sites": [s.to_dict() for s in self.sites], "calls_without_attnopt": self.calls_without_attnopt,
                **({"errors": list(self.errors)} if self.errors else {})}

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "PlanReport":
        if data.get("version") != 1:
            raise ValueError(f"plan report version {data.get('version')!r} is not supported (expected 1)")
        return cls(sites=[SiteReport.from_dict(s) for s in _expect(data.get("sites", []), list, "sites")],
                   profile=_expect(data.get("profile", ""), str, "profile"),
                   graph=data.get("graph", ""), config=data.get("config", {}),
                   calls_without_attnopt=int(data.get("calls_without_attnopt", 0)),
                   errors=[_expect(e, str, "an error") for e in _expect(data.get("errors", []), list, "errors")])

    @classmethod
    def from_json(cls, text: str) -> "PlanReport":
        return cls.from_dict(json.loads(text))

    @classmethod
    def merge(cls, reports: Iterable["PlanReport"]) -> "PlanReport":
        """One report over several graphs. Each site keeps the id of its graph (``SiteReport.graph``); the
        profile is the graphs' profile, or the distinct ones joined with ``", "``."""
        reports = list(reports)
        profiles = list(dict.fromkeys(r.profile for r in reports if r.profile))
        out = cls(profile=", ".join(profiles), graph="+".join(r.graph for r in reports if r.graph))
        for r in reports:
            for s in r.sites:
                if not s.graph:
                    s.graph = r.graph
            out.sites.extend(r.sites)
            out.errors.extend(r.errors)
            out.config = out.config or r.config
        return out

    def summary(self) -> str:
        text = f"{len(self.sites)} attention site(s), {len(self.rewritten)} rewritten, {len(self.untouched)} left alone"
        if self.calls_without_attnopt:
            text += f"; {self.calls_without_attnopt} call(s) ran without attnopt (dynamo fell back to eager)"
        return text + "".join(f"; left as the original: {e}" for e in self.errors)

    # ----------------------------------------------------------------------------------------- rendering
    def graph_of(self, s: SiteReport) -> str:
        """The graph id of a site: its own, else its op key's prefix, else this report's (when it is one graph)."""
        if s.graph:
            return s.graph
        if ":" in s.key:
            return s.key.split(":", 1)[0]
        return self.graph if "+" not in self.graph else ""

    def headline(self) -> str:
        """One line: sites and graphs, rewritten by plan kind, left alone by reason, profile, op calls. E.g.
        ``150 attention site(s) in 5 graph(s): 60 rewritten (60 split_kv), 90 left alone (90 prefill); profile
        h100-sxm``."""
        if not (self.sites or self.graph or self.profile or self.errors):
            return NOTHING_COMPILED
        graphs = {self.graph_of(s) for s in self.sites} - {""}
        kinds = Counter(s.chosen.kind if s.chosen else "?" for s in self.rewritten)
        why = Counter(s.untouched_category for s in self.untouched)

        def counts(c: Counter) -> str:
            return " (" + ", ".join(f"{n} {k}" for k, n in c.most_common()) + ")" if c else ""

        text = (f"{len(self.sites)} attention site(s)" + (f" in {len(graphs)} graph(s)" if graphs else "")
                + f": {len(self.rewritten)} rewritten{counts(kinds)}, {len(self.untouched)} left alone{counts(why)}"
                + f"; profile {self.profile or '?'}")
        calls = sum(s.calls for s in self.sites)
        text += f"; {calls} attnopt op call(s) so far" if calls else ""
        verified = [s for s in self.sites if s.verified]
        if verified:
            text += (f"; verify passed: {sum(s.verified for s in verified)} call(s) of {len(verified)} site(s) matched "
                     "the original attention")
        if self.calls_without_attnopt:
            text += f"; {self.calls_without_attnopt} call(s) ran WITHOUT attnopt (dynamo fell back to eager)"
        return text + "".join(f"; graph left as the original: {e}" for e in self.errors)

    def groups(self) -> list[list[SiteReport]]:
        """Sites that share graph, shapes, dtype, mask kind and outcome (the chosen plan, or why left alone), in
        the order of their first site."""
        out: dict[tuple, list[SiteReport]] = {}
        for s in self.sites:
            outcome = (("plan", s.chosen.runtime_key(), s.exported_as) if (s.rewritten and s.chosen)
                       else ("left alone", s.reason_untouched))
            key = (self.graph_of(s), s.site.shape_str(), s.site.dtype, s.site.mask_kind, s.site.variant_str(), outcome)
            out.setdefault(key, []).append(s)
        return list(out.values())

    def rich_table(self, title: str | None = None, all_sites: bool = False, max_alternatives: int = 3):
        """A ``rich.table.Table`` of the plans.

        By default one row per group of like sites (``groups()``), with a site count, a compact module path
        (``model.layers.{0..29}.self_attn``) and the best ``max_alternatives`` alternatives (the fastest
        candidate of each other kind, then the strategies that did not apply, with their reasons) and
        ``+N more``. ``all_sites=True``: one row per site with every candidate and rejection.
        """
        from rich.table import Table

        rows = [[s] for s in self.sites] if all_sites else self.groups()
        show_calls = any(s.calls for s in self.sites)
        table = Table(title=title, show_lines=True, title_justify="left")
        table.add_column("graph", no_wrap=True)
        table.add_column("site" if all_sites else "sites", justify="left" if all_sites else "right",
                         overflow="fold", no_wrap=not all_sites)
        # Caps on the descriptive columns leave the width to the alternatives; rich folds every cell when the
        # console is narrower than the table (no min_width: rich would then draw the table wider than the console).
        table.add_column("module", overflow="fold", max_width=32)
        table.add_column("shape", overflow="fold", max_width=24)
        table.add_column("mask", overflow="fold", max_width=12)
        table.add_column("plan", overflow="fold", max_width=24)
        table.add_column("est µs", justify="right", no_wrap=True)
        show_measured = any(not math.isnan(s.measured_us) for s in self.sites)
        if show_measured:
            table.add_column("measured µs", justify="right", no_wrap=True)
        if show_calls:
            table.add_column("calls", justify="right", no_wrap=True)
        table.add_column("alternatives (fastest first) / why left alone" if all_sites else "alternatives / why left alone",
                         overflow="fold")
        for group in rows:
            first = group[0]
            site = first.site
            done = first.rewritten and first.chosen is not None
            plan = _plan_cell(first.chosen) if done else "[yellow]left alone[/yellow]"
            if done and first.exported_as:
                plan += f"\n[cyan]exported as {_esc(first.exported_as)}[/cyan]"
            est = f"{first.chosen.est_us:.1f}" if done and not math.isnan(first.chosen.est_us) else "-"
            lines = _alternatives(group, first.chosen if done else None, None if all_sites else max_alternatives)
            if not first.rewritten:
                why = first.reason_untouched if (first.site.unsupported or first.chosen is not None) else "no applicable plan"
                lines.insert(0, f"[yellow]why: {_esc(why)}[/yellow]")
            cells = [self.graph_of(first) or "?",
                     site.node if all_sites else str(len(group)),
                     _esc(site.module_path or TOP_LEVEL) if all_sites else _esc(compact_paths([s.site.module_path for s in group])),
                     f"{site.shape_str()}\n[dim]{site.dtype}[/dim]",
                     site.mask_kind + (f"\n{site.variant_str()}" if site.variant_str() else ""), plan, est]
            if show_measured:
                measured = done and not math.isnan(first.measured_us)
                cells.append(f"{first.measured_us:.1f}\n[dim]{first.choice}[/dim]" if measured else "-")
            if show_calls:
                verified = sum(s.verified for s in group)
                cells.append((str(sum(s.calls for s in group)) if first.rewritten else "-")
                             + (f"\n[green]{verified} verified[/green]" if verified else ""))
            cells.append("\n".join(lines) or "-")
            table.add_row(*cells)
        return table

    def render(self, console=None, all_sites: bool = False) -> None:
        """Print the headline and the table (``rich_table``) on ``console`` (a ``rich.console.Console``)."""
        from rich.console import Console
        from rich.text import Text

        console = console or Console()
        console.print(Text(self.headline(), style="bold"))
        if self.sites:
            console.print(self.rich_table(all_sites=all_sites))

    def format_table(self, width: int = 160, all_sites: bool = False) -> str:
        """``render`` as plain text ``width`` columns wide."""
        from rich.console import Console

        console = Console(width=width, force_terminal=False, color_system=None)
        with console.capture() as cap:
            self.render(console, all_sites=all_sites)
        return cap.get()
