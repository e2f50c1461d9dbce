"""The one frozen, versioned configuration object of attnopt."""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, fields
from typing import Any, Mapping

from . import checks

CONFIG_VERSION = 1

INNER_BACKENDS = ("inductor", "eager", "aot_eager", "cudagraphs")
ON_ERROR = ("fallback", "raise")
STRICT_ENV = "ATTNOPT_STRICT"
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
    #: SAAP: clusters attended per KV head, the sink keys and the recent window. None: the index's recommended
    #: operating point (``SaapIndex.decode_defaults``: about 10 % total selectivity at the context it was trained
    #: at, for an index of ``attnopt saap train``; the paper's l = 32, sink 1, window 2047 for an older index).
    saap_probes: int | None = None
    saap_sink: int | None = None
    saap_window: int | None = None
    #: With ``mode="reduce-overhead"``, a Hugging Face model's decode steps over a static cache are each recorded as
    #: one CUDA graph by attnopt (``attnopt.step_graphs``: about 1 ms less host time per token than inductor's
    #: CUDA-graph trees on an H100); False keeps inductor's trees.
    step_graphs: bool = True
    #: What an unexpected exception inside attnopt's passes (detection, planning, lowering: a bug of attnopt, not
    #: of the input) does: "fallback" leaves that site (or, where the graph was already changed, that graph) as the
    #: original, runs it through the inner backend, warns once (``PassErrorWarning``) and records the reason in the
    #: plan report; "raise" fails the compile (developers, CI; ``$ATTNOPT_STRICT=1`` forces it). Errors the user must
    #: see (config values, a SAAP index that does not fit, a process group's shards) raise in both.
    on_error: str = "fallback"

    def __post_init__(self) -> None:
        missing = [f.name for f in fields(self) if f.name not in FIELD_CHECKS]
        if missing:  # a new field needs its one line in FIELD_CHECKS
            raise TypeError(f"OptimizeConfig field(s) {missing} have no check in FIELD_CHECKS")
        for f in fields(self):
            object.__setattr__(self, f.name, FIELD_CHECKS[f.name](f.name, getattr(self, f.name)))
        if self.saap is None and "saap" in (self.force_plan, *(self.strategies or ())):
            raise ValueError("plan kind 'saap' needs an index: pass saap='index.safetensors' (attnopt saap train)")
        if self.strategies == ():
            raise ValueError(f"strategies names no plan kind; name at least one of {', '.join(checks.plan_kinds())}, "
                             "or leave it None for every kind")
        if self.force_plan is not None and self.strategies is not None and self.force_plan not in self.strategies:
            raise ValueError(f"force_plan={self.force_plan!r} is not among strategies={self.strategies!r}: the planner "
                             "could never pick it; add it to strategies or leave one of them unset")
        unused = [name for name in ("saap_probes", "saap_sink", "saap_window") if getattr(self, name) is not None]
        if self.saap is None and unused:
            raise ValueError(f"{', '.join(unused)} only apply with a SAAP index: pass saap='index.safetensors' "
                             "(attnopt saap train), or leave them unset")

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None = None, **more: Any) -> "OptimizeConfig":
        """Build a config from a dict and keyword options; unknown keys raise ``ValueError``."""
        if options is not None and not isinstance(options, Mapping):
            raise TypeError(f"attnopt options must be an OptimizeConfig or a dict, got {type(options).__name__} {options!r}")
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

    def strict(self) -> bool:
        """Whether a pass's unexpected exception fails the compile: ``on_error="raise"``, or ``$ATTNOPT_STRICT`` set to
        1 (the test suite sets it; "0" or unset leaves ``on_error`` in charge; any other value is an error)."""
        env = os.environ.get(STRICT_ENV, "")
        if env not in ("", "0", "1"):
            raise ValueError(f"${STRICT_ENV}={env!r}: valid values are 1 (a pass's exception fails the compile) and 0 "
                             "or unset (config.on_error decides)")
        return self.on_error == "raise" or env == "1"

    def resolved_plan_log(self) -> str | None:
        """``plan_log``, else ``$ATTNOPT_PLAN_LOG`` (checked like ``plan_log``, naming the variable), else None."""
        if self.plan_log:
            return self.plan_log
        env = os.environ.get(PLAN_LOG_ENV)
        return checks.writable_file(f"${PLAN_LOG_ENV}", env) if env else None


def _check_saap_index(name: str, value: Any) -> str:
    """A SAAP index file that exists (its contents are checked against the model when it is loaded)."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise TypeError(f"{name} must be the path of a SAAP index file (str), got {type(value).__name__} {value!r}")
    if not os.path.isfile(value):
        raise ValueError(f"{name}={value!r}: no such index file (train one with 'attnopt saap train')")
    return value


def _check_version(value: Any) -> int:
    if type(value) is not int or value != CONFIG_VERSION:
        raise ValueError(f"OptimizeConfig version {value!r} is not supported; this attnopt reads version {CONFIG_VERSION}")
    return value


#: One check per field: ``check(name, value) -> normalised value``, raising ``TypeError`` (wrong type) or
#: ``ValueError`` (wrong value) with a message that names the field and the valid choices.
FIELD_CHECKS: dict[str, checks.Check] = {
    "version": lambda name, value: _check_version(value),
    "inner_backend": checks.one_of(INNER_BACKENDS),
    "strategies": checks.optional(checks.names(checks.plan_kinds)),
    "force_plan": checks.optional(checks.name_in(checks.plan_kinds)),
    "max_decode_q_len": checks.integer(1, 16),
    "min_kv_len": checks.integer(0),
    "verify": checks.boolean,
    "verify_calls": checks.integer(1),
    "verify_atol": checks.optional(checks.real(0.0)),
    "plan_log": checks.optional(checks.writable_file),
    "hardware": checks.optional(checks.name_in(checks.hardware_names, paths=".json")),
    "topology": checks.optional(checks.name_in(checks.topology_names, paths=".json")),
    "dynamic": checks.optional(checks.boolean),
    "skip_sites": checks.names(),
    "sliding_windows": checks.sliding_windows,
    "saap": checks.optional(_check_saap_index),
    "saap_probes": checks.optional(checks.integer(1)),
    "saap_sink": checks.optional(checks.integer(0)),
    "saap_window": checks.optional(checks.integer(0)),
    "step_graphs": checks.boolean,
    "on_error": checks.one_of(ON_ERROR),
}

#: ``mode`` of ``attnopt.optimize`` and ``torch.compile(..., backend="attnopt", mode=...)``.
MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def check_process_group(process_group: Any) -> None:
    """``process_group`` is None or a ``torch.distributed.ProcessGroup``: anything else (a backend name, a rank list,
    attnopt's own ``DistGroup``, a ``ProcessGroupGloo`` backend object) is a ``TypeError`` now, not at the first
    compile inside dynamo's error."""
    if process_group is None:
        return
    import torch.distributed as dist

    if not dist.is_available():
        raise ValueError("process_group= needs torch.distributed, which this torch build lacks; pass "
                         "process_group=None")
    if isinstance(process_group, dist.ProcessGroup):
        return
    hint = ""
    if hasattr(process_group, "pg") and isinstance(getattr(process_group, "pg"), dist.ProcessGroup):
        hint = " (an attnopt DistGroup: pass its .pg)"
    elif isinstance(process_group, str):
        hint = " (a backend name: make the group with torch.distributed.init_process_group / new_group)"
    raise TypeError(f"process_group must be a torch.distributed.ProcessGroup (torch.distributed.group.WORLD, or one "
                    f"from torch.distributed.new_group) or None, got {type(process_group).__name__} "
                    f"{process_group!r}{hint}")


def check_call(config: OptimizeConfig, process_group: Any = None, mode: Any = None) -> None:
    """What the fields alone cannot say, checked when a backend is made (``attnopt.optimize``, the string
    backend): ``mode`` is one of ``MODES``; ``$ATTNOPT_STRICT`` is 0, 1 or unset; ``topology`` needs a process group; ``force_plan`` and ``strategies``
    name kinds that a registered strategy implements (``runtime`` is imported here, at call time); a ``hardware``
    profile file parses, and a ``saap`` index file is safetensors (so that a corrupt file is named here, not at the
    first compile inside dynamo's error)."""
    checks.one_of(MODES)("mode", mode)
    check_process_group(process_group)
    config.strict()  # a bad $ATTNOPT_STRICT, named now rather than at the first compile
    if config.hardware is not None and config.hardware.endswith(".json"):
        from attnopt.hardware import resolve_profile

        resolve_profile(config.hardware)
    if config.saap is not None:
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(config.saap, framework="pt") as index:
                index.metadata()
        except SafetensorError as exc:
            raise ValueError(f"saap={config.saap!r} is not a readable SAAP index (safetensors) file: {exc}") from None
    if config.topology is not None and process_group is None:
        raise ValueError(f"topology={config.topology!r} is only used to plan over a process group; pass "
                         "process_group= to attnopt.optimize, or leave topology unset")
    if config.force_plan is not None or config.strategies:
        from attnopt.passes.plan import check_strategies

        check_strategies(config)
