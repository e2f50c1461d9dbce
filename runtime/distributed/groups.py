"""Process groups for distributed decode: the registry, collectives with a timeout, and cross-rank checks.

The lowered op ``torch.ops.attnopt.decode_attention(..., plan, site)`` carries no process group, so groups are
resolved through a module-level registry: call :func:`register_group` on every rank once, after
``init_process_group`` (``attnopt.optimize(model, process_group=pg)`` does it for you). The op uses
:func:`current_group`.

Every collective has a timeout. On gloo (and any non-NCCL backend) each collective is issued with
``async_op=True`` and waited with ``work.wait(timeout)``, so a dead or stalled peer raises
:class:`CollectiveError` after ``timeout`` instead of hanging. On NCCL the collectives are stream-ordered (no host
sync, CUDA-graph capturable) and the timeout is enforced by the process group's watchdog: pass ``timeout=`` to
``init_process_group``, or to :func:`register_group`, which then makes a private NCCL group with that timeout.
Collectives replayed from a CUDA graph are watched by ``watchdog.py``; ``checks.py`` compares the ranks' shapes
before a public call's first collective.
"""
from __future__ import annotations

import collections
import contextlib
import math
import os
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

if TYPE_CHECKING:  # annotations only: the cache module imports this one
    from .cache import ShardedKVCache

#: Collective timeout, seconds, when neither ``register_group(timeout=)`` nor ``ATTNOPT_DIST_TIMEOUT_S`` sets one.
DEFAULT_TIMEOUT_S = 120.0
TIMEOUT_ENV = "ATTNOPT_DIST_TIMEOUT_S"


class DistributedDecodeError(RuntimeError):
    """A distributed decode step cannot run: group not registered, world or shape mismatch across ranks."""


class CollectiveError(DistributedDecodeError):
    """A collective failed or did not finish within the timeout (a peer died or stalled)."""


# ============================================================================================ group registry
@dataclass
class DistGroup:
    """A process group registered for attnopt's distributed decode.

    Attributes
    ----------
    pg : the process group every collective of a decode step runs over.
    name : registry key.
    rank, world : this process's rank in ``pg`` and the group size.
    backend : ``"nccl"``, ``"gloo"``, ...
    timeout : the limit of every collective.
    ranks_per_node : ranks per node for the hierarchical tree (``world`` = one node).
    intra, inter : this rank's node group and its cross-node group (``None`` on one node).
    global_ranks : the global rank of each group rank (for P2P).
    cache : the :class:`ShardedKVCache` whose global masks the op slices (optional).
    """

    pg: Any
    name: str
    rank: int
    world: int
    backend: str
    timeout: timedelta
    ranks_per_node: int
    intra: Any = None
    inter: Any = None
    global_ranks: tuple[int, ...] = ()
    cache: "ShardedKVCache | None" = None
    #: The plan ``hf_sharded_attention`` runs at decode steps (default: ``TreePlan(world)`` with all_gather).
    hf_plan: Any = None
    #: The process group passed to ``register_group`` (``pg`` may be a private copy with the timeout).
    source: Any = None
    _buffers: dict = field(default_factory=dict, repr=False)
    #: Captured combine graphs (:class:`_CombineGraph`) by (shape, out dtype, with_lse).
    _graphs: dict = field(default_factory=dict, repr=False)
    #: Captured whole-step graphs (:class:`_StepGraph`), least recently used first.
    _steps: "collections.OrderedDict" = field(default_factory=lambda: collections.OrderedDict(), repr=False)
    #: The split-KV state (workspace) the step graphs of one plan and shape family share.
    _step_states: dict = field(default_factory=dict, repr=False)
    #: Set by the replay watchdog when a replayed collective outlived the timeout; raised on the next call.
    failure: "CollectiveError | None" = field(default=None, repr=False)
    _watch: Any = field(default=None, repr=False)
    #: Shape signatures every rank agreed on (``check_shapes_once``).
    _checked: set = field(default_factory=set, repr=False)

    @property
    def nodes(self) -> int:
        return self.world // self.ranks_per_node

    @property
    def blocking(self) -> bool:
        """NCCL: stream-ordered collectives (watchdog timeout). Others: async + ``work.wait(timeout)``."""
        return self.backend == "nccl"

    def describe(self) -> str:
        return (f"group {self.name!r} ({self.backend}, rank {self.rank} of {self.world}, "
                f"{self.nodes} node(s) x {self.ranks_per_node}, timeout {self.timeout.total_seconds():g}s)")

    # ------------------------------------------------------------------------------------ collectives
    def wait(self, work, what: str) -> None:
        """Wait for ``work`` at most ``timeout``; raise :class:`CollectiveError` on failure or timeout."""
        if work is None:
            return
        if self.blocking:  # NCCL: stream-ordered wait (no host sync); the watchdog enforces the timeout
            work.wait()
            return
        try:
            ok = work.wait(timeout=self.timeout)
        except Exception as exc:  # gloo raises RuntimeError (timeout, connection closed by a dead peer)
            raise CollectiveError(
                f"attnopt distributed decode: {what} failed or timed out after {self.timeout.total_seconds():g}s "
                f"on {self.describe()}: a peer rank died or stalled ({type(exc).__name__}: {exc})") from exc
        if ok is False:
            raise CollectiveError(f"attnopt distributed decode: {what} timed out after "
                                  f"{self.timeout.total_seconds():g}s on {self.describe()}")

    def issue(self, fn, what: str):
        """Start a collective; a failure while issuing it (a peer already gone) is a :class:`CollectiveError`."""
        try:
            return fn()
        except CollectiveError:
            raise
        except Exception as exc:
            raise CollectiveError(
                f"attnopt distributed decode: {what} could not start on {self.describe()}: a peer rank died or "
                f"stalled ({type(exc).__name__}: {exc})") from exc

    def all_reduce(self, t: Tensor, op, pg=None, what: str = "all_reduce") -> Tensor:
        """In-place all-reduce of ``t`` over ``pg`` (default: the whole group) with the timeout."""
        pg = self.pg if pg is None else pg
        if self.blocking:
            dist.all_reduce(t, op=op, group=pg)
        else:
            self.wait(self.issue(lambda: dist.all_reduce(t, op=op, group=pg, async_op=True), what), what)
        return t

    def all_gather(self, out: Tensor, t: Tensor, pg=None, what: str = "all_gather") -> Tensor:
        """All-gather ``t`` into ``out`` of shape (P, *t.shape) over ``pg`` with the timeout."""
        pg = self.pg if pg is None else pg
        flat = out.view((-1,) + tuple(t.shape[1:])) if t.dim() else out.view(-1)  # gloo wants dim-0 concatenation
        if self.blocking:
            dist.all_gather_into_tensor(flat, t, group=pg)
        else:
            self.wait(self.issue(lambda: dist.all_gather_into_tensor(flat, t, group=pg, async_op=True), what), what)
        return out

    def exchange(self, send: Sequence[Tensor], recv: Sequence[Tensor], to: int, frm: int) -> list:
        """Start one ring step: send ``send`` to group rank ``to``, receive ``recv`` from ``frm``. Returns works."""
        ops = [dist.P2POp(dist.isend, t, self.global_ranks[to], self.pg) for t in send]
        ops += [dist.P2POp(dist.irecv, t, self.global_ranks[frm], self.pg) for t in recv]
        if self.blocking:
            return dist.batch_isend_irecv(ops)
        return self.issue(lambda: dist.batch_isend_irecv(ops), "ring step (batch_isend_irecv)")

    def finish(self, works: list, what: str) -> None:
        for w in works:
            self.wait(w, what)

    def buffer(self, key: tuple, shape: tuple, dtype: torch.dtype, device: torch.device) -> Tensor:
        """A persistent workspace (allocated once per key and shape)."""
        full = (key, tuple(shape), dtype, device)
        buf = self._buffers.get(full)
        if buf is None:
            buf = self._buffers[full] = torch.empty(shape, dtype=dtype, device=device)
        return buf


_GROUPS: dict[str, DistGroup] = {}


def positive_seconds(value: Any, what: str) -> float:
    """``value`` as a finite number of seconds > 0, else a ``ValueError`` naming ``what`` and the valid range."""
    try:
        seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what}={value!r} is not a number of seconds; give a finite number > 0 "
                         f"(default {DEFAULT_TIMEOUT_S:g})") from None
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"{what}={value!r}: the collective timeout must be a finite number of seconds > 0 "
                         f"(default {DEFAULT_TIMEOUT_S:g})")
    return seconds


def default_timeout_s() -> float:
    """The collective timeout in seconds: ``ATTNOPT_DIST_TIMEOUT_S`` when set, else ``DEFAULT_TIMEOUT_S``.

    Read when a group is registered (not at import), so that a bad value names the variable there."""
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    return positive_seconds(raw, f"environment variable {TIMEOUT_ENV}") if raw else DEFAULT_TIMEOUT_S


def _as_td(timeout: float | timedelta | None) -> timedelta:
    if timeout is None:
        return timedelta(seconds=default_timeout_s())
    if isinstance(timeout, bool):  # True/False are ints to float(): never a timeout
        raise ValueError(f"register_group: timeout={timeout!r} is not a number of seconds")
    return timedelta(seconds=positive_seconds(timeout, "register_group: timeout"))
_CURRENT: list[str] = []
_lock = threading.Lock()


def register_group(pg=None, *, name: str | None = None, timeout: float | timedelta | None = None,
                   ranks_per_node: int | None = None, make_current: bool = True) -> DistGroup:
    """Register ``pg`` (default: the world group) for attnopt's distributed decode. Call it on every rank.

    Parameters
    ----------
    pg : ``torch.distributed.ProcessGroup`` or None for ``dist.group.WORLD``.
    name : registry key (default: the group's ``group_name``).
    timeout : seconds (or a ``timedelta``) every collective may take; default ``ATTNOPT_DIST_TIMEOUT_S``
        (120 s); a finite number > 0, else ``ValueError``. On NCCL a private group with this timeout is created
        when it is given.
    ranks_per_node : ranks per node for the hierarchical tree; default ``LOCAL_WORLD_SIZE`` (torchrun), else
        the whole group is one node. Must divide the group size. Creates the node and cross-node groups,
        which is collective: every rank must call ``register_group`` with the same arguments.
    make_current : make it the group ``current_group()`` returns.

    Returns
    -------
    The :class:`DistGroup`.
    """
    td = _as_td(timeout)  # a bad timeout, or ATTNOPT_DIST_TIMEOUT_S, is an error before anything else
    target = dist.group.WORLD if pg is None else pg
    for g in _GROUPS.values():  # idempotent: a recompile registers the same group again without collectives
        # ``g.pg`` too: on NCCL with a timeout ``g.pg`` is a private group made from ``g.source``, and a caller
        # handed ``g.pg`` (``optimize(model, process_group=group.pg)``) means this same group, cache included.
        if (g.source is target or g.pg is target) and target is not None and \
                (ranks_per_node is None or ranks_per_node == g.ranks_per_node) and \
                (timeout is None or td == g.timeout):
            if make_current and (not _CURRENT or _CURRENT[-1] != g.name):
                with _lock:
                    _CURRENT.append(g.name)
            return g
    if not dist.is_available() or not dist.is_initialized():
        raise DistributedDecodeError("attnopt.register_group: torch.distributed is not initialised; call "
                                     "torch.distributed.init_process_group first")
    pg = dist.group.WORLD if pg is None else pg
    source = pg
    backend = str(dist.get_backend(pg)).lower()
    world = dist.get_world_size(pg)
    global_ranks = tuple(dist.get_global_rank(pg, i) for i in range(world)) if pg is not dist.group.WORLD \
        else tuple(range(world))
    if backend == "nccl" and timeout is not None:
        pg = dist.new_group(list(global_ranks), timeout=td, backend="nccl")
    rank = dist.get_rank(pg)
    if ranks_per_node is None:
        lws = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
        ranks_per_node = lws if lws > 0 and world % lws == 0 else world
    if ranks_per_node < 1 or world % ranks_per_node:
        raise DistributedDecodeError(f"attnopt.register_group: ranks_per_node={ranks_per_node} does not divide the "
                                     f"group size {world}")
    intra = inter = None
    nodes = world // ranks_per_node
    if nodes > 1 and ranks_per_node > 1:
        # new_group is collective over the default group: every rank creates every subgroup, in the same order.
        for n in range(nodes):
            ranks = [global_ranks[n * ranks_per_node + i] for i in range(ranks_per_node)]
            g = dist.new_group(ranks, timeout=td)
            if rank // ranks_per_node == n:
                intra = g
        for i in range(ranks_per_node):
            ranks = [global_ranks[n * ranks_per_node + i] for n in range(nodes)]
            g = dist.new_group(ranks, timeout=td)
            if rank % ranks_per_node == i:
                inter = g
    name = name or getattr(pg, "group_name", None) or f"group{len(_GROUPS)}"
    group = DistGroup(pg=pg, name=name, rank=rank, world=world, backend=backend, timeout=td,
                      ranks_per_node=ranks_per_node, intra=intra, inter=inter, global_ranks=global_ranks,
                      source=source)
    with _lock:
        _GROUPS[name] = group
        if make_current:
            _CURRENT.append(name)
    return group


def unregister_group(name: str) -> None:
    """Forget a registered group (it stays usable by torch.distributed)."""
    with _lock:
        _GROUPS.pop(name, None)
        while name in _CURRENT:
            _CURRENT.remove(name)


def get_group(name: str) -> DistGroup:
    try:
        return _GROUPS[name]
    except KeyError:
        raise DistributedDecodeError(f"no attnopt process group named {name!r}; registered: "
                                     f"{', '.join(sorted(_GROUPS)) or 'none'}") from None


def current_group() -> DistGroup:
    """The most recently registered (or ``use_group``-selected) group; raise if none."""
    if not _CURRENT:
        raise DistributedDecodeError(
            "attnopt distributed decode needs a process group: call "
            "attnopt.runtime.distributed.register_group(pg) on every rank (attnopt.optimize(model, "
            "process_group=pg) does it)")
    return get_group(_CURRENT[-1])


@contextlib.contextmanager
def use_group(group: DistGroup | str) -> Iterator[DistGroup]:
    """Make ``group`` current inside a ``with`` block."""
    g = get_group(group) if isinstance(group, str) else group
    with _lock:
        _GROUPS.setdefault(g.name, g)
        _CURRENT.append(g.name)
    try:
        yield g
    finally:
        with _lock:
            _CURRENT.reverse()
            _CURRENT.remove(g.name)
            _CURRENT.reverse()
