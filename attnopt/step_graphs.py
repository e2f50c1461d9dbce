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
* the model's modules, parameters and buffers (the objects and their addresses), its training flag, grad mode,
  autocast and its configuration's attributes (a change there records again, as dynamo would recompile);
* no forward hooks on its modules, and no global ones: a hook is Python that a replay would skip, so a call while
  one is registered runs ``fallback`` (Hugging Face's output-capturing hooks excepted, in calls that ask for no
  attentions or hidden states: they do nothing there; ``step_graphs_entry.blocking_hook``).

The call that replays the same recording as the last one takes a fast path: its arguments are compared with the
recording's flat template and the model with the recording's flat lists of containers and objects, C-level passes
(``attnopt.step_graphs_entry``); any other call builds its full signature as before.

A call that differs in any of these runs the compiled forward as before and, once its own signature has been seen
``WARM_CALLS`` times, is recorded too; a new cache object under a known signature (``generate()`` makes one per
call) is recorded at its first call when its Python state (sizes, flags) is one a compiled call of that signature
ran over and left unchanged, else after one compiled call. A recording lives as long as its cache object (it pins the cache's
tensors), and at most ``MAX_RECORDED`` are kept. A call whose forward mutated one of its input tensors, or changed a
cache's Python state, is never recorded (a copy of the input would take the mutation instead), nor is an argument
that shares memory with the cache or the parameters replayed; those calls, and a signature whose recording failed
``RECORD_ATTEMPTS`` times (a sync inside the forward; one warning), run ``fallback`` (``optimize()`` passes
inductor's CUDA-graph trees).
Recording a signature happens after it has run compiled (its kernels compiled, its states prepared) and costs no
extra forward (the recording runs nothing; the first replay is that call's forward).
"""
from __future__ import annotations

import logging
import warnings
import weakref
from collections import Counter
from typing import Any, Callable

import torch

from .step_graphs_cuda import CudaGraphs
from .step_graphs_entry import (PLAIN, RecordedStep, blocking_hook, cloned, global_state, hook_dicts,
                                 without_caches)

__all__ = ["StepGraphs", "CudaGraphs", "WARM_CALLS", "RECORD_ATTEMPTS", "MAX_RECORDED"]

log = logging.getLogger("attnopt")

#: Compiled calls of one signature before it is recorded: the first compiles, the second runs warm.
WARM_CALLS = 2
#: Recordings tried per signature before it is refused (a failure may be transient).
RECORD_ATTEMPTS = 3
#: Recorded graphs kept at once (each pins its caches' tensors and a share of the graphs' memory pool).
MAX_RECORDED = 8
#: Configuration flags of a Hugging Face model that change what a forward returns (part of the signature).
_CONFIG_FLAGS = ("output_attentions", "output_hidden_states", "use_cache", "return_dict", "_attn_implementation")


class _Uncapturable(Exception):
    """This call cannot be keyed or replayed (an argument of an unknown kind, grad mode on, a CPU tensor)."""


class StepGraphs:
    """Record and replay whole forward calls of ``compiled`` (the attnopt-compiled forward of ``model``).

    ``__call__(args, kwargs)`` returns the forward's output, from a replay when the signature is recorded.
    ``on_replay()`` runs at each replay (the backend counts it as a call of its graphs). ``fallback`` runs the calls
    that are never recorded (an argument of an unknown kind, grad mode, a mutating forward, a cache with Python-side
    counters, a forward hook, a failed recording); by default ``compiled``.
    """

    def __init__(self, compiled: Callable, model: torch.nn.Module, on_replay: Callable[[], None],
                 graphs: "CudaGraphs | None" = None, fallback: Callable | None = None):
        self.compiled = compiled
        self.fallback = fallback or compiled  # calls that are never recorded (inductor's CUDA-graph trees, say)
        self.model = model
        self.on_replay = on_replay
        self.graphs = graphs or CudaGraphs()
        self.recorded: dict[tuple, RecordedStep] = {}  # by (signature, the ids of its caches); oldest first
        self.refused: set[tuple] = set()               # signatures that are never recorded
        self.failures: Counter[tuple] = Counter()      # failed recordings per signature
        self.seen: Counter[tuple] = Counter()          # compiled calls per signature, and per signature and caches
        self.replays = 0
        self.fallbacks: Counter[str] = Counter()       # calls not replayed, by reason (diagnostics)
        self._hot: RecordedStep | None = None          # the recording replayed last: the fast path's candidate
        self._verified: dict[tuple, list] = {}         # per signature: caches' Python state a compiled call kept
        self._call_counts: Counter | None = None       # runtime.ops.CALL_COUNTS, once a recording imported it
        self._warned = False
        self._hook_dicts = hook_dicts(model)           # again after a submodule is swapped in, and at each recording

    # -- the signature -------------------------------------------------------------------------------------
    def _state_key(self) -> tuple:
        config = getattr(self.model, "config", None)
        flags = tuple(getattr(config, name, None) for name in _CONFIG_FLAGS) if config is not None else ()
        return global_state(self.model), flags

    def _key(self, args: tuple, kwargs: dict) -> tuple[tuple, list[torch.Tensor], list[Any]]:
        """(signature, the tensors to copy in, the caches used in place) of one call. Keyword arguments are taken in
        the call's order (the tensors' order then matches ``RecordedStep.match``; another order is another key)."""
        if torch.is_grad_enabled():
            raise _Uncapturable("grad mode is on")
        tensors: list[torch.Tensor] = []
        caches: list[Any] = []

        def visit(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                if value.device.type != self.graphs.device_type or value.requires_grad:
                    raise _Uncapturable(f"a tensor argument on {value.device.type} or requiring grad")
                tensors.append(value)
                return ("T", tuple(value.shape), value.dtype, value.stride(), value.device.index)
            if isinstance(value, PLAIN):
                return value
            if isinstance(value, (tuple, list)):
                return (type(value).__name__, tuple(visit(v) for v in value))
            if isinstance(value, dict):
                return ("dict", tuple((k, visit(v)) for k, v in sorted(value.items())))
            if getattr(value, "is_compileable", False) and hasattr(value, "layers"):
                caches.append(value)
                return ("cache", type(value).__name__, len(caches) - 1)
            raise _Uncapturable(f"an argument of type {type(value).__name__}")

        key = (self._state_key(), tuple(visit(a) for a in args), tuple((k, visit(v)) for k, v in kwargs.items()))
        return key, tensors, caches

    # -- calls ---------------------------------------------------------------------------------------------
    def __call__(self, args: tuple, kwargs: dict) -> Any:
        """One forward call. A signature is recorded after ``WARM_CALLS`` compiled calls; a new cache object of a
        known signature (``generate()`` makes one per call) at once if a compiled call saw its state, else after one;
        a graph whose model or cache moved is dropped and recorded again after one."""
        hot = self._hot
        if hot is not None:  # the fast path: the recording replayed last, its flat template and lists
            matched = hot.match(args, kwargs)
            if matched is not None and global_state(self.model) == hot.state and hot.unchanged() \
                    and not hot.shares_memory(matched[0]):
                return self._replay(hot, *matched)
        try:
            key, tensors, caches = self._key(args, kwargs)
        except _Uncapturable as e:
            return self._fall_back(str(e), args, kwargs)
        if key in self.refused:
            return self._fall_back("signature refused", args, kwargs)
        full = (key, tuple(map(id, caches)))
        entry = self.recorded.get(full)
        if entry is not None:
            if entry.unchanged():
                if entry.shares_memory(tensors):
                    return self._fall_back("an argument shares memory with the cache or a parameter", args, kwargs)
                self._hot = entry
                return self._replay(entry, tensors, caches)
            self._drop(full)  # a cache re-allocated, a parameter replaced, a hook added: one call, then again
            self.seen[full] = 0
            self._verified.pop(key, None)  # (dynamo may recompile for what changed: never inside a recording)
            self._hook_dicts = hook_dicts(self.model)  # (a swapped-in module brings hook dicts of its own)
        if blocking_hook(self._hook_dicts, kwargs, getattr(self.model, "config", None)):
            return self._fall_back("a forward hook is registered (a replay would skip it)", args, kwargs)
        warm = self.seen[key] >= WARM_CALLS and (self.seen[full] >= 1 or self._known_state(key, caches))
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
        else:
            self._verified[key] = before
        return out

    def _known_state(self, key: tuple, caches: list[Any]) -> bool:
        """Whether a compiled call of this signature ran over caches in exactly this Python state (sizes, flags) and
        left it unchanged: a new cache object in that state (``generate()`` makes one per call) is recorded at its
        first call, without a compiled call of its own first."""
        verified = self._verified.get(key)
        return verified is not None and [_python_state(c) for c in caches] == verified

    def _refuse(self, key: tuple, reason: str) -> None:
        self.refused.add(key)
        for full in [f for f in self.recorded if f[0] == key]:  # (recorded with another cache: never again)
            self._drop(full)
        log.info("attnopt: decode step not recorded as one CUDA graph: %s", reason)

    def _drop(self, full: tuple) -> None:
        entry = self.recorded.pop(full, None)
        if entry is not None and entry is self._hot:
            self._hot = None

    def _replay(self, entry: RecordedStep, tensors: list[torch.Tensor], caches: list[Any],
                count_ops: bool = True) -> Any:
        """Copy the call's tensors in, replay, clone the outputs out. ``count_ops``: add the recording's attnopt op
        calls to ``CALL_COUNTS`` (not at the replay that serves the recording's own call, whose ops counted then)."""
        if tensors:
            torch._foreach_copy_(entry.inputs, tensors)
        self.graphs.replay(entry.graph)
        self.replays += 1
        self.on_replay()
        if count_ops and entry.count_items:
            counts = self._call_counts
            for site, n in entry.count_items:
                counts[site] += n
        return cloned(entry.output, caches)

    def _record(self, key, full, args, kwargs, tensors, caches) -> Any:
        from attnopt.runtime.ops import CALL_COUNTS

        self._call_counts = CALL_COUNTS
        self._hook_dicts = hook_dicts(self.model)
        if blocking_hook(self._hook_dicts, kwargs, getattr(self.model, "config", None)):
            return self._fall_back("a forward hook is registered (a replay would skip it)", args, kwargs)
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
        entry = RecordedStep(graph, inputs, without_caches(output, caches), self.model, caches, +delta, args, kwargs)
        self._keep(full, entry, caches)
        log.info("attnopt: recorded a decode step as one CUDA graph (%d input tensors)", len(inputs))
        # the recording ran no kernel: this call's forward is the first replay
        return self._replay(entry, tensors, caches, count_ops=False)

    def _keep(self, full: tuple, entry: RecordedStep, caches: list[Any]) -> None:
        """Keep ``entry`` while its caches live (a recording pins their tensors: ``generate()`` makes a cache per call,
        and each would stay allocated), and at most ``MAX_RECORDED`` entries, the oldest going first."""
        self.recorded[full] = entry
        self._hot = entry
        owner = weakref.ref(self)
        for cache in caches:
            weakref.finalize(cache, _forget, owner, full)
        while len(self.recorded) > MAX_RECORDED:
            oldest = next(iter(self.recorded))
            self._drop(oldest)
            self.seen.pop(oldest, None)


def _forget(owner: "weakref.ref[StepGraphs]", full: tuple) -> None:
    steps = owner()
    if steps is not None:
        steps._drop(full)
        steps.seen.pop(full, None)


def _python_state(cache: Any) -> tuple:
    """The cache's and its layers' plain Python attributes (ints, bools, ...): what a replay cannot change."""
    objs = [cache, *getattr(cache, "layers", ())]
    return tuple(tuple(sorted((k, v) for k, v in vars(o).items() if isinstance(v, PLAIN))) for o in objs)


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
