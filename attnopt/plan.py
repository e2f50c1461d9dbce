"""Plan types and the plan-kind registry (the report of the plans chosen is ``attnopt.report``).

A plan is a frozen dataclass that says *how* one attention site runs. It round-trips through JSON as
``{"kind": ..., "version": ..., "data": {...}}``. New kinds register with ``@register_plan_kind``.
"""
from __future__ import annotations

import bisect
import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar


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


def _expect(value: Any, kind: type, what: str) -> Any:
    """``value`` if it is a ``kind``, else ``TypeError`` in JSON's words (``sites must be an array, got number 5``)."""
    if not isinstance(value, kind):
        names = {dict: "an object", list: "an array", str: "a string"}
        raise TypeError(f"{what} must be {names.get(kind, kind.__name__)}, got {type(value).__name__} {value!r}")
    return value


def plan_from_dict(data: dict[str, Any]) -> Plan:
    _expect(data, dict, "a plan")
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
#: SDPA backends a dense plan can name (``auto``: SDPA's own choice).
DENSE_BACKENDS = ("auto", "flash", "cudnn", "efficient", "math")

@register_plan_kind
@dataclass(frozen=True)
class DensePlan(Plan):
    """Leave the attention as one SDPA call over the un-expanded K/V (``enable_gqa``).

    ``backend``: ``auto`` lets SDPA pick; ``flash``, ``cudnn``, ``efficient`` and ``math`` call that backend
    explicitly (``torch.nn.attention.sdpa_kernel``). Plan JSON written before the field existed loads as ``auto``.
    """

    kind: ClassVar[str] = "dense"
    reason: str = ""
    backend: str = "auto"

    def __post_init__(self) -> None:
        if self.backend not in DENSE_BACKENDS:
            raise ValueError(f"unknown SDPA backend {self.backend!r}; valid: {', '.join(DENSE_BACKENDS)}")


@register_plan_kind
@dataclass(frozen=True)
class SplitKVPlan(Plan):
    """FlashDecoding: ``num_splits`` programs per (batch, KV head), each over an equal share of the valid
    keys in ``block_n`` tiles, then a merge of (o, lse).

    The share of each split follows the valid length at run time, so a captured CUDA graph stays correct as the
    cache grows. ``tiles_per_split`` > 0 also sizes the grid by the cache's length (``splits_at``), a host integer
    (``k.shape[2]``), so it costs no sync: a plan tuned at one length of a growing cache keeps its tiles per split
    at the others rather than its split count (which a length of a few more tiles leaves with splits of two tiles
    beside splits of one).
    """

    kind: ClassVar[str] = "split_kv"
    num_splits: int = 16
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    #: The last split to finish a tile merges it in the same launch (arrival counter), instead of a second launch.
    fused_merge: bool = False
    #: K/V tiles through the copy engine (TMA tensor descriptors) where the GPU and the strides allow it.
    tma: bool = False
    #: The head dim in two power-of-two chunks where the kernels cut it (D=80/96 as 64 + 32, not padded to 128: less
    #: shared memory, more programs per SM; ``runtime/kernels/common.py`` head_dim_split); ignored elsewhere.
    head_chunks: bool = False
    #: 0: ``num_splits`` programs per (batch row, KV head) at every length. m > 0: ``splits_at(n)`` of them, so that
    #: the grid follows the cache's length with at most ``num_splits`` (the workspace's size).
    tiles_per_split: int = 0
    #: Stage 1 launched as a programmatic dependent of the kernel before it (it waits for that grid before reading
    #: anything), and the merge letting the next kernel launch early: back-to-back decode steps overlap each launch
    #: with the tail of the kernel before (``split_kv_decode``'s ``chain``). Ignored where PDL is unsupported.
    chain: bool = False
    #: Programs per output row of the merge launch (a power of two); 0: as many as take every partial in one step
    #: (``merge_states``' ``dv_split="auto"``).
    merge_dv_split: int = 1
    #: The tile products as ``K @ Q^T`` and ``V^T @ P^T`` (swap-AB: the keys and head dim in wgmma's M, the query rows
    #: in N) where the packed query tile has fewer than 64 rows (``runtime/kernels/tile_ops.py``); ignored elsewhere.
    swap_ab: bool = False
    #: > 0: each program also prefetches the K/V rows this many tiles ahead into L2 (compiled Hopper kernels over
    #: contiguous rows; ignored elsewhere).
    l2_prefetch: int = 0

    def __post_init__(self) -> None:
        if self.l2_prefetch < 0:
            raise ValueError(f"split_kv: l2_prefetch must be >= 0 (tiles ahead; 0: none); got {self.l2_prefetch}")
        if self.tiles_per_split < 0:
            raise ValueError(f"split_kv: tiles_per_split must be >= 0 (0: a fixed split count); got "
                             f"{self.tiles_per_split}")
        if self.merge_dv_split < 0 or self.merge_dv_split & (self.merge_dv_split - 1):
            raise ValueError(f"split_kv: merge_dv_split must be 0 (auto) or a power of two; got "
                             f"{self.merge_dv_split}")

    def splits_at(self, n_keys: int) -> int:
        """Programs per (batch row, KV head) over a cache of ``n_keys`` keys: ``num_splits``, or with
        ``tiles_per_split`` m > 0, one per m of its ``block_n``-key tiles, within [2, ``num_splits``] (never 1 where
        ``num_splits`` is not: one split skips the merge and compiles another kernel)."""
        if self.tiles_per_split <= 0 or self.num_splits <= 1:
            return self.num_splits
        tiles = -(-max(int(n_keys), 1) // max(self.block_n, 1))
        return max(2, min(self.num_splits, tiles // self.tiles_per_split))


@register_plan_kind
@dataclass(frozen=True)
class StreamKPlan(Plan):
    """LeanAttention: a persistent grid of ``grid`` programs cutting (batch x KV head x KV tile) into
    equal contiguous shares; the last program to finish an output tile merges it (or, with ``merge_launch``, a
    second launch)."""

    kind: ClassVar[str] = "stream_k"
    grid: int = 132
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    #: K/V tiles through the copy engine (TMA tensor descriptors) where the GPU and the strides allow it.
    tma: bool = False
    #: The tiles split across programs are merged by a second launch (every tile at once) instead of by the last
    #: program to arrive, after its own share (``stream_k_decode``'s ``merge_launch``).
    merge_launch: bool = False


@register_plan_kind
@dataclass(frozen=True)
class TreePlan(Plan):
    """Tree Attention: local attention over the sequence shard, one collective of softmax states, local merge.

    ``collective``: ``all_gather`` of packed (o, m, log l); ``all_reduce`` of the max then of [num | den];
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
    probes: int = 32
    sink: int = 1
    window: int = 2047
    #: The model layer of the site (the index holds one set of clusters per layer).
    layer: int = -1
    #: Kernel programs per (batch row, KV head) and attended keys per tile.
    num_splits: int = 8
    block_n: int = 64
    #: The scoring launch also selects (its last program per head to arrive, by an arrival counter): one launch fewer.
    #: The planner turns it on for centroid scoring (H100, 2cefde7, 5 %: 42.9 µs against 44.3 apart at 128k, 73.1
    #: against 78.9 at 512k) and leaves it off for the query MLP (its fused launch: 76-78 µs against 44.3, dbfa5c3).
    fused_select: bool = False
    #: The attention launch also merges (the last split of each group of about sqrt(S) splits merges its group, the
    #: last group the tile: ``runtime.kernels.saap_merge``): one launch fewer. Off: on the H100 (8db9edf, llama3-8b
    #: 128k, 5 %) the attention launch took 29.5 µs with it against 19.1 + a 3.4 µs merge launch without (every
    #: program's release fence and arrival atomic, then two merges, sit on the launch's tail).
    fused_merge: bool = False
    #: Chain the launches by programmatic dependent launch. Off here; the planner turns it on for centroid scoring
    #: with its selection fused (``runtime.strategies.saap.PDL_CENTROID_SCORING``; H100, llama3-8b, 5 %: 40.63 µs
    #: against 41.58 unchained at 128k (8cb7926), 78.2 against 80.1 at 512k (94ca2cf)). Elsewhere it cost 3-12 µs a
    #: call at 74b717f and dbfa5c3 (co-resident waiting programs push attention programs into a second wave).
    pdl: bool = False
    #: The sink-and-window splits as a launch of their own on a side stream, beside the scoring and the selection (in
    #: a captured graph: a parallel branch, joined before the merge); the attention launch after the selection then
    #: holds only the cluster splits. Off: on the H100 (2cefde7, 128k, 5 %, 64 splits) it cost 7.3 µs a call
    #: (51.6 against 44.3; fused selection 47.8 against 42.9).
    window_stream: bool = False
    #: With ``window_stream``: fork after the scoring launch, not before it, so that the window's reads overlap only
    #: the selection (one SM a head, latency-bound) and not the scoring's own reads.
    window_after_scoring: bool = False
    #: Warps of the selection (its own launch, or the fused scoring launch); 0: the kernel's rule (16 at 2048
    #: clusters). A fused centroid launch below 16 warps takes 64 clusters a program (two an SM) instead of 128: on the
    #: H100 (cc11447, llama3-8b, 5 %) its scoring-and-selection took 21.3-22.5 µs at 8 warps against 18.6-19.1 at 16.
    select_warps: int = 0
    #: Software-pipeline stages of the attention launch's K/V tiles (Triton ``num_stages``): 2 keeps one tile's
    #: copy in flight, issued after the tile before is folded; 3 keeps two in flight (twice the K/V buffers in shared
    #: memory). 2: on the H100 (8db9edf, llama3-8b 128k, 5 %) 3 took 24.1 µs at 32 keys a tile and 20.5 at 16,
    #: against 19.1 and 19.5 at 2.
    num_stages: int = 2
    #: Attention splits that share the sink and the window (the others share the chosen clusters); 0: in proportion
    #: to the keys each part holds (``kernels.saap.window_split_count``). The rule stays: on the H100 (94ca2cf,
    #: llama3-8b, 5 %, 64 splits) 8 and 24 of them took 44.1 and 45.2 µs at 128k against 43.3-44 for the rule's 16
    #: (79.0 and 83.9 µs at 512k against 80.1).
    window_splits: int = 0

    def runtime_note(self) -> str:
        """The selectivity measured at run time (attended keys over visible keys), once the op has run."""
        import sys

        registry = sys.modules.get("attnopt.runtime.saap.registry")  # loaded only where the op ran
        measured = registry.measured_selectivity(self.runtime_key()) if registry is not None else None
        return f"selectivity {measured[0]:.1%} over {measured[1]} calls" if measured else ""


@register_plan_kind
@dataclass(frozen=True)
class CascadePlan(Plan):
    """Shared-prefix cascade: K/V are one prefix shared by every batch row plus a suffix per row. The prefix is
    attended once for all rows (their queries stacked into one tile per KV head), each row's suffix on its own,
    and the softmax states are merged exactly (row max and ``log l`` kept apart).

    ``prefix_splits`` / ``suffix_splits``: split-KV programs per KV head over the prefix, and per (row, KV head)
    over the suffixes (at least 2 each: the partial states go to one workspace that a single merge reads).
    """

    kind: ClassVar[str] = "cascade"
    prefix_splits: int = 64
    suffix_splits: int = 2
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    #: K/V tiles through the copy engine (TMA tensor descriptors) where the GPU and the strides allow it.
    tma: bool = False

    def __post_init__(self) -> None:
        if self.prefix_splits < 2 or self.suffix_splits < 2:
            raise ValueError(f"a cascade plan needs >= 2 prefix and suffix splits (its partial states are merged "
                             f"together), got {self.prefix_splits} and {self.suffix_splits}")


@register_plan_kind
@dataclass(frozen=True)
class BucketedPlan(Plan):
    """One plan per KV-length bucket, for a site whose KV length is symbolic (a growing cache).

    ``bounds`` are the buckets' upper edges, ascending; ``plans[i]`` (a plan's ``runtime_key()`` JSON) runs when
    ``bounds[i-1] < N <= bounds[i]``, and the last plan for every longer N. The op picks by ``k.shape[2]``, a
    host integer, so the choice never syncs and holds inside a captured CUDA graph.
    """

    kind: ClassVar[str] = "bucketed"
    bounds: tuple[int, ...] = (1 << 19,)
    plans: tuple[str, ...] = (DensePlan().runtime_key(),)

    def __post_init__(self) -> None:
        if len(self.bounds) != len(self.plans) or not self.bounds:
            raise ValueError(f"a bucketed plan needs one plan per bound, got {len(self.bounds)} bounds and "
                             f"{len(self.plans)} plans")
        if any(b >= c for b, c in zip(self.bounds, self.bounds[1:])):
            raise ValueError(f"bucket bounds must ascend strictly, got {self.bounds}")
        for text in self.plans:
            if json.loads(text).get("kind") == self.kind:
                raise ValueError("a bucketed plan cannot nest another bucketed plan")

    def index_of(self, n: int) -> int:
        """The bucket of KV length ``n``: the first bound at or above it, else the last."""
        return min(bisect.bisect_left(self.bounds, n), len(self.bounds) - 1)

    def plan_for(self, n: int) -> str:
        return self.plans[self.index_of(n)]

    def describe(self) -> str:
        runs: list[str] = []
        lo = 0
        for i, (bound, text) in enumerate(zip(self.bounds, self.plans)):
            if i + 1 < len(self.plans) and self.plans[i + 1] == text:
                continue
            hi = "" if i + 1 == len(self.bounds) else str(bound)
            runs.append(f"N {lo + 1}..{hi}: {plan_from_json(text).describe()}")
            lo = bound
        return "bucketed(" + "; ".join(runs) + ")"


#: Plan kinds that take a site's mask as it is, never a valid length computed from it: SDPA (dense), and the
#: distributed plans, whose mask columns may be global or a rank's.
MASK_ONLY_KINDS = ("dense", "tree", "ring")


def reads_valid_keys(plan: Plan, site: Any) -> bool:
    """Whether ``plan`` reads only the keys that ``site``'s mask (valid-length or arbitrary) shows, rather than the
    whole cache: every kernel plan does, from a device valid length (``uses_valid_len``) or by skipping the tiles the
    mask hides (split-KV)."""
    return site.mask_kind in ("valid_length", "arbitrary") and plan.kind not in MASK_ONLY_KINDS


def uses_valid_len(plan: Plan, site: Any) -> bool:
    """Whether the lowered op gives ``plan`` a device valid length computed from ``site``'s mask (a launch ahead of the
    attention, ``valid_len_from_mask``). Not a split-KV plan without a sliding window: its programs read the mask over
    their own tiles and skip the hidden ones (``runtime/kernels/mask_tiles.py``). A window's start still comes from a
    scan or the band (``key_range_from_mask``), so that the splits share only the window's keys."""
    return reads_valid_keys(plan, site) and not (plan.kind == "split_kv" and site.window is None)
