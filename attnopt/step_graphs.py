"""Whole decode steps as single CUDA graphs: the host side of ``optimize(model, mode="reduce-overhead")``.

Inductor's CUDA-graph trees replay a decode step's kernels, but each call still runs about 1 ms of Python on the
host (the model's output wrappers, dynamo's frame, the trees' input checks; H100, SmolLM2's 30 layers,
``benchmarks/host_floor.py``), so a small model's step was host-bound: 2.2 ms against 1.4 ms for the same kernels
replayed as one graph. ``StepGraphs`` records one call of the compiled forward into one ``torch.cuda.CUDAGraph``
per call signature and replays it: copy the call's tensors into the graph's input buffers, replay, clone the
outputs.

A replay skips dynamo's guards, so what the graph baked in is checked at every call instead (the signature):

* every tensor argument's shape, dtype, strides and device (its values are copied in);
* the cache object and the addresses of its tensors (they are used in place: the graph writes the new keys and
  values into them, as the compiled forward does); a cache whose layers keep Python-side counters (HF's
  ``StaticSlidingWindowLayer``) is never recorded, since a replay would not advance them;
* the other arguments' values (ints, bools, strings, None);
* the addresses of the model's parameters and buffers, its training flag, grad mode, autocast, the model
  configuration flags that change the output's structure, and the number of forward hooks on its modules (and
  global ones): a hook added after a recording runs, through the compiled forward.

A call that differs in any of these runs the compiled forward as before and, once its own signature has been seen
``WARM_CALLS`` times, is recorded too; a new cache object under a recorded signature (``generate()`` makes one per
call) is recorded after one compiled call. A recording lives as long as its cache object (it pins the cache's
tensors), and at most ``MAX_RECORDED`` are kept. A call whose forward mutated one of its input tensors, or changed a
cache's Python state, is never recorded (a copy of the input would take the mutation instead), nor is an argument
that shares memory with the cache or the parameters replayed; those calls, and a signature whose recording failed
``RECORD_ATTEMPTS`` times (a sync inside the forward; one warning), run ``fallback`` (``optimize()`` passes
inductor's CUDA-graph trees).
Recording a signature happens after it has run compiled (its kernels compiled, its states prepared) and costs no
extra forward (the recording runs nothing; the first replay is that call's forward).
"""
from __future__ import annotations

import gc
import logging
import operator
import warnings
import weakref
from collections import Counter
from typing import Any, Callable

import torch

log = logging.getLogger("attnopt")

#: Compiled calls of one signature before it is recorded: the first compiles, the second runs warm.
WARM_CALLS = 2
#: Recordings tried per signature before it is refused (a failure may be transient).
RECORD_ATTEMPTS = 3
#: Recorded graphs kept at once (each pins its caches' tensors and a share of the graphs' memory pool).
MAX_RECORDED = 8
#: Configuration flags of a Hugging Face model that change what a forward returns.
_CONFIG_FLAGS = ("output_attentions", "output_hidden_states", "use_cache", "return_dict", "_attn_implementation")
_PLAIN = (int, float, bool, str, type(None))


class _Uncapturable(Exception):
    """This call cannot be keyed or replayed (an argument of an unknown kind, grad mode on, a CPU tensor)."""


class _Recorded:
    """One signature's graph: its input buffers, its outputs, and what must not have moved since.

    ``pinned`` keeps the recorded cache's, parameters' and buffers' tensors alive, so no later tensor can take their
    addresses; each call compares the addresses of the tensors the model and the cache hold *now* with them."""

    def __init__(self, graph, inputs, output, model: torch.nn.Module, caches: list[Any], call_counts: Counter):
        self.graph = graph
        self.inputs = inputs            # the buffers the call's tensors are copied into, in signature order
        self.output = output            # the forward's output during recording (tensors: the graph's buffers)
        self.call_counts = call_counts  # attnopt op calls per site in one forward (replays add them)
        modules = list(model.modules())
        self.child_dicts = [m._modules for m in modules]  # a submodule swapped in since: its parent's dict changed
        self.children = _children(self.child_dicts)
        self.slots = [(d, name) for m in modules for d in (m._parameters, m._buffers) for name, t in d.items()
                      if t is not None]
        # the caches' layer objects (one replaced: its slots below would be stale) and their tensor attributes (not the
        # cache objects: a recording must not keep its cache alive)
        self.cache_layers = [tuple(getattr(c, "layers", ())) for c in caches]
        self.cache_slots = [(vars(o), name) for c in caches for o in (c, *getattr(c, "layers", ()))
                            for name, v in vars(o).items() if isinstance(v, torch.Tensor)]
        self.pinned = self.current_tensors()
        self.pinned_ptrs = _addresses(self.pinned)
        self.pinned_storages = {t.untyped_storage().data_ptr() for t in self.pinned}
        self.pinned_indices = list(range(len(self.pinned)))

    def current_tensors(self) -> list[torch.Tensor]:
        """The parameters, buffers and cache tensors the model and the caches hold now, in recording order
        (``KeyError`` where one was deleted)."""
        return [d[name] for d, name in self.slots] + [d[name] for d, name in self.cache_slots]

    def unchanged(self, caches: list[Any]) -> bool:
        """Whether the model's modules, parameters, buffers and the cache's tensors are where the graph reads them.
        Runs at every replay: the comparisons are C-level maps (a Python loop over SmolLM2's 460 module dicts and
        its cache's 90 attributes cost about 0.5 ms a token on the H100 host, cProfile of generate() at 20eb6d4)."""
        if _children(self.child_dicts) != self.children:
            return False
        for cache, layers in zip(caches, self.cache_layers):
            now = getattr(cache, "layers", ())
            if len(now) != len(layers) or not all(map(operator.is_, now, layers)):
                return False
        try:
            tensors = self.current_tensors()
        except KeyError:  # a parameter, buffer or cache tensor deleted since
            return False
        if any(t is None for t in tensors):
            return False
        if _ADDRESSES_EQUAL is not None:
            return _ADDRESSES_EQUAL(tensors, self.pinned_ptrs, self.pinned_indices)
        return _addresses(tensors) == self.pinned_ptrs


def _children(child_dicts: list[dict]) -> tuple:
    """Every module dict's values, as tuples (compared by identity: modules define no ``__eq__``)."""
    return tuple(map(tuple, map(dict.values, child_dicts)))


class StepGraphs:
    """Record and replay whole forward calls of ``compiled`` (the attnopt-compiled forward of ``model``).

    ``__call__(args, kwargs)`` returns the forward's output, from a replay when the signature is recorded.
    ``on_replay()`` runs at each replay (the backend counts it as a call of its graphs). ``fallback`` runs the calls
    that are never recorded (an argument of an unknown kind, grad mode, a mutating forward, a cache with Python-side
    counters, a failed recording); by default ``compiled``.
    """

    def __init__(self, compiled: Callable, model: torch.nn.Module, on_replay: Callable[[], None],
                 graphs: "CudaGraphs | None" = None, fallback: Callable | None = None):
        self.compiled = compiled
        self.fallback = fallback or compiled  # calls that are never recorded (inductor's CUDA-graph trees, say)
        self.model = model
        self.on_replay = on_replay
        self.graphs = graphs or CudaGraphs()
        self.recorded: dict[tuple, _Recorded] = {}  # by (signature, the ids of its caches); oldest first
        self.refused: set[tuple] = set()             # signatures that are never recorded
        self.failures: Counter[tuple] = Counter()    # failed recordings per signature
        self.seen: Counter[tuple] = Counter()        # compiled calls per signature, and per signature and caches
        self.replays = 0
        self.fallbacks: Counter[str] = Counter()     # calls not replayed, by reason (diagnostics)
        self._warned = False
        # forward hooks run in Python around modules: a hook added or removed after a recording (a steering vector,
        # an activation probe) must not be skipped by a replay, so their count is part of every signature
        from torch.nn.modules import module as nn_module

        self._global_hooks = [nn_module._global_forward_hooks, nn_module._global_forward_pre_hooks]
        self._find_hooks()

    def _find_hooks(self) -> None:
        """The hook dicts of the model's modules as they are now (again after a submodule is swapped in)."""
        modules = self.model.modules()
        self._hook_dicts = self._global_hooks + [d for m in modules for d in (m._forward_hooks, m._forward_pre_hooks)]

    # -- the signature -------------------------------------------------------------------------------------
    def _state_key(self) -> tuple:
        config = getattr(self.model, "config", None)
        flags = tuple(getattr(config, name, None) for name in _CONFIG_FLAGS) if config is not None else ()
        cuda_autocast = torch.is_autocast_enabled("cuda")
        return (self.model.training, torch.is_inference_mode_enabled(), cuda_autocast,
                torch.get_autocast_dtype("cuda") if cuda_autocast else None, flags, sum(map(len, self._hook_dicts)))

    def _key(self, args: tuple, kwargs: dict) -> tuple[tuple, list[torch.Tensor], list[Any]]:
        """(signature, the tensors to copy in, the caches used in place) of one call."""
        if torch.is_grad_enabled():
            raise _Uncapturable("grad mode is on")
        tensors: list[torch.Tensor] = []
        caches: list[Any] = []
        parts: list[Any] = [self._state_key()]

        def visit(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                if value.device.type != self.graphs.device_type or value.requires_grad:
                    raise _Uncapturable(f"a tensor argument on {value.device.type} or requiring grad")
                tensors.append(value)
                return ("T", tuple(value.shape), value.dtype, value.stride(), value.device.index)
            if isinstance(value, _PLAIN):
                return value
            if isinstance(value, (tuple, list)):
                return (type(value).__name__, tuple(visit(v) for v in value))
            if isinstance(value, dict):
                return ("dict", tuple((k, visit(v)) for k, v in sorted(value.items())))
            if getattr(value, "is_compileable", False) and hasattr(value, "layers"):
                caches.append(value)
                return ("cache", type(value).__name__, len(caches) - 1)
            raise _Uncapturable(f"an argument of type {type(value).__name__}")

        parts.append(tuple(visit(a) for a in args))
        parts.append(tuple((k, visit(v)) for k, v in sorted(kwargs.items())))
        return tuple(parts), tensors, caches

    # -- calls ---------------------------------------------------------------------------------------------
    def __call__(self, args: tuple, kwargs: dict) -> Any:
        """One forward call. A signature is recorded after ``WARM_CALLS`` compiled calls; a new cache object of a
        recorded signature (``generate()`` makes one per call) after one; a graph whose model or cache tensors moved
        is dropped and recorded again after one."""
        try:
            key, tensors, caches = self._key(args, kwargs)
        except _Uncapturable as e:
            return self._fall_back(str(e), args, kwargs)
        if key in self.refused:
            return self._fall_back("signature refused", args, kwargs)
        full = (key, tuple(map(id, caches)))
        entry = self.recorded.get(full)
        if entry is not None:
            if entry.unchanged(caches):
                if any(t.untyped_storage().data_ptr() in entry.pinned_storages for t in tensors):
                    # an argument that is a view of the cache or a parameter: a copy of it would not see the
                    # forward's writes to the cache, as the original does
                    return self._fall_back("an argument shares memory with the cache or a parameter", args, kwargs)
                return self._replay(entry, tensors, caches)
            del self.recorded[full]  # a cache re-allocated or a parameter replaced: one compiled call, then again
            self.seen[full] = 0
            self._find_hooks()  # (a swapped-in module brings hook dicts of its own)
        warm = self.seen[key] >= WARM_CALLS and self.seen[full] >= 1
        if not warm:
            self.seen[key] += 1
            self.seen[full] += 1
            return self._compiled_call(key, args, kwargs, tensors, caches)
        return self._record(key, full, args, kwargs, tensors, caches)

    def _fall_back(self, reason: str, args: tuple, kwargs: dict) -> Any:
        self.fallbacks[reason] += 1
        return self.fallback(*args, **kwargs)

    def _compiled_call(self, key, args, kwargs, tensors, caches) -> Any:
        """A compiled call that also learns whether this signature may be recorded."""
        versions = [t._version for t in tensors]
        before = [_python_state(c) for c in caches]
        out = self.compiled(*args, **kwargs)
        if any(t._version != v for t, v in zip(tensors, versions)):
            self._refuse(key, "the forward mutates one of its input tensors")
        elif any(_python_state(c) != b for c, b in zip(caches, before)):
            self._refuse(key, f"the cache ({type(caches[0]).__name__}) keeps Python-side state that a replay "
                              "would not advance")
        return out

    def _refuse(self, key: tuple, reason: str) -> None:
        self.refused.add(key)
        log.info("attnopt: decode step not recorded as one CUDA graph: %s", reason)

    def _replay(self, entry: _Recorded, tensors: list[torch.Tensor], caches: list[Any], count_ops: bool = True) -> Any:
        """Copy the call's tensors in, replay, clone the outputs out. ``count_ops``: add the recording's attnopt op
        calls to ``CALL_COUNTS`` (not at the replay that serves the recording's own call, whose ops counted then)."""
        if tensors:
            torch._foreach_copy_(entry.inputs, tensors)
        self.graphs.replay(entry.graph)
        self.replays += 1
        self.on_replay()
        if count_ops:
            _add_counts(entry.call_counts)
        return _cloned(entry.output, caches)

    def _record(self, key, full, args, kwargs, tensors, caches) -> Any:
        from attnopt.runtime.ops import CALL_COUNTS

        inputs = [t.clone() for t in tensors]
        swap = dict(zip(map(id, tensors), inputs))
        rec_args = _substitute(args, swap)
        rec_kwargs = _substitute(kwargs, swap)
        counts_before = Counter(CALL_COUNTS)
        try:
            graph, output = self.graphs.record(lambda: self.compiled(*rec_args, **rec_kwargs))
        except Exception as e:  # noqa: BLE001 - any failure to record means: run compiled, as before
            reason = f"recording failed: {type(e).__name__}: {str(e)[:200]}"
            self.failures[key] += 1
            if self.failures[key] < RECORD_ATTEMPTS:
                # maybe transient (H100, 6 benchmark processes on one GPU: one of many signatures failed once, and
                # the same run alone recorded it): this call runs compiled, the next one tries again
                log.info("attnopt: %s; trying again at the next call", reason)
                self.fallbacks[reason + " (ran compiled; tried again next call)"] += 1
                return self._compiled_call(key, args, kwargs, tensors, caches)
            self._refuse(key, reason)
            if not self._warned:
                self._warned = True
                warnings.warn(f"attnopt: a decode step could not be recorded as one CUDA graph and runs through the "
                              f"fallback forward ({type(e).__name__}: {str(e)[:200]})", RuntimeWarning, stacklevel=3)
            return self._fall_back(reason, args, kwargs)
        delta = Counter(CALL_COUNTS)
        delta.subtract(counts_before)
        entry = _Recorded(graph, inputs, _without(output, caches), self.model, caches, +delta)
        self._keep(full, entry, caches)
        log.info("attnopt: recorded a decode step as one CUDA graph (%d input tensors)", len(inputs))
        # the recording ran no kernel: this call's forward is the first replay
        return self._replay(entry, tensors, caches, count_ops=False)

    def _keep(self, full: tuple, entry: _Recorded, caches: list[Any]) -> None:
        """Keep ``entry`` while its caches live (a recording pins their tensors: ``generate()`` makes a cache per call,
        and each would stay allocated), and at most ``MAX_RECORDED`` entries, the oldest going first."""
        self.recorded[full] = entry
        owner = weakref.ref(self)
        for cache in caches:
            weakref.finalize(cache, _forget, owner, full)
        while len(self.recorded) > MAX_RECORDED:
            oldest = next(iter(self.recorded))
            del self.recorded[oldest]
            self.seen.pop(oldest, None)


def _forget(owner: "weakref.ref[StepGraphs]", full: tuple) -> None:
    steps = owner()
    if steps is not None:
        steps.recorded.pop(full, None)
        steps.seen.pop(full, None)


class CudaGraphs:
    """How ``StepGraphs`` records and replays: CUDA graphs in one memory pool shared by all of its signatures (they
    never run at once, and every output a graph keeps stays allocated). Tests on the CPU pass a stand-in."""

    device_type = "cuda"

    def __init__(self) -> None:
        self._pool = None

    def record(self, fn: Callable[[], Any]) -> tuple[Any, Any]:
        """(graph, fn's output): ``fn`` recorded, not run; the output's tensors live in the graph's memory."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        # No garbage collection during the capture: a collection there can free an object that owns CUDA memory
        # of another pool (a tuner's timing graph, its input sets), whose release may call cudaFree from this very
        # thread and invalidate the capture. The suspect (not proven) of an intermittent failure on the H100:
        # cudaErrorStreamCaptureInvalidated in generate()'s recording with no other thread of ours alive and
        # capture_error_mode="thread_local" (8936801); none in the next run with this (e052280). No gc.collect()
        # first: it took 0.6-0.8 s a recording there (in a cProfile of generate()); the garbage can wait.
        collecting = gc.isenabled()
        gc.disable()
        try:
            # thread_local: a CUDA call that another thread of this process makes meanwhile (a Triton compile
            # loading its module) must not invalidate this capture; inductor's CUDA-graph trees capture the same way
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                output = fn()
        except Exception:
            self._abandon_pool()
            raise
        finally:
            if collecting:
                gc.enable()
        return graph, output

    def _abandon_pool(self) -> None:
        """After a failed capture: PyTorch skips ending the allocator's routing into the pool when the capture ends
        in an error, and every later capture into that pool then failed ("beginAllocateToPool: already recording
        to mempool_id"; H100, torch 2.11, a retried recording). End it, and record later graphs in a new pool (the
        recorded graphs keep theirs)."""
        end = getattr(torch._C, "_cuda_endAllocateToPool", None)
        if end is not None:
            try:
                end(torch.cuda.current_device(), self._pool)
            except Exception:  # noqa: BLE001 - nothing was routing any more: fine
                pass
        self._pool = None

    def replay(self, graph: Any) -> None:
        graph.replay()


def _addresses(tensors: list[torch.Tensor]) -> list[int]:
    return [t.data_ptr() for t in tensors]


#: PyTorch's C++ comparison of many tensors' addresses (CUDA builds; what inductor's CUDA-graph trees use): about
#: 100x faster than the Python loop, which costs about 0.1 ms per call over SmolLM2's 365 parameters and cache tensors.
_ADDRESSES_EQUAL = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)



def _python_state(cache: Any) -> tuple:
    """The cache's and its layers' plain Python attributes (ints, bools, ...): what a replay cannot change."""
    objs = [cache, *getattr(cache, "layers", ())]
    return tuple(tuple(sorted((k, v) for k, v in vars(o).items() if isinstance(v, _PLAIN))) for o in objs)


def _substitute(value: Any, swap: dict[int, torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return swap.get(id(value), value)
    if isinstance(value, tuple):
        return tuple(_substitute(v, swap) for v in value)
    if isinstance(value, list):
        return [_substitute(v, swap) for v in value]
    if isinstance(value, dict):
        return {k: _substitute(v, swap) for k, v in value.items()}
    return value


class _CacheSlot:
    """Where a recorded output held the call's cache object (``past_key_values``): the entry keeps no reference to
    the cache, which would keep it alive (and its recording with it)."""

    def __init__(self, index: int):
        self.index = index


def _without(output: Any, caches: list[Any]) -> Any:
    """``output`` with each of ``caches`` replaced by a ``_CacheSlot``."""
    for i, cache in enumerate(caches):
        if output is cache:
            return _CacheSlot(i)
    if isinstance(output, (tuple, list)) and not hasattr(output, "keys"):
        return type(output)(_without(v, caches) for v in output)
    if hasattr(output, "keys") and hasattr(output, "__getitem__"):
        return _rebuilt(output, {k: _without(output[k], caches) for k in output.keys()})
    return output


def _cloned(output: Any, caches: list[Any]) -> Any:
    """A recorded output for the caller: every tensor cloned out of the graph's memory (the next replay overwrites
    it), the call's cache objects put back."""
    if isinstance(output, torch.Tensor):
        return output.clone()
    if isinstance(output, _CacheSlot):
        return caches[output.index]
    if isinstance(output, (tuple, list)) and not hasattr(output, "keys"):
        return type(output)(_cloned(v, caches) for v in output)
    if hasattr(output, "keys") and hasattr(output, "__getitem__"):  # HF ModelOutput (an OrderedDict) or a dict
        return _rebuilt(output, {k: _cloned(output[k], caches) for k in output.keys()})
    return output


def _rebuilt(like: Any, fields: dict) -> Any:
    """An object of ``like``'s mapping type with ``fields`` (a plain dict where the type takes no such keywords)."""
    try:
        return type(like)(**fields)
    except TypeError:
        return fields


def _add_counts(counts: Counter) -> None:
    if counts:
        from attnopt.runtime.ops import CALL_COUNTS

        CALL_COUNTS.update(counts)
