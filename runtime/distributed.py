"""Sequence-parallel decode attention over a process group: the sharded KV cache, tree decode, ring decode.

The KV cache of one sequence batch is sharded along the sequence: every rank keeps a contiguous tensor of
*its* keys and values plus their global positions. A decode step computes, on every rank, the softmax state
(o, lse) of the (replicated) query over the local shard, then combines the states:

* **tree** (Tree Attention, arXiv:2408.04093), one of three collectives:

  - ``all_gather``: one all-gather of the packed [o | lse] state, then a local merge;
  - ``all_reduce``: an all-reduce(MAX) of the lse, then one all-reduce(SUM) of the packed [num | den]
    (num = o * exp(lse - max), den = exp(lse - max));
  - ``all_reduce3``: the paper's baseline, all-reduce(MAX), all-reduce(SUM) of num, all-reduce(SUM) of den;

  and a hierarchical form (the same collective inside each node, then across nodes) for multi-node groups.
* **ring**: ``pass_kv`` rotates the K/V shards around the ring in P-1 overlapped P2P steps and merges the
  state of each visiting shard (Ring Attention's decode baseline); ``pass_q`` rotates the query together
  with its partial state (at decode the query is replicated, so only the state [o | lse] travels): each
  rank merges its own local state into what it receives, P-1 hops.

Every variant returns the exact state (o, lse) over the whole sequence, so the merge is associative and the
result equals single-device attention up to fp32 rounding.

Process groups and timeouts
---------------------------
The lowered op ``torch.ops.attnopt.decode_attention(..., plan, site)`` carries no process group, so groups
are resolved through a module-level registry: call :func:`register_group` on every rank once, after
``init_process_group`` (``attnopt.optimize(model, process_group=pg)`` does it for you). The op uses
:func:`current_group`.

Every collective has a timeout. On gloo (and any non-NCCL backend) each collective is issued with
``async_op=True`` and waited with ``work.wait(timeout)``, so a dead or stalled peer raises
:class:`CollectiveError` after ``timeout`` instead of hanging. On NCCL the collectives are stream-ordered
(no host sync, CUDA-graph capturable) and the timeout is enforced by the process group's watchdog: pass
``timeout=`` to ``init_process_group``, or to :func:`register_group`, which then makes a private NCCL group
with that timeout.

Hugging Face models
-------------------
::

    group = register_group(pg)                       # every rank, after init_process_group
    cache = make_sharded_cache(model, group)         # a new one per generate call
    # either the compiler route: decode sites lowered to TreePlan / RingPlan by the planner
    out = attnopt.optimize(model, process_group=pg).generate(ids, past_key_values=cache)
    # or the eager route: transformers' attention interface
    register_hf_attention(); model.set_attn_implementation("attnopt_sharded")
    out = model.generate(ids, past_key_values=cache)

The cache returns the whole prompt at prefill and only the local shard afterwards, so a decode-time
attention that was *not* rewritten would attend to the local shard alone: check ``attnopt.last_plans``.

Shapes
------
Q is (B, Hq, L, D) with L <= 16, K/V are the local shard (B, Hkv, n, D) / (B, Hkv, n, Dv), Hq = G * Hkv
(query head h reads KV head h // G). Masks and valid lengths are in *local* coordinates (columns = local
keys); :class:`ShardedKVCache` converts global ones (``local_mask``, ``local_valid_len``).
"""
from __future__ import annotations

import collections
import contextlib
import hashlib
import math
import os
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .reference import attention_states, merge_states

#: Tree collective variants (``TreePlan.collective``).
TREE_COLLECTIVES = ("all_gather", "all_reduce", "all_reduce3")
#: Ring variants (``RingPlan.variant``).
RING_VARIANTS = ("pass_kv", "pass_q")
#: Local attention back-ends (``TreePlan.local``): ``auto`` picks flash on CUDA when it applies, else a
#: registered single-GPU strategy's ``run_states``, else the reference.
LOCAL_KINDS = ("auto", "reference", "flash", "dense", "split_kv", "stream_k")
#: Default collective timeout, seconds (``ATTNOPT_DIST_TIMEOUT_S`` overrides).
DEFAULT_TIMEOUT_S = float(os.environ.get("ATTNOPT_DIST_TIMEOUT_S", "120"))


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


def _as_td(timeout: float | timedelta | None) -> timedelta:
    if timeout is None:
        return timedelta(seconds=DEFAULT_TIMEOUT_S)
    return timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))
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
        (120 s). On NCCL a private group with this timeout is created when it is given.
    ranks_per_node : ranks per node for the hierarchical tree; default ``LOCAL_WORLD_SIZE`` (torchrun), else
        the whole group is one node. Must divide the group size. Creates the node and cross-node groups,
        which is collective: every rank must call ``register_group`` with the same arguments.
    make_current : make it the group ``current_group()`` returns.

    Returns
    -------
    The :class:`DistGroup`.
    """
    target = dist.group.WORLD if pg is None else pg
    for g in _GROUPS.values():  # idempotent: a recompile registers the same group again without collectives
        # ``g.pg`` too: on NCCL with a timeout ``g.pg`` is a private group made from ``g.source``, and a caller
        # handed ``g.pg`` (``optimize(model, process_group=group.pg)``) means this same group, cache included.
        if (g.source is target or g.pg is target) and target is not None and \
                (ranks_per_node is None or ranks_per_node == g.ranks_per_node) and \
                (timeout is None or _as_td(timeout) == g.timeout):
            if make_current and (not _CURRENT or _CURRENT[-1] != g.name):
                with _lock:
                    _CURRENT.append(g.name)
            return g
    if not dist.is_available() or not dist.is_initialized():
        raise DistributedDecodeError("attnopt.register_group: torch.distributed is not initialised; call "
                                     "torch.distributed.init_process_group first")
    pg = dist.group.WORLD if pg is None else pg
    source = pg
    td = _as_td(timeout)
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


def check_world(group: DistGroup, world: int, what: str) -> None:
    """Raise a clear error when a plan's world size is not the group's."""
    if world != group.world:
        raise DistributedDecodeError(
            f"{what} was planned for world={world} ranks but runs on {group.describe()}; re-plan with "
            f"world_size={group.world} (attnopt.optimize(model, process_group=pg) plans for pg.size())")


def check_same_across_ranks(group: DistGroup, values: Sequence[int], names: Sequence[str], what: str) -> None:
    """All-gather ``values`` (ints) and raise :class:`DistributedDecodeError` naming each rank's values on a mismatch.

    Cheap (one all-gather of a few int64); called from ``prepare``, never per step.
    """
    t = torch.tensor(list(values), dtype=torch.int64)
    if group.backend == "nccl":
        t = t.cuda()
    out = torch.empty((group.world, t.numel()), dtype=t.dtype, device=t.device)
    group.all_gather(out, t, what=f"{what}: shape check")
    rows = out.cpu().tolist()
    if any(r != rows[0] for r in rows):
        per_rank = "; ".join(f"rank {i}: " + ", ".join(f"{n}={v}" for n, v in zip(names, r)) for i, r in enumerate(rows))
        raise DistributedDecodeError(f"{what}: ranks disagree on the decode shapes ({per_rank}); every rank must run "
                                     f"the same query shape, heads and dtype")


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.sha1(text.encode()).digest()[:7], "little")


DTYPE_CODES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.float64: 4}


def check_decode_shapes(group: DistGroup, q: Tensor, k: Tensor, v: Tensor, what: str, plan_key: str = "") -> None:
    """Check that every rank runs the same (B, Hq, L, D, Hkv, Dv, dtype, plan). K/V lengths may differ."""
    B, Hq, L, D = q.shape
    vals = [B, Hq, L, D, k.shape[1], v.shape[-1], DTYPE_CODES.get(q.dtype, 0), _digest(plan_key)]
    check_same_across_ranks(group, vals, ["B", "Hq", "L", "D", "Hkv", "Dv", "dtype", "plan"], what)


# ============================================================================================ local attention
_LOCAL_STATES: dict[tuple, Any] = {}


def _flash_states(q: Tensor, k: Tensor, v: Tensor, scale: float, fp32: bool = True) -> tuple[Tensor, Tensor]:
    """Flash attention's (o, lse) on CUDA, GQA folded into the query rows: (B, Hkv, G*L, D) against K/V.
    ``fp32=False`` leaves o in the input dtype (the tree's pack converts it on the way)."""
    B, Hq, L, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    qg = q.reshape(B, Hkv, G * L, D)
    out = torch.ops.aten._scaled_dot_product_flash_attention(qg, k, v, 0.0, False, False, scale=scale)
    o, lse = out[0].reshape(B, Hq, L, v.shape[-1]), out[1].reshape(B, Hq, L)
    return (o.float(), lse.float()) if fp32 else (o, lse)


def _local_plan(kind: str, strategy, q: Tensor, k: Tensor, v: Tensor):
    """The single-device strategy's best plan for the local shard (its own candidates and cost model), chosen
    once per shape family with the shard length of the first call; the kind's default plan if that fails."""
    from attnopt.plan import plan_kind

    try:
        from attnopt.hardware import detect_profile, resolve_profile
        from attnopt.site import AttentionSite

        from .strategies import PlanContext

        B, Hq, L, D = q.shape
        dt = str(q.dtype).replace("torch.", "")
        site = AttentionSite(node="local", module_path="", pattern="distributed", batch=B, q_heads=Hq,
                             kv_heads=k.shape[1], head_dim=D, q_len=L, kv_len=max(1, k.shape[2]), dtype=dt,
                             v_head_dim=v.shape[-1], gqa_source="enable_gqa" if Hq != k.shape[1] else "mha")
        try:
            hw = resolve_profile(None)
        except Exception:  # e.g. the calibrated-profile cache needs platformdirs
            hw = detect_profile()
        ctx = PlanContext(world_size=1, device_type=q.device.type, triton_available=q.is_cuda)
        if strategy.check(site, hw, ctx) is None:
            cands = list(strategy.candidates(site, hw, ctx))
            if cands:
                return min(cands, key=lambda p: strategy.estimate_us(p, site, hw, ctx))
    except Exception:
        pass
    return plan_kind(kind)()


def local_states(q: Tensor, k: Tensor, v: Tensor, *, attn_mask: Tensor | None = None,
                 valid_len: Tensor | None = None, scale: float | None = None, is_causal: bool = False,
                 local: str = "auto", fp32: bool = True) -> tuple[Tensor, Tensor]:
    """Softmax state of ``q`` over the local shard.

    Parameters
    ----------
    q : (B, Hq, L, D); k : (B, Hkv, n, D); v : (B, Hkv, n, Dv) (n may be 0).
    attn_mask : bool or additive, broadcastable to (B, Hq, L, n), local columns.
    valid_len : (B,) int, local: keys at local index >= valid_len[b] are ignored.
    local : one of ``LOCAL_KINDS``.
    fp32 : False lets o come back in q's dtype where the local kernel produces that (flash): one conversion
        fewer when the caller converts anyway (the tree's pack).

    Returns
    -------
    o : (B, Hq, L, Dv) float32 (or q's dtype, see ``fp32``); lse : (B, Hq, L) float32 (-inf where no key is
    visible).
    """
    D = q.shape[-1]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    plain = attn_mask is None and valid_len is None and not is_causal
    if k.shape[2] == 0:
        return attention_states(q, k, v, scale=scale)
    if local in ("auto", "flash") and plain and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) \
            and v.shape[-1] == D and D <= 256:
        return _flash_states(q, k, v, scale, fp32)
    if local not in ("auto", "reference", "flash"):
        from .strategies import STRATEGIES

        strategy = STRATEGIES.get(local)
        if strategy is not None and (q.is_cuda or local == "dense"):
            key = (local, q.device, q.dtype, q.shape, k.shape[1], v.shape[-1])
            if key not in _LOCAL_STATES:
                plan = _local_plan(local, strategy, q, k, v)
                _LOCAL_STATES[key] = (plan, strategy.prepare(plan, q, k, v))
            plan, state = _LOCAL_STATES[key]
            return strategy.run_states(state, plan, q, k, v, attn_mask, valid_len, scale, is_causal)
    return attention_states(q, k, v, attn_mask=attn_mask, valid_len=valid_len, scale=scale, is_causal=is_causal)


# ============================================================================================ replayed combine
def _cudart():
    """The CUDA runtime library this process has loaded (the one PyTorch uses), through ctypes; None if none."""
    import ctypes

    try:
        lib = ctypes.CDLL(None)
        lib.cudaThreadExchangeStreamCaptureMode  # noqa: B018 - resolves only if libcudart is in the global scope
        return lib
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart.so" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


def thread_local_capture_mode() -> bool:
    """Put the calling thread in CUDA's thread-local stream-capture mode (``cudaStreamCaptureModeThreadLocal``):
    its CUDA calls then neither fail nor invalidate graph captures running in other threads. True on success."""
    import ctypes

    lib = _cudart()
    if lib is None:
        return False
    mode = ctypes.c_int(1)  # cudaStreamCaptureModeThreadLocal
    try:
        return lib.cudaThreadExchangeStreamCaptureMode(ctypes.byref(mode)) == 0
    except (AttributeError, OSError):
        return False


class _ReplayWatchdog:
    """Timeouts for collectives replayed from a CUDA graph, which the process group's own watchdog does not see.

    Each replay records an event (reused once the watchdog has seen it complete) and appends it, with its
    deadline, to a queue; nothing else happens on the caller's path, so the decode step pays no lock and no
    thread wake-up. A daemon thread wakes every ``poll_s``, drops the completed events at the head of the queue
    and checks the first pending one against its deadline. If that passes, the group is marked failed and its
    communicator aborted (NCCL kernels poll the abort flag, so a replay stuck on a dead peer returns), and the
    next call on any rank raises :class:`CollectiveError`. Only the caller appends and only the thread pops, so
    the deque's own atomic operations are all the synchronisation needed."""

    def __init__(self, group: "DistGroup", poll_s: float = 0.2):
        import collections
        import time

        self._time = time.monotonic
        self.group = group
        self.pending: collections.deque = collections.deque()
        self.free: collections.deque = collections.deque()  # completed events, ready to be recorded again
        self.poll_s = poll_s
        started = threading.Event()
        self.capture_safe = False
        threading.Thread(target=self._run, args=(started,), name=f"attnopt-watchdog-{group.name}",
                         daemon=True).start()
        started.wait(10.0)

    def watch(self, what: str, stream: "torch.cuda.Stream | None" = None) -> None:
        """Queue an event recorded on ``stream`` (default: the current stream) with its deadline."""
        try:
            ev = self.free.pop()
        except IndexError:
            ev = torch.cuda.Event()
        ev.record(stream)
        self.pending.append((ev, self._time() + self.group.timeout.total_seconds(), what))

    def _run(self, started: threading.Event) -> None:
        import time

        # Event queries from this thread must not touch another thread's graph capture: in CUDA's default
        # (global) capture mode any thread's "unsafe" call, cudaEventQuery included, invalidates a capture in
        # progress. Thread-local mode makes this thread ignore other threads' captures (as PyTorch's own NCCL
        # watchdog does). Without it the watchdog does not run and the combine is not replayed.
        self.capture_safe = thread_local_capture_mode()
        started.set()
        if not self.capture_safe:
            return
        while True:
            time.sleep(self.poll_s)
            while self.pending:
                ev, deadline, what = self.pending[0]
                if ev.query():
                    self.pending.popleft()
                    self.free.append(ev)
                    continue
                if self._time() > deadline:
                    self.group.failure = CollectiveError(
                        f"attnopt distributed decode: {what} (replayed from a CUDA graph) did not finish within "
                        f"{self.group.timeout.total_seconds():g}s on {self.group.describe()}: a peer rank died or "
                        f"stalled; the communicator was aborted")
                    try:
                        self.group.pg.abort()
                    except Exception:  # noqa: BLE001 - best effort: the error above is what the caller sees
                        pass
                    self.pending.clear()
                    return
                break


class _CombineGraph:
    """The tree's all-gather and merge, captured once per shape in a CUDA graph and replayed.

    In eager mode a decode step pays host time per op; replaying the collective and the merge as one graph
    leaves two small copies (the pack) and a clone on the host path. Buffers are static: ``packed`` is the
    graph's input, ``out``/``lse`` its outputs (cloned before they are returned, as every site shares them).
    """

    def __init__(self, g: "DistGroup", o: Tensor, out_dtype: torch.dtype, with_lse: bool):
        shape = tuple(o.shape)
        dev = o.device
        self.g = g
        self.packed = torch.zeros(shape[:-1] + (shape[-1] + 1,), dtype=torch.float32, device=dev)
        self.packed_o, self.packed_lse = self.packed[..., :-1], self.packed[..., -1]  # views made once
        self.parts = torch.zeros((g.world,) + tuple(self.packed.shape), dtype=torch.float32, device=dev)
        self.out = torch.empty(shape, dtype=out_dtype, device=dev)
        self.lse = torch.empty(shape[:-1], dtype=torch.float32, device=dev) if with_lse else None
        # The stream replays normally run on; ``__call__`` asks for the current stream through the raw handle
        # (a fraction of ``torch.cuda.current_stream``'s host time) and reuses this object when it matches.
        self.stream = torch.cuda.current_stream(dev)
        self.raw_stream, self.device_index = self.stream.cuda_stream, dev.index if dev.index is not None else \
            torch.cuda.current_device()
        # No warm-up run of the body: it would issue a collective that the peers do not issue on this call. The
        # first (eager) call of the shape compiled the merge and used the communicator, so the capture, which
        # records the collective without running it, stays a local decision (see ``_replayed_step``).
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._body()

    def _body(self) -> None:
        from .kernels.merge import merge_states as triton_merge_states

        dist.all_gather_into_tensor(self.parts.view((-1,) + tuple(self.packed.shape[1:])), self.packed,
                                    group=self.g.pg)
        triton_merge_states(self.parts[..., :-1], self.parts[..., -1], out=self.out,
                            lse_out=self.lse if self.lse is not None else False)

    def __call__(self, o: Tensor, lse: Tensor) -> tuple[Tensor, Tensor | None]:
        self.packed_o.copy_(o)
        self.packed_lse.copy_(lse)
        self.graph.replay()
        stream = self.stream if torch._C._cuda_getCurrentRawStream(self.device_index) == self.raw_stream else None
        self.g._watch.watch("tree all_gather + merge", stream)
        return self.out.clone(), (self.lse.clone() if self.lse is not None else None)


def graph_combine_enabled() -> bool:
    """``ATTNOPT_TREE_GRAPH=0`` turns the replayed combine off (eager ops instead)."""
    return os.environ.get("ATTNOPT_TREE_GRAPH", "1") != "0"


def _replayed_combine(g: "DistGroup", o: Tensor, lse: Tensor, out_dtype: torch.dtype | None,
                      with_lse: bool) -> tuple[Tensor, Tensor | None] | None:
    """The combine through a captured graph, or None where that does not apply: not NCCL on CUDA, turned off,
    inside someone else's capture (which records the eager ops itself), or the first call of a shape (the eager
    path compiles the merge and uses the communicator). Every call issues exactly one all-gather, eager or
    replayed, so ranks may capture on different calls."""
    if not (g.backend == "nccl" and o.is_cuda and graph_combine_enabled() and _triton_merge_available()):
        return None
    if torch.cuda.is_current_stream_capturing():
        return None
    if g.failure is not None:
        raise g.failure
    key = (tuple(o.shape), o.device, out_dtype or torch.float32, with_lse)
    return _graph_entry(g, g._graphs, key, lambda: _CombineGraph(g, o, out_dtype or torch.float32, with_lse),
                        lambda entry: entry(o, lse))


def _graph_entry(g: "DistGroup", table: dict, key: tuple, capture, replay, limit: int | None = None):
    """The replay protocol shared by the combine and the whole-step graphs: the first call of ``key`` runs eager
    ("seen", None returned), the second captures (``capture()``) and every later one replays (``replay(entry)``).
    A capture that fails, or a process whose watchdog cannot run capture-safe, stays eager for ``key``. With
    ``limit``, the table keeps the most recently used keys only (``table`` is then an OrderedDict)."""
    entry = table.get(key)
    if limit is not None and entry is not None:
        table.move_to_end(key)
    if entry is None:
        table[key] = "seen"
        if limit is not None and len(table) > limit:
            _evict(table, len(table) - limit)
        return None
    if entry == "seen":
        if g._watch is None:
            g._watch = _ReplayWatchdog(g)
        if not g._watch.capture_safe:  # no timeout for replayed collectives here: eager collectives instead
            table[key] = "eager"
            return None
        try:
            entry = table[key] = capture()
        except Exception:  # noqa: BLE001 - capture unsupported here: stay eager for this key, never fail
            table[key] = "eager"
            return None
    if entry == "eager":
        return None
    return replay(entry)


def _evict(table, count: int) -> None:
    """Drop the ``count`` least recently used entries. A dropped graph may still be running on the GPU: wait for
    the current stream before its executable is destroyed (evictions are rare: a new key per storage regrowth)."""
    dropped = [table.popitem(last=False)[1] for _ in range(count)]
    if torch.cuda.is_available() and any(not isinstance(e, str) for e in dropped):
        torch.cuda.current_stream().synchronize()
    del dropped


#: Whole-step graphs kept per group (least recently used dropped first): a few per layer of a model.
MAX_STEP_GRAPHS = int(os.environ.get("ATTNOPT_TREE_STEP_GRAPHS", "256"))


class _StepGraph:
    """A whole tree decode step captured in one CUDA graph: split-KV over the local shard writing its (o, lse)
    straight into the packed [o | lse] buffer, the all-gather, and the merge.

    The graph reads K, V, the valid length and the mask where they lie (they are part of the key: a static cache,
    or a sharded cache's storage between regrowths, keeps them in place) and the query from a static buffer it
    is copied into. On the host a call is that copy, one replay, the watchdog event and a clone of the output.
    """

    def __init__(self, g: "DistGroup", q: Tensor, k: Tensor, v: Tensor, valid_len: Tensor | None,
                 attn_mask: Tensor | None, is_causal: bool, scale: float, out_dtype: torch.dtype, with_lse: bool):
        from .kernels.merge import merge_states as triton_merge_states
        from .kernels.split_kv import split_kv_decode
        from .strategies import STRATEGIES

        strategy = STRATEGIES["split_kv"]
        plan = _local_plan("split_kv", strategy, q, k, v)
        # One split-KV workspace per plan and shape family, shared by the graphs that use it: their replays are
        # stream-ordered, and a workspace per graph (a few per layer) would cost up to S x B x Hq x L x Dv x 4 bytes
        # each.
        family = (plan.runtime_key(), tuple(q.shape), q.dtype, k.shape[1], v.shape[-1], q.device)
        state = g._step_states.get(family)
        if state is None:
            state = g._step_states[family] = strategy.prepare(plan, q, k, v)
        B, Hq, L, _ = q.shape
        Dv = v.shape[-1]
        dev = q.device
        self.g = g
        self.plan = plan
        self.q = torch.empty_like(q)
        self.q.copy_(q)
        packed = torch.zeros((B, Hq, L, Dv + 1), dtype=torch.float32, device=dev)
        parts = torch.zeros((g.world, B, Hq, L, Dv + 1), dtype=torch.float32, device=dev)
        self.out = torch.empty((B, Hq, L, Dv), dtype=out_dtype, device=dev)
        self.lse = torch.empty((B, Hq, L), dtype=torch.float32, device=dev) if with_lse else None
        # The graph's own buffers (and the shared workspace) live as long as it does. K, V, the length and the mask
        # are not kept: the graph
        # replays only for a call whose tensors lie at those addresses with that layout (they are its key), and
        # holding them would keep a sharded cache's old storage alive after every regrowth.
        self._keep = (state, packed, parts)
        self.stream = torch.cuda.current_stream(dev)
        self.raw_stream = self.stream.cuda_stream
        self.device_index = dev.index if dev.index is not None else torch.cuda.current_device()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):  # records only: no collective runs here (see ``_replayed_step``)
            split_kv_decode(self.q, k, v, packed[..., :-1], packed[..., -1], workspace=state.workspace,
                            attn_mask=attn_mask, valid_len=valid_len, is_causal=is_causal, scale=scale,
                            num_splits=plan.num_splits, block_n=plan.block_n, num_warps=plan.num_warps,
                            num_stages=plan.num_stages, fused_merge=plan.fused_merge, tma=plan.tma)
            dist.all_gather_into_tensor(parts.view(-1, Hq, L, Dv + 1), packed, group=g.pg)
            triton_merge_states(parts[..., :-1], parts[..., -1], out=self.out,
                                lse_out=self.lse if self.lse is not None else False)

    def __call__(self, q: Tensor) -> tuple[Tensor, Tensor | None]:
        self.q.copy_(q)
        self.graph.replay()
        stream = self.stream if torch._C._cuda_getCurrentRawStream(self.device_index) == self.raw_stream else None
        self.g._watch.watch("tree decode step (split-KV, all_gather, merge)", stream)
        return self.out.clone(), (self.lse.clone() if self.lse is not None else None)


def step_graph_reason(g: "DistGroup", q: Tensor, k: Tensor, v: Tensor, *, collective: str, hierarchical: bool,
                      local: str, attn_mask: Tensor | None, is_causal: bool, valid_len: Tensor | None) -> str | None:
    """Why a tree decode call cannot run as one replayed graph (None when it can)."""
    if collective != "all_gather" or (hierarchical and g.ranks_per_node > 1):
        return f"collective {collective}{' (hierarchical)' if hierarchical else ''}: only the flat all_gather"
    if local not in ("auto", "split_kv"):
        return f"local attention {local!r}: the replayed step runs split_kv"
    if attn_mask is not None and (attn_mask.device != q.device or attn_mask.dim() > 4):
        return "a mask on another device or of more than 4 dims"
    if valid_len is not None and (valid_len.device != q.device or valid_len.dim() != 1):
        return "valid_len must be a (B,) tensor on the query's device"
    if k.shape[2] == 0:
        return "empty local shard"
    B, Hq, L, D = q.shape
    Hkv = k.shape[1]
    from .strategies.split_kv import KERNEL_DTYPES, KERNEL_HEAD_DIMS, MAX_Q_LEN

    if (L > MAX_Q_LEN or Hkv == 0 or Hq % Hkv or D not in KERNEL_HEAD_DIMS or v.shape[-1] != D
            or str(q.dtype).replace("torch.", "") not in KERNEL_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype):
        return "shape or dtype outside the split-KV kernel's range"
    if g.backend != "nccl" or not q.is_cuda:
        return f"backend {g.backend} on {q.device.type}: replayed steps need NCCL on CUDA"
    if not graph_combine_enabled():
        return "ATTNOPT_TREE_GRAPH=0"
    if torch.cuda.is_current_stream_capturing():
        return "inside a CUDA graph capture (the enclosing graph records the ops itself)"
    if not _triton_merge_available():
        return "Triton kernels unavailable"
    return None


def _replayed_step(g: "DistGroup", q: Tensor, k: Tensor, v: Tensor, *, valid_len: Tensor | None,
                   attn_mask: Tensor | None, is_causal: bool, scale: float, out_dtype: torch.dtype,
                   with_lse: bool) -> tuple[Tensor, Tensor | None] | None:
    """The whole step through a captured graph (:class:`_StepGraph`), or None (then the caller runs it eagerly).

    The key holds where K, V, the valid length and the mask lie, with every shape, stride and dtype (and
    ``is_causal``, the scale, the output dtype): the graph computes
    exactly the call it stands for. A rank's keys change when its shard's storage regrows, which happens on
    different steps on different ranks; captures are therefore local decisions: a capture records the
    all-gather without running it, so every call issues exactly one all-gather on every rank, eager or replayed.
    """
    if g.failure is not None:
        raise g.failure

    def where(t: Tensor | None):
        return None if t is None else (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)

    key = ("step", q.device, tuple(q.shape), q.dtype, where(k), where(v), where(valid_len), where(attn_mask),
           bool(is_causal), float(scale), out_dtype, with_lse)
    return _graph_entry(g, g._steps, key,
                        lambda: _StepGraph(g, q, k, v, valid_len, attn_mask, is_causal, scale, out_dtype, with_lse),
                        lambda entry: entry(q), limit=MAX_STEP_GRAPHS)


# ============================================================================================ tree decode
def _pack(o: Tensor, lse: Tensor, out: Tensor) -> Tensor:
    """[o | lse] into ``out`` (..., Dv + 1) fp32."""
    out[..., :-1].copy_(o)
    out[..., -1].copy_(lse)
    return out


def merge_packed(parts: Tensor) -> tuple[Tensor, Tensor]:
    """Merge P packed states (P, ..., Dv + 1) into (o (..., Dv), lse (...)); empty parts (lse=-inf) are ignored.

    On CUDA this is one launch of the Triton merge kernel (``runtime/kernels/merge.py``, strided reads of the
    packed buffer); elsewhere the reference merge.
    """
    if parts.is_cuda and _triton_merge_available():
        return merge_packed_triton(parts)
    return merge_states(parts[..., :-1], parts[..., -1])


def merge_packed_triton(parts: Tensor) -> tuple[Tensor, Tensor]:
    """``merge_packed`` through the Triton kernel (on CPU tensors it needs ``TRITON_INTERPRET=1``)."""
    from .kernels.merge import merge_states as triton_merge_states

    return triton_merge_states(parts[..., :-1], parts[..., -1])


_TRITON_MERGE: list[bool] = []


def _triton_merge_available() -> bool:
    if not _TRITON_MERGE:
        from .kernels import triton_usable

        _TRITON_MERGE.append(triton_usable("cuda"))
    return _TRITON_MERGE[0]


def _merge_parts(parts: Tensor, out_dtype: torch.dtype | None, with_lse: bool) -> tuple[Tensor, Tensor | None]:
    """``merge_packed`` writing o straight in ``out_dtype`` (one launch on CUDA, no cast after it) and skipping
    the LSE when it is not wanted."""
    if parts.is_cuda and _triton_merge_available():
        from .kernels.merge import merge_states as triton_merge_states

        return triton_merge_states(parts[..., :-1], parts[..., -1], out_dtype=out_dtype or torch.float32,
                                   lse_out=None if with_lse else False)
    o, lse = merge_packed(parts)
    return (o.to(out_dtype) if out_dtype is not None else o), (lse if with_lse else None)


def _tree_all_gather(g: DistGroup, o: Tensor, lse: Tensor, pg, size: int, tag: str,
                     out_dtype: torch.dtype | None = None, with_lse: bool = True) -> tuple[Tensor, Tensor | None]:
    # the pack converts o (any float dtype) to fp32 on the way: no separate conversion op
    packed = _pack(o, lse, g.buffer(("pack", tag), o.shape[:-1] + (o.shape[-1] + 1,), torch.float32, o.device))
    parts = g.buffer(("gather", tag), (size,) + tuple(packed.shape), torch.float32, o.device)
    g.all_gather(parts, packed, pg=pg, what=f"tree all_gather[{tag}]")
    return _merge_parts(parts, out_dtype, with_lse)


def _num_den(o: Tensor, lse: Tensor, m: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Scale a state to the global max: (safe max, num = o * w, den = w) with w = exp(lse - max)."""
    safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    w = torch.exp(lse - safe)
    return safe, o * w.unsqueeze(-1), w


def _finish(num: Tensor, den: Tensor, safe_max: Tensor) -> tuple[Tensor, Tensor]:
    empty = den == 0
    o = num / torch.where(empty, torch.ones_like(den), den).unsqueeze(-1)
    lse = torch.where(empty, torch.full_like(den, float("-inf")), safe_max + torch.log(den))
    return o, lse


def _tree_all_reduce(g: DistGroup, o: Tensor, lse: Tensor, pg, tag: str) -> tuple[Tensor, Tensor]:
    m = g.buffer(("max", tag), lse.shape, torch.float32, lse.device)
    m.copy_(lse)
    g.all_reduce(m, dist.ReduceOp.MAX, pg=pg, what=f"tree all_reduce(max)[{tag}]")
    safe, num, den = _num_den(o, lse, m)
    packed = _pack(num, den, g.buffer(("numden", tag), o.shape[:-1] + (o.shape[-1] + 1,), torch.float32, o.device))
    g.all_reduce(packed, dist.ReduceOp.SUM, pg=pg, what=f"tree all_reduce(sum [num|den])[{tag}]")
    return _finish(packed[..., :-1], packed[..., -1], safe)


def _tree_all_reduce3(g: DistGroup, o: Tensor, lse: Tensor, pg, tag: str) -> tuple[Tensor, Tensor]:
    m = lse.clone()
    g.all_reduce(m, dist.ReduceOp.MAX, pg=pg, what=f"tree all_reduce(max)[{tag}]")
    safe, num, den = _num_den(o, lse, m)
    num = num.contiguous()
    den = den.contiguous()
    g.all_reduce(num, dist.ReduceOp.SUM, pg=pg, what=f"tree all_reduce(sum num)[{tag}]")
    g.all_reduce(den, dist.ReduceOp.SUM, pg=pg, what=f"tree all_reduce(sum den)[{tag}]")
    return _finish(num, den, safe)


def combine_tree(o: Tensor, lse: Tensor, group: DistGroup, collective: str = "all_gather",
                 hierarchical: bool = False, *, out_dtype: torch.dtype | None = None,
                 with_lse: bool = True) -> tuple[Tensor, Tensor | None]:
    """Combine every rank's local state into the global one with a tree collective.

    Parameters
    ----------
    o : (B, Hq, L, Dv) local output (float32, or any float dtype); lse : (B, Hq, L) float32 local LSE (-inf
        for an empty shard).
    collective : one of ``TREE_COLLECTIVES``.
    hierarchical : reduce inside each node first, then across nodes (needs a multi-node group).
    out_dtype : dtype of the returned o (default float32); the single-stage all-gather merge writes it directly.
    with_lse : False skips the merged LSE (returned as None) where the merge can skip it.

    Returns
    -------
    (o (B, Hq, L, Dv), lse (B, Hq, L) float32 or None) of the whole sequence, identical on every rank.
    """
    if collective not in TREE_COLLECTIVES:
        raise ValueError(f"unknown tree collective {collective!r}; valid: {', '.join(TREE_COLLECTIVES)}")
    if hierarchical and group.nodes <= 1:
        raise DistributedDecodeError(f"hierarchical tree decode needs more than one node; {group.describe()}")
    if collective == "all_gather" and group.world > 1 and not (hierarchical and group.ranks_per_node > 1):
        # the decode hot path: pack (converting o), one all-gather, one merge launch writing out_dtype; on NCCL
        # the all-gather and merge are replayed from a CUDA graph
        replayed = _replayed_combine(group, o, lse, out_dtype, with_lse)
        if replayed is not None:
            return replayed
        return _tree_all_gather(group, o, lse.float(), group.pg, group.world, "world", out_dtype, with_lse)
    o = o.float().contiguous()
    lse = lse.float().contiguous()
    if group.world == 1:
        return (o.to(out_dtype) if out_dtype is not None else o), lse
    if hierarchical and group.ranks_per_node > 1:
        stages = [(group.intra, group.ranks_per_node, "intra"), (group.inter, group.nodes, "inter")]
    else:
        stages = [(group.pg, group.world, "world")]
    for pg, size, tag in stages:
        if collective == "all_gather":
            o, lse = _tree_all_gather(group, o, lse, pg, size, tag)
        elif collective == "all_reduce":
            o, lse = _tree_all_reduce(group, o, lse, pg, tag)
        else:
            o, lse = _tree_all_reduce3(group, o, lse, pg, tag)
    return (o.to(out_dtype) if out_dtype is not None else o), lse


def tree_decode(q: Tensor, k: Tensor, v: Tensor, group: DistGroup | None = None, *, collective: str = "all_gather",
                hierarchical: bool = False, attn_mask: Tensor | None = None, valid_len: Tensor | None = None,
                scale: float | None = None, is_causal: bool = False, local: str = "auto",
                return_lse: bool = False):
    """Tree decode: local attention over this rank's shard, one tree collective, local merge.

    Parameters
    ----------
    q : (B, Hq, L, D), the same on every rank. k : (B, Hkv, n, D), v : (B, Hkv, n, Dv): the local shard
        (n may differ across ranks, 0 included).
    attn_mask, valid_len : local coordinates (see module docstring).
    is_causal : top-left causal over *local* key indices; for global positions pass a mask from
        :meth:`ShardedKVCache.local_mask` instead.

    Returns
    -------
    (B, Hq, L, Dv) in ``q.dtype`` (and the fp32 LSE (B, Hq, L) when ``return_lse``).
    """
    g = group or current_group()
    out, lse = tree_step(g, q, k, v, collective=collective, hierarchical=hierarchical, attn_mask=attn_mask,
                         valid_len=valid_len, scale=scale, is_causal=is_causal, local=local, out_dtype=q.dtype,
                         with_lse=return_lse)
    return (out, lse) if return_lse else out


def tree_step(g: DistGroup, q: Tensor, k: Tensor, v: Tensor, *, collective: str, hierarchical: bool,
              attn_mask: Tensor | None, valid_len: Tensor | None, scale: float | None, is_causal: bool, local: str,
              out_dtype: torch.dtype, with_lse: bool) -> tuple[Tensor, Tensor | None]:
    """Local attention and the tree combine (arguments as :func:`tree_decode`, masks already local): one replayed
    graph (:class:`_StepGraph`) where ``step_graph_reason`` allows it and this step's key was seen before, else
    the ops one by one. Returns (o in ``out_dtype``, fp32 LSE or None)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if step_graph_reason(g, q, k, v, collective=collective, hierarchical=hierarchical, local=local,
                         attn_mask=attn_mask, is_causal=is_causal, valid_len=valid_len) is None:
        sk, sv, svalid, smask = k, v, valid_len, attn_mask
        if valid_len is None and g.cache is not None:
            # A sharded cache's shard grows by one token per step: the graph reads its storage with the length
            # on the device (and the mask from a buffer with the storage's columns), so one capture serves every
            # step until the storage regrows.
            sk, sv, svalid, smask = g.cache.storage_of(k, v, attn_mask) or (k, v, None, attn_mask)
        replayed = _replayed_step(g, q, sk, sv, valid_len=svalid, attn_mask=smask, is_causal=is_causal,
                                  scale=scale, out_dtype=out_dtype, with_lse=with_lse)
        if replayed is not None:
            return replayed
    o, lse = local_states(q, k, v, attn_mask=attn_mask, valid_len=valid_len, scale=scale, is_causal=is_causal,
                          local=local, fp32=False)
    return combine_tree(o, lse, g, collective, hierarchical, out_dtype=out_dtype, with_lse=with_lse)


# ============================================================================================ ring decode
def _as_bias(attn_mask: Tensor | None, B: int, Hq: int, L: int, n: int, device) -> Tensor | None:
    """A local mask as an additive fp32 bias (B, Hm, L, n) (Hm = 1 or Hq), for travelling with its K/V."""
    if attn_mask is None:
        return None
    m = attn_mask
    while m.dim() < 4:
        m = m.unsqueeze(0)
    hm = 1 if m.shape[1] == 1 else Hq
    m = m.expand(B, hm, L, n)
    if m.dtype == torch.bool:
        return torch.zeros(m.shape, dtype=torch.float32, device=device).masked_fill(~m, float("-inf"))
    return m.to(torch.float32)


def _lengths(g: DistGroup, n: int, device) -> list[int]:
    t = torch.tensor([n], dtype=torch.int64, device=device)
    out = torch.empty((g.world, 1), dtype=torch.int64, device=device)
    g.all_gather(out, t, what="ring: shard lengths")
    return [int(x) for x in out.flatten().tolist()]


def ring_pass_kv(q: Tensor, k: Tensor, v: Tensor, g: DistGroup, *, attn_mask: Tensor | None = None,
                 valid_len: Tensor | None = None, scale: float | None = None, is_causal: bool = False,
                 local: str = "auto", shard_lens: Sequence[int] | None = None) -> tuple[Tensor, Tensor]:
    """Ring pass-KV: P-1 steps; each step sends the visiting K/V block on while attending to it.

    The blocks are padded to the longest shard; each carries its per-row valid count (B,) and, with a mask,
    its bias columns. ``shard_lens`` (every rank's n) saves the all-gather of the lengths when known.
    Returns the global (o, lse), fp32.
    """
    P, r = g.world, g.rank
    B, Hq, L, D = q.shape
    Hkv, n, Dv = k.shape[1], k.shape[2], v.shape[-1]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    lens = list(shard_lens) if shard_lens is not None else _lengths(g, n, q.device if g.blocking else "cpu")
    if lens[r] != n:
        raise DistributedDecodeError(f"ring pass_kv: shard_lens[{r}]={lens[r]} but the local shard has {n} keys")
    cap = max(lens)
    dev = q.device
    if is_causal:
        rows = torch.arange(L, device=dev)[:, None]
        causal = torch.arange(n, device=dev)[None, :] <= rows
        attn_mask = causal if attn_mask is None else (attn_mask & causal if attn_mask.dtype == torch.bool
                                                      else attn_mask.masked_fill(~causal, float("-inf")))
    bias = _as_bias(attn_mask, B, Hq, L, n, dev)
    # A block: K (B, Hkv, cap, D), V (B, Hkv, cap, Dv), valid counts (B,), with a mask its bias columns.
    kv_dtype = k.dtype

    def alloc(tag):
        bufs = [g.buffer(("ring_k", tag), (B, Hkv, cap, D), kv_dtype, dev),
                g.buffer(("ring_v", tag), (B, Hkv, cap, Dv), kv_dtype, dev),
                g.buffer(("ring_n", tag), (B,), torch.int64, dev)]
        if bias is not None:
            bufs.append(g.buffer(("ring_b", tag), (B, bias.shape[1], L, cap), torch.float32, dev))
        return bufs

    vl = torch.full((B,), n, dtype=torch.int64, device=dev)
    if valid_len is not None:
        vl = torch.minimum(vl, valid_len.to(dev, torch.int64))
    if n == cap and k.is_contiguous() and v.is_contiguous():
        own = [k, v, vl] + ([bias.contiguous()] if bias is not None else [])  # send the shard itself, no copy
    else:
        own = alloc("own")
        own[0][:, :, :n].copy_(k)
        own[1][:, :, :n].copy_(v)
        own[0][:, :, n:].zero_()
        own[1][:, :, n:].zero_()
        own[2].copy_(vl)
        if bias is not None:
            own[3][..., :n].copy_(bias)
            own[3][..., n:].fill_(float("-inf"))
    o_acc = lse_acc = None
    cur = own
    for step in range(P):
        # Receive buffers alternate (two suffice: a buffer is refilled only after its block was attended to).
        nxt = alloc(step % 2) if step < P - 1 else None
        works = g.exchange(cur, nxt, (r + 1) % P, (r - 1) % P) if nxt is not None else []
        src = (r - step) % P
        m = lens[src]
        o_s, lse_s = local_states(q, cur[0][:, :, :m], cur[1][:, :, :m],
                                  attn_mask=cur[3][..., :m] if bias is not None else None,
                                  valid_len=cur[2] if valid_len is not None else None,
                                  scale=scale, local=local)
        if o_acc is None:
            o_acc, lse_acc = o_s, lse_s
        else:
            o_acc, lse_acc = merge_states(torch.stack((o_acc, o_s)), torch.stack((lse_acc, lse_s)))
        g.finish(works, f"ring pass_kv step {step + 1}/{P - 1}")
        cur = nxt
    return o_acc, lse_acc


def ring_pass_q(q: Tensor, k: Tensor, v: Tensor, g: DistGroup, *, attn_mask: Tensor | None = None,
                valid_len: Tensor | None = None, scale: float | None = None, is_causal: bool = False,
                local: str = "auto") -> tuple[Tensor, Tensor]:
    """Ring pass-Q at decode: the K/V stay; the query's partial state [o | lse] travels the ring.

    Every rank attends to its own shard once. At decode the query is replicated on every rank, so a rank
    receiving a partial state merges its own local state into it and passes it on: after P-1 hops every rank
    holds the state over all shards (a ring reduction of states; the query itself need not travel).
    Returns (o, lse), fp32.
    """
    P, r = g.world, g.rank
    B, Hq, L, D = q.shape
    Dv = v.shape[-1]
    o, lse = local_states(q, k, v, attn_mask=attn_mask, valid_len=valid_len, scale=scale, is_causal=is_causal,
                          local=local)
    width = Dv + 1
    bufs = [g.buffer(("passq", i), (B, Hq, L, width), torch.float32, q.device) for i in range(2)]
    cur, nxt = bufs
    _pack(o, lse, cur)
    for step in range(P - 1):
        works = g.exchange([cur], [nxt], (r + 1) % P, (r - 1) % P)
        g.finish(works, f"ring pass_q step {step + 1}/{P - 1}")
        o_m, lse_m = merge_states(torch.stack((nxt[..., :Dv], o)), torch.stack((nxt[..., Dv], lse)))
        cur, nxt = nxt, cur
        _pack(o_m, lse_m, cur)
    return cur[..., :Dv].clone(), cur[..., Dv].clone()


def ring_decode(q: Tensor, k: Tensor, v: Tensor, group: DistGroup | None = None, *, variant: str = "pass_kv",
                attn_mask: Tensor | None = None, valid_len: Tensor | None = None, scale: float | None = None,
                is_causal: bool = False, local: str = "auto", shard_lens: Sequence[int] | None = None,
                return_lse: bool = False):
    """Ring decode (``variant`` in ``RING_VARIANTS``). Shapes as :func:`tree_decode`; returns (B, Hq, L, Dv)."""
    g = group or current_group()
    if variant == "pass_kv":
        o, lse = (ring_pass_kv(q, k, v, g, attn_mask=attn_mask, valid_len=valid_len, scale=scale,
                               is_causal=is_causal, local=local, shard_lens=shard_lens) if g.world > 1 else
                  local_states(q, k, v, attn_mask=attn_mask, valid_len=valid_len, scale=scale, is_causal=is_causal,
                               local=local))
    elif variant == "pass_q":
        o, lse = (ring_pass_q(q, k, v, g, attn_mask=attn_mask, valid_len=valid_len, scale=scale,
                              is_causal=is_causal, local=local) if g.world > 1 else
                  local_states(q, k, v, attn_mask=attn_mask, valid_len=valid_len, scale=scale, is_causal=is_causal,
                               local=local))
    else:
        raise ValueError(f"unknown ring variant {variant!r}; valid: {', '.join(RING_VARIANTS)}")
    out = o.to(q.dtype)
    return (out, lse) if return_lse else out


# ============================================================================================ sharded cache
def balanced_bounds(n: int, world: int) -> list[tuple[int, int]]:
    """Contiguous balanced shards of ``n`` tokens: rank r gets [r*n//P, (r+1)*n//P)."""
    return [(r * n // world, (r + 1) * n // world) for r in range(world)]


class GrowingTensor:
    """A tensor that grows along one dimension by appending, with amortised O(1) copies per appended element.

    Appending into ``torch.cat([old, new])`` copies the whole tensor every time: for a KV shard that is the
    whole shard per token per layer, twice the traffic of the attention that reads it. Here the storage grows
    by ``GROWTH`` times (at least ``MIN_EXTRA`` elements) when full, and :attr:`value` is a view of the filled
    prefix. A view handed out earlier stays valid and unchanged: appends write only past its end, and a regrow
    copies into new storage.
    """

    GROWTH = 1.5
    MIN_EXTRA = 256

    def __init__(self, dim: int):
        self.dim = dim
        self._buf: Tensor | None = None
        self.length = 0

    @property
    def value(self) -> Tensor | None:
        """The filled prefix (a view), or None before the first append."""
        return None if self._buf is None else self._buf.narrow(self.dim, 0, self.length)

    @property
    def storage(self) -> Tensor | None:
        """The whole storage (filled prefix and spare capacity), or None before the first append."""
        return self._buf

    def append(self, new: Tensor) -> Tensor:
        """Append ``new`` (same shape as the stored tensor except along ``dim``); returns :attr:`value`."""
        t = new.shape[self.dim]
        if self._buf is None:
            shape = list(new.shape)
            shape[self.dim] = t  # the first block exactly: a prefill that is never extended costs no slack
            self._buf = torch.empty(shape, dtype=new.dtype, device=new.device)
        elif self.length + t > self._buf.shape[self.dim]:
            shape = list(self._buf.shape)
            shape[self.dim] = max(self.length + t, int(self.length * self.GROWTH), self.length + self.MIN_EXTRA)
            grown = torch.empty(shape, dtype=self._buf.dtype, device=self._buf.device)
            grown.narrow(self.dim, 0, self.length).copy_(self.value)
            # spare capacity holds zeros, not stale bits: a replayed tree step reads the storage with the length
            # on the device, and a kernel that loads whole tiles then sees finite values past the length
            grown.narrow(self.dim, self.length, shape[self.dim] - self.length).zero_()
            self._buf = grown
        if t:
            self._buf.narrow(self.dim, self.length, t).copy_(new)
        self.length += t
        return self.value


class ShardedKVCache:
    """A sequence-sharded KV cache over a group: every rank keeps only its keys/values, per layer.

    Token placement is deterministic, so every rank knows every token's owner without communication:

    * the first update (prefill into an empty cache) is split into contiguous balanced shards
      (:func:`balanced_bounds`);
    * each later token goes to the least-filled rank (ties: the lowest rank), which keeps shards within one
      token of each other.

    All layers share the placement (``owner``); ``positions`` are the global positions of the local keys, so
    masks built for the global sequence are sliced with :meth:`local_mask` and RoPE (applied before the
    update) stays global.

    Parameters
    ----------
    group : the :class:`DistGroup` (default: ``current_group()``). It is attached as ``group.cache``.
    """

    def __init__(self, group: DistGroup | None = None):
        self.group = group or current_group()
        self.group.cache = self
        self.owner: list[int] = []  # owner rank of every global position
        self.counts = [0] * self.group.world  # tokens per rank
        self._keys: list[GrowingTensor] = []
        self._values: list[GrowingTensor] = []
        self.layer_len: list[int] = []  # global length seen by each layer
        #: Per layer: whether the last update returned the whole new block instead of the local shard
        #: (a prefill into an empty layer); the same on every rank, so attention decides uniformly.
        self.returned_full: list[bool] = []
        self._positions = GrowingTensor(0)
        self._positions_dev: dict[torch.device, GrowingTensor] = {}  # device mirrors of the positions
        #: layer by the address of its key storage (checked against the layer on lookup: addresses get reused)
        self._layer_at: dict[int, int] = {}
        self._local_len: dict[tuple, list] = {}  # (device, B) -> [device tensor (B,) int32, value it holds]
        self._mask_bufs: dict[tuple, Tensor] = {}  # (dtype, mask shape with the storage's columns) -> buffer

    # ------------------------------------------------------------------------------------ placement
    def _assign(self, upto: int) -> None:
        start = len(self.owner)
        if upto <= start:
            return
        P, me = self.group.world, self.group.rank
        mine: list[int] = []
        if start == 0:
            for r, (a, b) in enumerate(balanced_bounds(upto, P)):
                self.owner.extend([r] * (b - a))
                self.counts[r] += b - a
            a, b = balanced_bounds(upto, P)[me]
            new = torch.arange(a, b, dtype=torch.int64)
        else:
            for pos in range(start, upto):
                r = min(range(P), key=lambda i: (self.counts[i], i))
                self.owner.append(r)
                self.counts[r] += 1
                if r == me:
                    mine.append(pos)
            new = torch.tensor(mine, dtype=torch.int64)
        # Positions grow incrementally (no O(N) rebuild or copy per decode step).
        if new.numel():
            self._positions.append(new)

    @property
    def seq_len(self) -> int:
        """Global number of tokens placed so far."""
        return len(self.owner)

    @property
    def positions(self) -> Tensor:
        """(n_local,) int64 on the CPU: the global positions of this rank's keys, ascending."""
        value = self._positions.value
        return torch.zeros(0, dtype=torch.int64) if value is None else value

    def positions_on(self, device: torch.device | str | None) -> Tensor:
        """:attr:`positions` on ``device``, from a mirror there that receives only the positions added since the
        last call: a decode step copies one token's position to the device, not the whole shard's (which every
        layer's mask slicing did, n_local x 8 bytes per layer and step)."""
        device = torch.device(device or "cpu")
        host = self.positions
        if device.type == "cpu":
            return host
        mirror = self._positions_dev.get(device)
        if mirror is None:
            mirror = self._positions_dev[device] = GrowingTensor(0)
        if mirror.length < host.numel():
            mirror.append(host[mirror.length:].to(device, non_blocking=False))
        return mirror.value if mirror.value is not None else host.to(device)

    def shard_lens(self) -> list[int]:
        return list(self.counts)

    def local_index(self, start: int, count: int) -> list[int]:
        """Indices into a block of ``count`` new tokens at global [start, start+count) that this rank owns."""
        r = self.group.rank
        return [i for i in range(count) if self.owner[start + i] == r]

    # ------------------------------------------------------------------------------------ storage
    def update(self, layer: int, key_states: Tensor, value_states: Tensor) -> tuple[Tensor, Tensor]:
        """Append new tokens (B, Hkv, t, D) of ``layer`` at the next global positions; keep the local ones.

        Returns the local shard (B, Hkv, n_local, D), (B, Hkv, n_local, Dv).
        """
        while len(self._keys) <= layer:
            self._keys.append(GrowingTensor(-2))
            self._values.append(GrowingTensor(-2))
            self.layer_len.append(0)
            self.returned_full.append(False)
        start, t = self.layer_len[layer], key_states.shape[-2]
        self._assign(start + t)
        idx = self.local_index(start, t)
        if len(idx) == t:
            k_new, v_new = key_states, value_states
        elif idx and idx == list(range(idx[0], idx[-1] + 1)):
            k_new, v_new = key_states[:, :, idx[0]:idx[-1] + 1], value_states[:, :, idx[0]:idx[-1] + 1]
        else:
            sel = torch.tensor(idx, dtype=torch.long, device=key_states.device)
            k_new, v_new = key_states.index_select(2, sel), value_states.index_select(2, sel)
        keys, values = self._keys[layer].append(k_new), self._values[layer].append(v_new)
        self.layer_len[layer] = start + t
        self._layer_at[self._keys[layer].storage.data_ptr()] = layer
        return keys, values

    def storage_of(self, k: Tensor, v: Tensor, attn_mask: Tensor | None = None
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor | None] | None:
        """When ``k``, ``v`` are exactly one layer's current local shard (the views :meth:`update` returned):
        that layer's storage (B, Hkv, capacity, D), (B, Hkv, capacity, Dv), the local length as a (B,) int32
        device tensor, and the mask (local columns, (Bm, Hm, L, n)) copied into a buffer with the storage's
        columns (Bm, Hm, L, capacity), or None without a mask. Attention over the storage with that valid length
        and mask gives the same result as over the shard. None when ``k``, ``v`` (or the mask) do not fit.

        The length tensor and the mask buffer are shared by all layers and refilled in stream order, so work
        already queued reads the values it was queued with."""
        layer = self._layer_at.get(k.data_ptr())
        if layer is None:
            return None
        gk, gv = self._keys[layer], self._values[layer]
        ks, vs = gk.storage, gv.storage
        if (ks is None or vs is None or ks.data_ptr() != k.data_ptr() or vs.data_ptr() != v.data_ptr()
                or k.shape != gk.value.shape or v.shape != gv.value.shape or k.stride() != ks.stride()
                or v.stride() != vs.stride()):
            return None
        B, n = k.shape[0], k.shape[2]
        mask_buf = None
        if attn_mask is not None:
            if attn_mask.dim() != 4 or attn_mask.shape[-1] != n or attn_mask.device != k.device:
                return None
            shape = tuple(attn_mask.shape[:-1]) + (ks.shape[2],)
            key = (attn_mask.dtype, shape)
            mask_buf = self._mask_bufs.get(key)
            if mask_buf is None:
                if len(self._mask_bufs) >= 4:  # older capacities: their storage is gone
                    self._mask_bufs.clear()
                mask_buf = self._mask_bufs[key] = torch.zeros(shape, dtype=attn_mask.dtype, device=k.device)
            mask_buf[..., :n].copy_(attn_mask)
        slot = self._local_len.get((k.device, B))
        if slot is None:
            slot = self._local_len[(k.device, B)] = [torch.full((B,), n, dtype=torch.int32, device=k.device), n]
        elif slot[1] != n:
            slot[0].fill_(n)
            slot[1] = n
        return ks, vs, slot[0], mask_buf

    @property
    def keys(self) -> list[Tensor | None]:
        """Per layer: the local keys (B, Hkv, n_local, D), a view of storage grown geometrically."""
        return [k.value for k in self._keys]

    @property
    def values(self) -> list[Tensor | None]:
        """Per layer: the local values (B, Hkv, n_local, Dv)."""
        return [v.value for v in self._values]

    def get_seq_length(self, layer: int = 0) -> int:
        return self.layer_len[layer] if layer < len(self.layer_len) else 0

    # ------------------------------------------------------------------------------------ masks
    def local_mask(self, attn_mask: Tensor | None) -> Tensor | None:
        """Slice a mask over the global keys (..., N_global) to the local keys (..., n_local)."""
        if attn_mask is None:
            return None
        pos = self.positions_on(attn_mask.device)
        if attn_mask.shape[-1] < self.seq_len:
            raise DistributedDecodeError(f"mask has {attn_mask.shape[-1]} key columns but the sharded cache holds "
                                         f"{self.seq_len} tokens")
        return attn_mask.index_select(-1, pos)

    def local_valid_len(self, valid_len: Tensor | None) -> Tensor | None:
        """Global valid lengths (B,) to local ones: the number of local keys at positions < valid_len[b]."""
        if valid_len is None:
            return None
        pos = self.positions_on(valid_len.device)
        return (pos[None, :] < valid_len.view(-1, 1)).sum(dim=1).to(valid_len.dtype)

    def causal_mask(self, q_len: int, device=None) -> Tensor:
        """Bottom-right causal mask (1, 1, L, n_local) bool for the last ``q_len`` global positions."""
        pos = self.positions_on(device)
        q_pos = torch.arange(self.seq_len - q_len, self.seq_len, device=pos.device)
        return (pos[None, :] <= q_pos[:, None])[None, None]


def adapt_mask(group: DistGroup, attn_mask: Tensor | None, k: Tensor) -> Tensor | None:
    """The mask the op received, in local columns: unchanged when it already matches ``k``, else sliced with
    the group's sharded cache; a clear error when neither applies."""
    if attn_mask is None or attn_mask.shape[-1] == k.shape[2]:
        return attn_mask
    if group.cache is not None and attn_mask.shape[-1] >= group.cache.seq_len:
        return group.cache.local_mask(attn_mask)
    raise DistributedDecodeError(
        f"mask has {attn_mask.shape[-1]} key columns but the local shard has {k.shape[2]} keys and no "
        f"ShardedKVCache is attached to {group.describe()} to map global columns to local ones")


def localize(group: DistGroup, q: Tensor, k: Tensor, attn_mask: Tensor | None, valid_len: Tensor | None,
             is_causal: bool) -> tuple[Tensor | None, Tensor | None, bool]:
    """Turn the op's mask arguments into local ones: (attn_mask, valid_len, is_causal).

    With a :class:`ShardedKVCache` attached to the group, ``valid_len`` and ``is_causal`` are global (they
    follow the global key positions) and a mask with global columns is sliced. Without one, the arguments
    are taken as local (``is_causal`` then means top-left over the local keys).
    """
    cache = group.cache
    attn_mask = adapt_mask(group, attn_mask, k)
    if cache is None or cache.positions.numel() != k.shape[2]:
        return attn_mask, valid_len, is_causal
    if valid_len is not None:
        valid_len = cache.local_valid_len(valid_len)
    if is_causal:
        L = q.shape[2]
        pos = cache.positions_on(q.device)
        causal = (pos[None, :] <= torch.arange(L, device=q.device)[:, None])[None, None]
        attn_mask = causal if attn_mask is None else (attn_mask & causal if attn_mask.dtype == torch.bool else
                                                      attn_mask.masked_fill(~causal, float("-inf")))
    return attn_mask, valid_len, False


# ============================================================================================ HF integration
DECODE_MAX_Q_LEN = 16
_HF_CACHE_CLASS = None


def hf_sharded_cache_class():
    """The ``ShardedDynamicCache`` class (a ``transformers.DynamicCache`` subclass), built on first use.

    Each layer keeps only its local shard (placement by a shared :class:`ShardedKVCache`). ``get_seq_length``
    and mask sizes are *global*, so position ids, RoPE and masks stay right. ``update`` returns:

    * for a prefill into an empty layer: the whole prompt's K/V (plain attention over it is exact, and the
      prompt's q_len == kv_len makes it a prefill site that attnopt leaves alone) while only the local part is
      stored;
    * for later steps of at most ``DECODE_MAX_Q_LEN`` tokens: the local shard, which the rewritten attention
      (tree or ring) consumes. A longer chunk into a non-empty cache raises (not supported).
    """
    global _HF_CACHE_CLASS
    if _HF_CACHE_CLASS is not None:
        return _HF_CACHE_CLASS
    from transformers.cache_utils import DynamicCache, DynamicLayer

    class ShardedLayer(DynamicLayer):
        def __init__(self, shards: ShardedKVCache, index: int):
            super().__init__()
            self.shards = shards
            self.index = index

        # Placement is Python bookkeeping (lists of owners); traced, it would be baked into guards and
        # recompile every step until dynamo's recompile limit falls back to eager (plain SDPA over the local
        # shard: wrong). So the update always runs eagerly, as a graph break.
        @torch._dynamo.disable
        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            start, t = self.shards.get_seq_length(self.index), key_states.shape[-2]
            if t > DECODE_MAX_Q_LEN and start > 0:
                raise DistributedDecodeError(
                    f"ShardedDynamicCache: a {t}-token chunk into a non-empty sharded cache ({start} tokens) is not "
                    f"supported; prefill once, then decode at most {DECODE_MAX_Q_LEN} tokens per step")
            self.keys, self.values = self.shards.update(self.index, key_states, value_states)
            full = start == 0  # the prompt: every rank has all of it, plain attention over it is exact
            self.shards.returned_full[self.index] = full
            if full:
                return key_states, value_states
            return self.keys, self.values

        def get_seq_length(self) -> int:
            return self.shards.get_seq_length(self.index)

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.get_seq_length() + query_length, 0

        def crop(self, tokens_to_remove: int) -> None:
            raise NotImplementedError("ShardedDynamicCache cannot be cropped")

    class ShardedDynamicCache(DynamicCache):
        """A ``DynamicCache`` holding only this rank's sequence shard (see ``hf_sharded_cache_class``)."""

        def __init__(self, num_layers: int, group: DistGroup | None = None):
            self.shards = ShardedKVCache(group)
            super().__init__()
            self.layers = [ShardedLayer(self.shards, i) for i in range(num_layers)]
            self.layer_class_to_replicate = None

        # The graph break sits here, at the cache's own update, rather than inside DynamicCache.update: the layer
        # index then reaches it as an argument, and with ``allow_unspec_int_on_nn_module`` (see
        # ``attnopt.api._never_eager_over_shards``) one compiled attention frame serves every layer instead of
        # one recompile per layer (dynamo guarded on ``self.layer_idx == i``).
        @torch._dynamo.disable
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            return self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)

    ShardedDynamicCache.__module__ = __name__
    _HF_CACHE_CLASS = ShardedDynamicCache
    return ShardedDynamicCache


def make_sharded_cache(model, group: Any = None):
    """A ``ShardedDynamicCache`` for a Hugging Face causal LM: pass it as ``past_key_values`` to ``generate``.

    ``group``: a :class:`DistGroup`, a ``ProcessGroup`` (registered here if it is not yet), or None for the
    current registered group. Make a new cache for every ``generate`` call.
    """
    if group is not None and not isinstance(group, DistGroup):
        group = register_group(group)
    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    return hf_sharded_cache_class()(cfg.num_hidden_layers, group)


def hf_sharded_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, *,
                         plan: Any = None, **kwargs):
    """A ``transformers.AttentionInterface`` function for models using ``ShardedDynamicCache``.

    Decode steps (q_len <= 16) run :func:`tree_decode` (or :func:`ring_decode` for a ``RingPlan``) over the local
    shard; prefill runs SDPA over the full prompt K/V that the cache returned. Register it with
    :func:`register_hf_attention` and load/set the model with ``attn_implementation="attnopt_sharded"``.

    Returns
    -------
    (attn_output (B, L, Hq, Dv), None), as every HF attention function.
    """
    import torch.nn.functional as F

    from attnopt.plan import RingPlan, TreePlan

    g = current_group()
    L = query.shape[2]
    layer = getattr(module, "layer_idx", None)
    full = L > DECODE_MAX_Q_LEN or (g.cache is not None and layer is not None and layer < len(g.cache.returned_full)
                                    and g.cache.returned_full[layer])
    if full:  # the prompt, over the whole prompt's K/V (the cache returned them all)
        causal = attention_mask is None and L == key.shape[2]
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                             is_causal=causal, enable_gqa=query.shape[1] != key.shape[1])
        return out.transpose(1, 2).contiguous(), None
    plan = plan or g.hf_plan or TreePlan(world=g.world)
    mask = adapt_mask(g, attention_mask, key)
    if mask is None and L > 1 and g.cache is not None:
        mask = g.cache.causal_mask(L, query.device)
    if isinstance(plan, RingPlan):
        out = ring_decode(query, key, value, g, variant=plan.variant, attn_mask=mask, scale=scaling,
                          shard_lens=g.cache.shard_lens() if g.cache is not None else None)
    else:
        out = tree_decode(query, key, value, g, collective=plan.collective, hierarchical=plan.hierarchical,
                          attn_mask=mask, scale=scaling, local=plan.local)
    return out.transpose(1, 2).contiguous(), None


def register_hf_shard_aware(model) -> str:
    """Register ``attnopt_shard_aware_<base>``: HF's ``base`` attention ("sdpa" or "eager") with the mask
    first cut to this rank's key columns when the keys are a shard (``torch.ops.attnopt.shard_mask_columns``).

    ``attnopt.optimize(model, process_group=...)`` switches the model to it. The mask HF builds follows the global
    key positions while a sharded cache hands attention the local keys; cut in the traced graph, the decode
    attention stays a well-formed SDPA over (local keys, local mask) that the pass rewrites into tree / ring
    decode. Without a shard (mask columns == keys) it is ``base`` itself, so an unsharded model is unchanged.
    """
    import sys

    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    from . import ops  # noqa: F401  (defines torch.ops.attnopt.shard_mask_columns)

    base = model.config._attn_implementation
    if base.startswith("attnopt_shard_aware_"):
        return base
    if base == "sdpa":
        from transformers.integrations.sdpa_attention import sdpa_attention_forward as base_fn
    elif base == "eager":
        # Each HF model file has its own eager attention (some add softcapping or sinks): use the model's.
        base_fn = getattr(sys.modules[type(model).__module__], "eager_attention_forward", None)
        if base_fn is None:
            raise ValueError(f"{type(model).__name__}: no eager_attention_forward in {type(model).__module__}; "
                             "load the model with attn_implementation='sdpa' for distributed decode")
    else:
        raise ValueError(f"distributed decode through attnopt.optimize supports the 'sdpa' and 'eager' attention "
                         f"implementations, not {base!r}")
    name = f"attnopt_shard_aware_{base}" if base == "sdpa" else f"attnopt_shard_aware_eager_{type(model).__module__}"

    def shard_aware(module, query, key, value, attention_mask, *args, **kwargs):
        if attention_mask is not None and attention_mask.shape[-1] != key.shape[-2]:
            attention_mask = torch.ops.attnopt.shard_mask_columns(attention_mask, key.shape[-2])
        return base_fn(module, query, key, value, attention_mask, *args, **kwargs)

    AttentionInterface.register(name, shard_aware)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])
    return name


def register_hf_attention(name: str = "attnopt_sharded") -> str:
    """Register :func:`hf_sharded_attention` (and SDPA's mask function) with transformers under ``name``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(name, hf_sharded_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, sdpa_mask)
    return name


__all__ = [
    "TREE_COLLECTIVES", "RING_VARIANTS", "LOCAL_KINDS", "DistributedDecodeError", "CollectiveError", "DistGroup",
    "register_group", "unregister_group", "get_group", "current_group", "use_group", "local_states",
    "combine_tree", "tree_decode", "ring_decode", "ring_pass_kv", "ring_pass_q", "merge_packed",
    "ShardedKVCache", "balanced_bounds", "adapt_mask", "hf_sharded_cache_class", "make_sharded_cache",
    "hf_sharded_attention", "register_hf_attention", "register_hf_shard_aware", "check_decode_shapes", "check_world", "localize",
    "tree_step", "step_graph_reason",
]
