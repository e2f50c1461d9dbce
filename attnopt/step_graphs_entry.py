"""One recorded decode step of ``attnopt.step_graphs``: what its CUDA graph baked in, and the checks that run before
every replay.

A replay runs once per generated token, on the host, before the GPU gets the step's work, so every check here is
written as C-level passes over flat lists made at recording time (``map`` over containers and keys, identity
comparisons), not as Python loops over the model: SmolLM2's 30 layers are about 400 modules, 490 parameters and
buffers and 90 cache tensors, and the Python loops this replaced cost about 100 µs a token on the CPU
(``benchmarks/step_host_cpu.py``).
"""
from __future__ import annotations

import operator
from collections import Counter
from itertools import chain
from typing import Any

import torch

#: Argument values a signature compares by value.
PLAIN = (int, float, bool, str, type(None))


def global_state(model: torch.nn.Module) -> tuple:
    """The process and module state a recording depends on: training flag, grad and inference mode, CUDA autocast."""
    return (model.training, torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
            torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))


def hook_dicts(model: torch.nn.Module) -> list[dict]:
    """The forward (pre-)hook dicts of ``model``'s modules and the global ones: a hook is Python that a replay would
    skip, so a recording requires every hook in them to be inert (``blocking_hook``)."""
    from torch.nn.modules import module as nn_module

    return [nn_module._global_forward_hooks, nn_module._global_forward_pre_hooks,
            *(d for m in model.modules() for d in (m._forward_hooks, m._forward_pre_hooks))]


#: Outputs whose request activates Hugging Face's output-capturing hooks.
CAPTURED_OUTPUTS = ("output_attentions", "output_hidden_states")


def blocking_hook(dicts: list[dict], kwargs: dict, config: Any) -> bool:
    """Whether a hook in ``dicts`` would do something that a replay of a call with ``kwargs`` skips. Hugging Face
    installs output-capturing hooks on a model's modules for good at the first call that asks for attentions or hidden
    states (``transformers.utils.output_capturing``); they return at once in a call that asks for neither (in the
    keywords or the config), so they do not block such a call. Any other hook does."""
    hooks = [h for d in dicts if d for h in d.values()]
    if not hooks:
        return False
    if any(kwargs.get(name) or getattr(config, name, False) for name in CAPTURED_OUTPUTS):
        return True
    return not all(getattr(h, "__module__", None) == "transformers.utils.output_capturing"
                   and getattr(h, "__qualname__", "").endswith("output_capturing_hook") for h in hooks)


class RecordedStep:
    """One signature's graph: its input buffers, its output, and what must not have moved since the recording.

    ``inputs`` are the buffers the call's tensors are copied into (in the order of ``StepGraphs._key``); ``output`` is
    the forward's output with the call's caches replaced by ``CacheSlot`` (its tensors are the graph's buffers);
    ``call_counts`` the attnopt op calls of one forward, added to ``runtime.ops.CALL_COUNTS`` at each replay.
    ``pinned`` keeps the model's modules, parameters and buffers and the caches' layers and tensors alive, so no later
    object can take their addresses; ``unchanged`` compares what the model and caches hold now with them.
    """

    def __init__(self, graph: Any, inputs: list[torch.Tensor], output: Any, model: torch.nn.Module, caches: list[Any],
                 call_counts: Counter, args: tuple, kwargs: dict):
        self.graph = graph
        self.inputs = inputs
        self.output = output
        self.count_items = list(call_counts.items())
        self.call_counts = call_counts
        self.state = global_state(model)
        self.config = getattr(model, "config", None)
        self.config_vars = dict(vars(self.config)) if self.config is not None else None
        self.template = _template(args, kwargs, caches)
        modules = list(model.modules())
        # module dicts compared whole (values by identity: a submodule swapped in, or one added); parameters,
        # buffers, the caches' layer lists, layers and tensors by identity at their (container, key); then the
        # tensors' addresses (a ``.data =`` assignment keeps the object and moves its memory)
        self.child_dicts = [m._modules for m in modules if m._modules]
        self.children = [dict(d) for d in self.child_dicts]
        self.leaf_dicts = [m._modules for m in modules if not m._modules]  # (must stay empty: a truth test each)
        slots = [(d, name) for m in modules for d in (m._parameters, m._buffers) for name, t in d.items()
                 if t is not None]
        self.layer_lists, self.layers = [], []  # the caches' layer containers, and what they held
        for cache in caches:
            attrs = vars(cache)
            if "layers" in attrs:
                slots.append((attrs, "layers"))
            layers = getattr(cache, "layers", ())
            self.layer_lists.append(layers)
            self.layers.append(layers.copy() if isinstance(layers, list) else tuple(layers))
            for owner in (cache, *layers):
                slots += [(vars(owner), name) for name, v in vars(owner).items() if isinstance(v, torch.Tensor)]
        self.containers = [d for d, _ in slots]
        self.keys = [k for _, k in slots]
        self.pinned = list(map(operator.getitem, self.containers, self.keys))
        self.tensors = [t for t in self.pinned if isinstance(t, torch.Tensor)]
        self.pinned_ptrs = [t.data_ptr() for t in self.tensors]
        self.pinned_indices = list(range(len(self.tensors)))
        self.pinned_storages = {t.untyped_storage().data_ptr() for t in self.tensors}
        self.hook_dicts = hook_dicts(model)
        self.hook_counts = list(map(len, self.hook_dicts))  # (inert hooks only: ``blocking_hook`` said so)
        self.hooked = any(self.hook_counts)

    # -- before a replay -------------------------------------------------------------------------------------
    def match(self, args: tuple, kwargs: dict) -> tuple[list[torch.Tensor], list[Any]] | None:
        """(the call's tensors in ``inputs``' order, its caches) when ``args``/``kwargs`` have this recording's
        signature, else None: the same argument names in the same order, tensors of the same shape, dtype, strides and
        device, the same plain values (and types), the same cache objects. Flat calls only (``template`` is None for
        others: they take the full key)."""
        template = self.template
        if template is None or len(args) != template[0] or tuple(kwargs) != template[1]:
            return None
        tensors, caches = [], []
        for value, (kind, want) in zip(chain(args, kwargs.values()), template[2]):
            if kind == "T":
                if not isinstance(value, torch.Tensor) or value.requires_grad or \
                        (value.shape, value.dtype, value.stride(), value.device) != want:
                    return None
                tensors.append(value)
            elif kind == "P":
                if type(value) is not want[0] or value != want[1]:
                    return None
            elif id(value) == want:  # a cache: the recording's own object
                caches.append(value)
            else:
                return None
        return tensors, caches

    def unchanged(self) -> bool:
        """Whether the model's modules, parameters and buffers, the caches' layers and tensors, the config and the
        hooks are as the graph baked them in. Runs at every replay."""
        if not all(map(operator.eq, self.child_dicts, self.children)) or any(self.leaf_dicts):  # (identity)
            return False
        if not all(map(operator.eq, self.layer_lists, self.layers)):
            return False
        try:
            if not all(map(operator.is_, map(operator.getitem, self.containers, self.keys), self.pinned)):
                return False
        except (KeyError, IndexError):  # a parameter, buffer or cache tensor deleted since
            return False
        if any(self.hook_dicts) if not self.hooked else list(map(len, self.hook_dicts)) != self.hook_counts:
            return False
        if self.config is not None and not _same_vars(self.config, self.config_vars):
            return False
        if _ADDRESSES_EQUAL is not None:
            return _ADDRESSES_EQUAL(self.tensors, self.pinned_ptrs, self.pinned_indices)
        return list(map(torch.Tensor.data_ptr, self.tensors)) == self.pinned_ptrs

    def shares_memory(self, tensors: list[torch.Tensor]) -> bool:
        """Whether an argument is a view of the cache or a parameter: a copy of it would not see the forward's
        writes to the cache, as the original does."""
        storages = self.pinned_storages
        return any(t.untyped_storage().data_ptr() in storages for t in tensors)


def _same_vars(obj: Any, snapshot: dict) -> bool:
    try:
        return bool(vars(obj) == snapshot)
    except Exception:  # noqa: BLE001 - a value that cannot compare (an array): call it changed
        return False


def _template(args: tuple, kwargs: dict, caches: list[Any]) -> tuple | None:
    """(number of positional args, keyword names, [(kind, what to compare)]) of a flat call, for ``match``."""
    specs = []
    for value in chain(args, kwargs.values()):
        if isinstance(value, torch.Tensor):
            specs.append(("T", (value.shape, value.dtype, value.stride(), value.device)))
        elif isinstance(value, PLAIN):
            specs.append(("P", (type(value), value)))
        elif any(value is c for c in caches):
            specs.append(("C", id(value)))
        else:
            return None
    return len(args), tuple(kwargs), specs


#: PyTorch's C++ comparison of many tensors' addresses (CUDA builds; what inductor's CUDA-graph trees use): about
#: 100x faster than a Python loop over SmolLM2's 580 parameters, buffers and cache tensors.
_ADDRESSES_EQUAL = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)


# -- the output ----------------------------------------------------------------------------------------------
class CacheSlot:
    """Where a recorded output held the call's cache object (``past_key_values``): the entry keeps no reference to
    the cache, which would keep it alive (and its recording with it)."""

    def __init__(self, index: int):
        self.index = index


def without_caches(output: Any, caches: list[Any]) -> Any:
    """``output`` with each of ``caches`` replaced by a ``CacheSlot``."""
    for i, cache in enumerate(caches):
        if output is cache:
            return CacheSlot(i)
    if isinstance(output, (tuple, list)) and not hasattr(output, "keys"):
        return type(output)(without_caches(v, caches) for v in output)
    if hasattr(output, "keys") and hasattr(output, "__getitem__"):
        return _rebuilt(output, {k: without_caches(output[k], caches) for k in output.keys()})
    return output


def cloned(output: Any, caches: list[Any]) -> Any:
    """A recorded output for the caller: every tensor cloned out of the graph's memory (the next replay overwrites
    it), the call's cache objects put back."""
    if isinstance(output, torch.Tensor):
        return output.clone()
    if isinstance(output, CacheSlot):
        return caches[output.index]
    if isinstance(output, (tuple, list)) and not hasattr(output, "keys"):
        return type(output)(cloned(v, caches) for v in output)
    if hasattr(output, "keys") and hasattr(output, "__getitem__"):  # HF ModelOutput (an OrderedDict) or a dict
        return _rebuilt(output, {k: cloned(output[k], caches) for k in output.keys()})
    return output


def _rebuilt(like: Any, fields: dict) -> Any:
    """An object of ``like``'s mapping type with ``fields`` (a plain dict where the type takes no such keywords)."""
    try:
        return type(like)(**fields)
    except TypeError:
        return fields
