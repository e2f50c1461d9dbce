"""The strategy contract and its registry.

A strategy owns one plan kind. The planner calls ``check`` (None = applicable, else a reason the user reads
in ``attnopt plans``), ``candidates`` and ``estimate_us``; the runtime op calls ``prepare`` once per
(plan, device, shape family) and ``run`` on every call. ``prepare`` may allocate and synchronise; ``run``
does neither, so it is safe inside a captured CUDA graph.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Generic, Iterable, TypeVar

from torch import Tensor

from attnopt.hardware import HardwareProfile
from attnopt.plan import Plan
from attnopt.site import AttentionSite

P = TypeVar("P", bound=Plan)


@dataclass(frozen=True)
class PlanContext:
    """What the planner knows beyond the site and the hardware."""

    #: Number of ranks the KV cache is sharded over (1 = single device).
    world_size: int = 1
    #: Topology name or object for multi-GPU costs (``None`` = not distributed).
    topology: Any = None
    #: Device type the graph runs on ("cuda", "cpu", ...); strategies needing Triton check it.
    device_type: str = "cpu"
    #: Whether Triton kernels can run here (compiled on CUDA, or the interpreter on CPU).
    triton_available: bool = False
    #: Free-form extras (SAAP index path, ...).
    extras: dict[str, Any] = field(default_factory=dict)


class Strategy(Generic[P]):
    """Base class of every plan kind's implementation. Subclass and decorate with ``@register_strategy``."""

    plan_type: type[P]
    #: Whether the plan needs a process group (tree, ring). Single-device sites skip these.
    distributed: bool = False
    #: The attention variants ``run``/``run_states`` take as keywords (see ``VARIANTS``): "window" accepts
    #: ``key_start`` (B,) (the first key of each row; any strategy without it is still exact, as the mask it
    #: applies hides those keys), "softcap" accepts ``softcap`` and "alibi" ``alibi_slopes`` (Hq,) (a site with a
    #: cap or ALiBi slopes is refused by the others).
    variants: frozenset[str] = frozenset()

    def check(self, site: AttentionSite, hw: HardwareProfile, ctx: PlanContext) -> str | None:
        raise NotImplementedError

    def candidates(self, site: AttentionSite, hw: HardwareProfile, ctx: PlanContext) -> Iterable[P]:
        raise NotImplementedError

    def estimate_us(self, plan: P, site: AttentionSite, hw: HardwareProfile, ctx: PlanContext) -> float:
        raise NotImplementedError

    def prepare(self, plan: P, q: Tensor, k: Tensor, v: Tensor) -> Any:
        """Host side, once per plan and shape family: allocate workspaces. Returns the state ``run`` takes."""
        return None

    def run(self, state: Any, plan: P, q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None,
            valid_len: Tensor | None, scale: float, is_causal: bool) -> Tensor:
        """Compute attention. Shapes: q (B, Hq, L, D), k (B, Hkv, N, D), v (B, Hkv, N, Dv) -> (B, Hq, L, Dv)."""
        raise NotImplementedError

    def run_states(self, state: Any, plan: P, q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None,
                   valid_len: Tensor | None, scale: float, is_causal: bool,
                   split_lse: bool = False) -> tuple[Tensor, ...]:
        """Like ``run`` but returns the softmax state (o fp32 (B, Hq, L, Dv), lse fp32 (B, Hq, L)).

        ``split_lse`` (the single-device kinds, which the distributed decode runs as its local attention): return
        (o, m, log l) instead, the row max and ``log l`` apart (``reference.attention_states``), so that a merge
        across ranks weighs a row that ``finfo.min`` hides by its key counts."""
        raise NotImplementedError(f"{type(self).__name__} does not return softmax states")


#: Attention variants beyond plain softmax attention that a strategy may implement (``Strategy.variants``).
VARIANTS = ("window", "softcap", "alibi")


def variant_reason(strategy: Strategy, site: AttentionSite) -> str | None:
    """Why ``strategy`` cannot run ``site``'s variant (a softcapped site needs the "softcap" variant), or None."""
    if site.softcap is not None and "softcap" not in strategy.variants:
        return (f"logit softcapping (cap={site.softcap:g}): this plan kind does not apply the cap; the split-KV and "
                "stream-K kernels do")
    if site.alibi and "alibi" not in strategy.variants:
        return "ALiBi (per-head slope times key position): this plan kind does not add it; the split-KV and stream-K kernels do"
    return None


def variant_kwargs(strategy: Strategy, key_start: Tensor | None = None, softcap: float = 0.0,
                   alibi_slopes: Tensor | None = None) -> dict[str, Any]:
    """The variant keywords ``strategy.run`` takes for this call: ``key_start`` where it reads windows (else dropped:
    the mask hides those keys), ``softcap`` where it caps (else ``ValueError``: the planner refuses such plans)."""
    kw: dict[str, Any] = {}
    if key_start is not None and "window" in strategy.variants:
        kw["key_start"] = key_start
    if softcap:
        if "softcap" not in strategy.variants:
            raise ValueError(f"{type(strategy).__name__} does not apply logit softcapping (softcap={softcap}); plan kinds "
                             "that do: " + ", ".join(sorted(k for k, s in STRATEGIES.items() if "softcap" in s.variants)))
        kw["softcap"] = softcap
    if alibi_slopes is not None:
        if "alibi" not in strategy.variants:
            raise ValueError(f"{type(strategy).__name__} does not add ALiBi slopes; plan kinds that do: "
                             + ", ".join(sorted(k for k, s in STRATEGIES.items() if "alibi" in s.variants)))
        kw["alibi_slopes"] = alibi_slopes
    return kw


STRATEGIES: dict[str, Strategy] = {}


def register_strategy(plan_type: type[P]):
    """Class decorator: register one instance of the strategy under ``plan_type.kind``."""

    def deco(cls: type[Strategy[P]]) -> type[Strategy[P]]:
        kind = plan_type.kind
        if kind in STRATEGIES:
            raise ValueError(f"a strategy for plan kind {kind!r} is already registered ({type(STRATEGIES[kind]).__name__})")
        cls.plan_type = plan_type
        STRATEGIES[kind] = cls()
        return cls

    return deco


def get_strategy(kind: str) -> Strategy:
    try:
        return STRATEGIES[kind]
    except KeyError:
        raise ValueError(f"no strategy registered for plan kind {kind!r}; registered: {', '.join(sorted(STRATEGIES))}") from None
