"""Step graphs: a tree decode step, or its combine, captured once in a CUDA graph and replayed (NCCL on CUDA).

* :class:`_CombineGraph`: the all-gather of the packed [o | m | log l] states and the merge;
* :class:`_StepGraph`: the whole step, split-KV over the local shard writing straight into the packed buffer,
  the all-gather and the merge.

:func:`_graph_entry` is the protocol both share: the first call of a key runs eagerly, the second captures, later
ones replay; a capture records the collective without running it, so every call issues exactly one all-gather on
every rank, eager or replayed, and ranks may capture on different calls. Replays are timed by ``watchdog.py``.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import Tensor

from .groups import DistGroup
from .local import PACKED_EXTRA, _local_plan, _pack, _triton_merge_available, single_device_strategy
from .watchdog import _ReplayWatchdog


def _env_count(name: str, default: int) -> int:
    """A count >= 0 from the environment variable ``name`` (``default`` when unset); a bad value names it."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        count = int(raw)
    except ValueError:
        count = -1
    if count < 0:
        raise ValueError(f"environment variable {name}={raw!r} is not a whole number >= 0 (default {default})")
    return count


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
        self.packed = torch.zeros(shape[:-1] + (shape[-1] + PACKED_EXTRA,), dtype=torch.float32, device=dev)
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
        from ..kernels.merge import merge_states as triton_merge_states

        dist.all_gather_into_tensor(self.parts.view((-1,) + tuple(self.packed.shape[1:])), self.packed,
                                    group=self.g.pg)
        triton_merge_states(self.parts[..., :-2], self.parts[..., -2], out=self.out,
                            lse_out=self.lse if self.lse is not None else False, log_l_parts=self.parts[..., -1])

    def __call__(self, o: Tensor, m: Tensor, log_l: Tensor) -> tuple[Tensor, Tensor | None]:
        _pack(o, m, log_l, self.packed)  # [o | m | log l]: the row max and log l apart (see local.py)
        self.graph.replay()
        stream = self.stream if torch._C._cuda_getCurrentRawStream(self.device_index) == self.raw_stream else None
        self.g._watch.watch("tree all_gather + merge", stream)
        return self.out.clone(), (self.lse.clone() if self.lse is not None else None)


def graph_combine_enabled() -> bool:
    """``ATTNOPT_TREE_GRAPH=0`` turns the replayed combine off (eager ops instead)."""
    return os.environ.get("ATTNOPT_TREE_GRAPH", "1") != "0"


def _replayed_combine(g: "DistGroup", o: Tensor, m: Tensor, log_l: Tensor, out_dtype: torch.dtype | None,
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
                        lambda entry: entry(o, m, log_l))


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
MAX_STEP_GRAPHS = _env_count("ATTNOPT_TREE_STEP_GRAPHS", 256)


class _StepGraph:
    """A whole tree decode step captured in one CUDA graph: split-KV over the local shard writing its (o, m, log l)
    straight into the packed [o | m | log l] buffer, the all-gather, and the merge.

    The graph reads K, V, the valid length and the mask where they lie (they are part of the key: a static cache,
    or a sharded cache's storage between regrowths, keeps them in place) and the query from a static buffer it
    is copied into. On the host a call is that copy, one replay, the watchdog event and a clone of the output.
    """

    def __init__(self, g: "DistGroup", q: Tensor, k: Tensor, v: Tensor, valid_len: Tensor | None,
                 attn_mask: Tensor | None, is_causal: bool, scale: float, out_dtype: torch.dtype, with_lse: bool):
        from ..kernels.merge import merge_states as triton_merge_states
        from ..kernels.split_kv import split_kv_decode
        strategy = single_device_strategy("split_kv")
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
        width = Dv + PACKED_EXTRA  # [o | m | log l]
        packed = torch.zeros((B, Hq, L, width), dtype=torch.float32, device=dev)
        parts = torch.zeros((g.world, B, Hq, L, width), dtype=torch.float32, device=dev)
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
            # the (2, B, Hq, L) view of the packed row max and log l columns: the kernel writes them apart
            split_kv_decode(self.q, k, v, packed[..., :-2], packed[..., -2:].movedim(-1, 0),
                            workspace=state.workspace, attn_mask=attn_mask, valid_len=valid_len,
                            is_causal=is_causal, scale=scale, num_splits=plan.num_splits, block_n=plan.block_n, num_warps=plan.num_warps,
                            num_stages=plan.num_stages, fused_merge=plan.fused_merge, tma=plan.tma)
            dist.all_gather_into_tensor(parts.view(-1, Hq, L, width), packed, group=g.pg)
            triton_merge_states(parts[..., :-2], parts[..., -2], out=self.out,
                                lse_out=self.lse if self.lse is not None else False, log_l_parts=parts[..., -1])

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
    from ..strategies.split_kv import KERNEL_DTYPES, KERNEL_HEAD_DIMS, MAX_Q_LEN

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

