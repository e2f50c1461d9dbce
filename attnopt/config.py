"""The one frozen, versioned configuration object of attnopt."""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, fields
from typing import Any, Mapping

CONFIG_VERSION = 1

INNER_BACKENDS = ("inductor", "eager", "aot_eager", "cudagraphs")
PLAN_LOG_ENV = "ATTNOPT_PLAN_LOG"


@dataclass(frozen=True)
class OptimizeConfig:
    """Options of ``attnopt.optimize`` and of the ``attnopt`` dynamo backend.

    Every field round-trips through JSON (``to_json`` / ``from_json``). Unknown keys are an error.
    """

    #: Schema version of this config; bumped when a field changes meaning.
    version: int = CONFIG_VERSION
    #: Backend that compiles the graph after attnopt's rewrite: one of ``INNER_BACKENDS``.
    inner_backend: str = "inductor"
    #: Plan kinds the planner may choose from (``None`` = every registered kind).
    strategies: tuple[str, ...] | None = None
    #: Force this plan kind at every supported site (it must pass its checker).
    force_plan: str | None = None
    #: Largest query length that still counts as decode (issue rule: static and <= 16).
    max_decode_q_len: int = 16
    #: Smallest *static* KV length that is rewritten; symbolic lengths are always rewritten.
    min_kv_len: int = 1
    #: Run the original attention beside the rewritten op on the first calls and compare.
    verify: bool = False
    #: How many calls per site ``verify`` checks.
    verify_calls: int = 2
    #: Absolute tolerance override for ``verify`` (``None`` = per-dtype default).
    verify_atol: float | None = None
    #: Path of the JSON plan log (``None`` = the ``ATTNOPT_PLAN_LOG`` environment variable, if set).
    plan_log: str | None = None
    #: Hardware profile name for the cost model (``None`` = detect, or the calibrated cache).
    hardware: str | None = None
    #: Topology name for multi-GPU planning (``None`` = detect).
    topology: str | None = None
    #: Let dynamo mark the KV length dynamic from the first call (avoids a recompile on step 2).
    dynamic: bool | None = None
    #: Leave these sites alone (node names or module paths).
    skip_sites: tuple[str, ...] = ()
    #: ``(module path, window)`` of attention modules with a sliding window; their sites are left alone with
    #: that reason. ``attnopt.optimize`` fills it from the model's modules; a dict ``{path: window}`` is accepted.
    sliding_windows: tuple[tuple[str, int], ...] = ()
    #: SAAP index file (``attnopt saap train``): opts in to sparse decode at the layers it covers (``None`` = off).
    saap: str | None = None
    #: SAAP: clusters attended per KV head (the paper's l = 32), the sink keys and the recent window.
    saap_probes: int = 32
    saap_sink: int = 1
    saap_window: int = 2047

    def __post_init__(self) -> None:
        if self.saap is not None and not os.path.isfile(self.saap):
            raise ValueError(f"saap={self.saap!r}: no such index file (train one with 'attnopt saap train')")
        for name, low in (("saap_probes", 1), ("saap_sink", 0), ("saap_window", 0)):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < low:
                raise ValueError(f"{name} must be an int >= {low}, got {getattr(self, name)!r}")
        if self.version != CONFIG_VERSION:
            raise ValueError(f"OptimizeConfig version {self.version} is not supported; this attnopt reads version {CONFIG_VERSION}")
        if self.inner_backend not in INNER_BACKENDS:
            raise ValueError(f"unknown inner_backend {self.inner_backend!r}; valid choices: {', '.join(INNER_BACKENDS)}")
        if not 1 <= self.max_decode_q_len <= 16:
            raise ValueError(f"max_decode_q_len must be in 1..16, got {self.max_decode_q_len}")
        if self.verify_calls < 1:
            raise ValueError(f"verify_calls must be >= 1, got {self.verify_calls}")
        for name in ("strategies", "skip_sites"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, tuple):
                object.__setattr__(self, name, tuple(value))
        windows = self.sliding_windows.items() if isinstance(self.sliding_windows, Mapping) else self.sliding_windows
        try:
            pairs = tuple((str(path), int(window)) for path, window in windows)
        except (TypeError, ValueError):
            raise ValueError(f"sliding_windows must be (module path, window) pairs, got {self.sliding_windows!r}") from None
        object.__setattr__(self, "sliding_windows", pairs)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None = None, **more: Any) -> "OptimizeConfig":
        """Build a config from a dict and keyword options; unknown keys raise ``ValueError``."""
        merged = {**(options or {}), **more}
        unknown = sorted(set(merged) - set(cls.field_names()))
        if unknown:
            raise ValueError(
                f"unknown attnopt option(s) {', '.join(map(repr, unknown))}; valid options: {', '.join(cls.field_names())}"
            )
        return cls(**merged)

    def replace(self, **changes: Any) -> "OptimizeConfig":
        return self.from_options(dataclasses.asdict(self), **changes)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        for name in ("strategies", "skip_sites"):
            if data[name] is not None:
                data[name] = list(data[name])
        data["sliding_windows"] = [list(pair) for pair in data["sliding_windows"]]
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "OptimizeConfig":
        return cls.from_options(json.loads(text))

    def resolved_plan_log(self) -> str | None:
        return self.plan_log or os.environ.get(PLAN_LOG_ENV) or None
