"""``PassContext``: what the passes share while they run over one graph."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from attnopt.config import OptimizeConfig
from attnopt.hardware import HardwareProfile
from attnopt.report import PlanReport

_graph_ids = itertools.count()


@dataclass
class PassContext:
    config: OptimizeConfig
    hardware: HardwareProfile
    plan_context: Any  # runtime.strategies.PlanContext
    example_inputs: list[Any] = field(default_factory=list)
    #: Filled by ``detect``: one ``passes.patterns.AttentionMatch`` per attention site, in graph order.
    matches: list[Any] = field(default_factory=list)
    #: Filled by ``plan``; ``lower`` marks rewritten sites.
    report: PlanReport = field(default_factory=PlanReport)
    #: Unique per compiled graph, so op call counts of two graphs never mix.
    graph_id: str = field(default_factory=lambda: f"g{next(_graph_ids)}")
    #: Rewrites per pattern name, counted by ``lower`` (tests assert on these).
    rewrite_counts: dict[str, int] = field(default_factory=dict)
    #: ``lower``'s shared ``valid_len_from_mask`` nodes, per (mask node, batch size).
    valid_lens: dict[tuple[Any, ...], Any] = field(default_factory=dict)
    #: ``lower``'s key range of each window site, by site key: "band" (read off the mask's graph: no scan) or
    #: "scan: <why the band was not proven>" (``key_range_from_mask``).
    window_ranges: dict[str, str] = field(default_factory=dict)
    #: The graph as it was before ``lower`` (``guard.snapshot``; None in strict mode or without sites): restored when
    #: lowering, or the inner backend's compile of the rewritten graph, fails (``config.on_error="fallback"``).
    original_graph: Any = None
    #: (stage, exception text, site node) of each site left alone by an exception (``guard.site_failed``), warned
    #: about once per (stage, exception) when the passes end (``guard.warn_site_errors``).
    site_errors: list[tuple[str, str, str]] = field(default_factory=list)
