"""Where the ``saap`` op finds, at run time, what its fixed signature cannot carry.

* Loaded indexes, by (resolved path, device): an index is read and validated once per process.
* The cluster state of the live sequence, per (index path, layer), built at prefill by ``SaapCache`` (or by
  ``set_state``), with the centroids refined over its keys when the index asks for it. A new prefill copies its
  CSR tables (and refined centroids) into the buffers already registered when they fit, so
  the tensors a captured CUDA graph reads stay at the same addresses; a longer prompt than any before
  allocates new buffers (capture again after that).
* Run-time statistics per plan: the selectivity each call attended, accumulated on the device (no sync in the op)
  and read when the plan table is printed.

One sequence batch per index is live at a time in a process: a prefill replaces the previous state.
"""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .build import ClusterState, build_clusters
from .index import SaapIndex, load_index

_lock = threading.Lock()
_INDEXES: dict[tuple[str, str], SaapIndex] = {}
_STATES: dict[tuple[str, int], ClusterState] = {}
#: plan runtime key -> (2,) fp64 device tensor: [sum of per-call selectivity, calls]
_STATS: dict[str, Tensor] = {}


def _key(path: str | Path) -> str:
    return str(Path(path).resolve())


def get_index(path: str | Path, device: torch.device | str = "cpu", config: Any = None) -> SaapIndex:
    """The index at ``path`` on ``device``, loaded (and checked against ``config`` when given) once."""
    key = (_key(path), str(torch.device(device)))
    index = _INDEXES.get(key)
    if index is None:
        with _lock:
            index = _INDEXES.get(key)
            if index is None:
                cpu = _INDEXES.get((key[0], "cpu")) or load_index(path, config)
                _INDEXES[(key[0], "cpu")] = cpu
                index = _INDEXES[key] = cpu.to(device)
    elif config is not None:
        index.check_model(config, path)
    return index


def set_state(path: str | Path, layer: int, state: ClusterState) -> ClusterState:
    """Register the live sequence's clusters of ``layer``; reuses the registered buffers when they fit."""
    key = (_key(path), layer)
    old = _STATES.get(key)
    if (old is not None and old.offsets.shape == state.offsets.shape and old.offsets.device == state.offsets.device
            and old.perm.shape[:2] == state.perm.shape[:2] and old.perm.shape[-1] >= state.perm.shape[-1]
            and (old.centroids is None) == (state.centroids is None)):
        n = state.perm.shape[-1]
        old.offsets.copy_(state.offsets)
        old.perm[..., :n].copy_(state.perm)
        old.ends.copy_(state.ends)
        if state.centroids is not None:  # refined at prefill: the scorer reads this buffer
            old.centroids.copy_(state.centroids)
        old.assign, old.sink, old.indexed_end, old.window = state.assign, state.sink, state.indexed_end, state.window
        return old
    _STATES[key] = state
    return state


def get_state(path: str | Path, layer: int) -> ClusterState | None:
    return _STATES.get((_key(path), layer))


def stats_buffer(plan_key: str, device: torch.device) -> Tensor:
    """The (2,) fp64 accumulator of a plan's run-time selectivity (allocated at ``prepare``)."""
    buf = _STATS.get(plan_key)
    if buf is None or buf.device != device:
        buf = _STATS[plan_key] = torch.zeros(2, dtype=torch.float64, device=device)
    return buf


def measured_selectivity(plan_key: str) -> tuple[float, int] | None:
    """(mean selectivity, calls) measured for a plan so far, or None before its first call (syncs)."""
    buf = _STATS.get(plan_key)
    if buf is None:
        return None
    total, calls = buf.tolist()
    return (total / calls, int(calls)) if calls else None


def reset() -> None:
    """Forget loaded indexes, sequence states and statistics (tests)."""
    with _lock:
        _INDEXES.clear()
        _STATES.clear()
        _STATS.clear()


def _cache_cls(static: bool):
    from transformers import DynamicCache, StaticCache

    return StaticCache if static else DynamicCache


def saap_cache(index: str | Path, *, sink: int | None = None, window: int | None = None, config: Any = None,
               static: bool = False, **cache_kwargs: Any):
    """A Hugging Face ``DynamicCache`` (``StaticCache`` with ``static=True``; pass ``max_cache_len``) that builds
    the SAAP clusters of every covered layer at prefill.

    Pass it as ``past_key_values`` to ``generate`` (or a forward) of a model optimized with
    ``saap=index``: every cache update of more than one token (the prompt) assigns all the layer's keys to
    clusters and registers them for the ``saap`` op; single-token decode updates add nothing (the new tokens are
    in the recent window). ``sink`` and ``window`` must be the plan's (``saap_sink``, ``saap_window``; None, as
    there, takes the index's recommendation); the op checks it. ``config`` (the model's config) checks the index
    against the model.
    """
    base = _cache_cls(static)
    path = str(index)
    idx = get_index(path, "cpu", config)
    defaults = idx.decode_defaults()
    sink = defaults["sink"] if sink is None else sink
    window = defaults["window"] if window is None else window

    class SaapCache(base):  # type: ignore[misc, valid-type]
        saap_index = path
        saap_sink = sink
        saap_window = window

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
            if key_states.shape[-2] > 1 and layer_idx in idx.layers:
                # the prompt is every key written so far (a static cache's buffer is longer than that)
                _build_at_prefill(path, layer_idx, keys, self.get_seq_length(layer_idx), sink, window)
            return keys, values

    return SaapCache(**({"config": config} if config is not None else {}), **cache_kwargs)


@torch._dynamo.disable
def _build_at_prefill(path: str, layer: int, keys: Tensor, prompt_len: int, sink: int, window: int) -> None:
    # outside any compiled graph: a prefill runs it once per layer; the registry is Python state
    index = get_index(path, keys.device)
    set_state(path, layer, build_clusters(index, layer, keys, int(prompt_len), sink, window))
