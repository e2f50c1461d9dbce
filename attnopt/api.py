"""The public entry points: ``optimize`` and ``last_plans``."""
from __future__ import annotations

import copy
import functools
import types
import weakref
from typing import Any, Callable, TypeVar

import torch

from .backend import _ALL_REPORTS, Backend, with_call_counts
from .config import OptimizeConfig
from .report import PlanReport

M = TypeVar("M")

_BACKEND_ATTR = "_attnopt_backend"
_STEP_GRAPHS_ATTR = "_attnopt_step_graphs"


def optimize(model: M, config: OptimizeConfig | dict | None = None, *, process_group: Any = None,
             mode: str | None = None, **options: Any) -> M:
    """Compile ``model`` with the attnopt backend and return a model whose calls run the rewritten graph.

    Parameters
    ----------
    model : torch.nn.Module or callable
        For a module, a shallow copy is returned that shares the parameters and buffers; its ``forward`` is
        compiled, so ``model(...)``, ``model.forward(...)`` and Hugging Face ``model.generate(...)`` all go
        through the rewritten graph (``.generate`` of a bare ``torch.compile(model)`` wrapper would not). For a
        Hugging Face model, a call with more than ``max_decode_q_len`` new tokens (a prefill) runs the model's own
        forward, as HF's compiled ``generate()`` does: attnopt rewrites decode attention only.
        Hugging Face's own auto-compile during ``generate`` is switched off on the copy, because an outer
        ``torch.compile`` would trace around attnopt's backend. Attention modules with a sliding window are
        recorded in ``config.sliding_windows`` (see ``sliding_windows``): their sites read only the window.
    config : OptimizeConfig or dict, optional
        Options; keyword ``options`` are merged on top. Unknown keys raise ``ValueError``.
    process_group : torch.distributed.ProcessGroup, optional
        Plan tree / ring decode over this group, for a KV cache sharded along the sequence
        (``attnopt.runtime.distributed.make_sharded_cache(model, group)``, passed to ``generate``). A Hugging Face
        model is switched to a shard-aware wrapper of its attention implementation ("sdpa" or "eager"), which
        cuts the global mask to the local keys; on an unsharded cache it computes exactly what it did before.
    mode : str, optional
        Passed to the inner backend. ``"reduce-overhead"`` is the fast path on a GPU: a Hugging Face model's decode
        steps over a static cache are each recorded as one CUDA graph with attnopt's kernels inside and replayed
        (``attnopt.step_graphs``; ``step_graphs=False`` uses inductor's CUDA-graph trees instead); for other
        modules and functions it turns on inductor's CUDA-graph trees. A Hugging Face model's decode calls over a
        ``DynamicCache`` run the same graphs without CUDA graphs (its tensors grow every step, so graphs could not
        be replayed).
    """
    if isinstance(config, OptimizeConfig):
        cfg = config.replace(**options) if options else config
    else:
        cfg = OptimizeConfig.from_options(config or {}, **options)
    owner = model if isinstance(model, torch.nn.Module) else getattr(model, "__self__", None)
    if isinstance(owner, torch.nn.Module):
        known = dict(cfg.sliding_windows)
        found = tuple(pair for pair in sliding_windows(owner) if pair[0] not in known)
        if found:
            cfg = cfg.replace(sliding_windows=cfg.sliding_windows + found)
    backend = Backend(cfg, process_group=process_group, mode=mode)
    from .tuning_procs import prestart_for_tuning

    prestart_for_tuning(mode)  # a background tuning's compile workers start now, beside dynamo's tracing
    if isinstance(model, torch.nn.Module):
        optimized = copy.copy(model)
        gen_cfg = getattr(model, "generation_config", None)
        if gen_cfg is not None:
            optimized.generation_config = copy.deepcopy(gen_cfg)
            optimized.generation_config.disable_compile = True
        if process_group is not None and hasattr(getattr(model, "config", None), "_attn_implementation"):
            # HF builds masks over the global key positions; the shard-aware attention cuts them to the local
            # keys in the graph. The config is shared with ``model``, which is unchanged on an unsharded cache.
            from attnopt.runtime.distributed import register_hf_shard_aware

            model.set_attn_implementation(register_hf_shard_aware(model))
        hf_decode = process_group is None and gen_cfg is not None
        step_graphs = hf_decode and mode == "reduce-overhead" and cfg.step_graphs
        inner = backend.with_mode(None, graphed=True) if step_graphs else backend
        compiled_forward = torch.compile(private_code(model.forward), backend=inner, dynamic=cfg.dynamic)
        if process_group is not None:
            compiled_forward = _never_eager_over_shards(compiled_forward, model)
        if hf_decode:
            growing, steps = None, None
            if mode == "reduce-overhead":  # growing caches: no CUDA graphs, and plans chosen knowing it
                growing = torch.compile(private_code(model.forward), backend=backend.with_mode(None),
                                        dynamic=cfg.dynamic)
            if step_graphs:
                from .step_graphs import StepGraphs

                # what step graphs never record still replays through inductor's CUDA-graph trees, as before them
                # (compiled at its first call only: a model whose steps all record never compiles it)
                trees = torch.compile(private_code(model.forward), backend=backend, dynamic=cfg.dynamic)
                steps = StepGraphs(compiled_forward, model, backend.note_graph_replay, fallback=trees)
                object.__setattr__(optimized, _STEP_GRAPHS_ATTR, steps)
            forward = _hf_forward(compiled_forward, model.forward, cfg.max_decode_q_len, backend, growing_cache=growing,
                                  step_graphs=steps)
        else:
            forward = _counting_uncompiled_calls(compiled_forward, backend)
        optimized.forward = forward
        object.__setattr__(optimized, _BACKEND_ATTR, backend)
        return optimized
    if callable(model):
        compiled = _counting_uncompiled_calls(torch.compile(private_code(model), backend=backend, dynamic=cfg.dynamic),
                                              backend)
        setattr(compiled, _BACKEND_ATTR, backend)
        return compiled
    raise TypeError(f"attnopt.optimize expects a torch.nn.Module or a callable, got {type(model).__name__}")


def private_code(fn: Callable) -> Callable:
    """``fn`` (a function or bound method) over a private copy of its code object.

    Dynamo keeps its compiled graphs, and counts recompilations against ``recompile_limit`` (8), per code object.
    Every Hugging Face model of a class shares one ``forward`` (and every ``@can_return_tuple`` forward shares the
    decorator's wrapper code), and every ``optimize()`` call brings a new backend, which dynamo treats as a
    recompilation: after eight optimized models, batch sizes or mask layouts in one process, dynamo silently ran
    ``forward`` eagerly, unrewritten. A private code object gives each optimized model a cache and a limit of its
    own. Objects that are not plain Python functions are returned as they are.
    """
    func = getattr(fn, "__func__", fn)
    owner = getattr(fn, "__self__", None)
    if not isinstance(func, types.FunctionType):
        return fn
    copy_fn = types.FunctionType(func.__code__.replace(), func.__globals__, func.__name__, func.__defaults__,
                                 func.__closure__)
    functools.update_wrapper(copy_fn, func)
    copy_fn.__kwdefaults__ = func.__kwdefaults__
    return types.MethodType(copy_fn, owner) if owner is not None and hasattr(fn, "__func__") else copy_fn


def _hf_forward(compiled: Callable, original: Callable, max_decode_q_len: int, backend: Backend,
                growing_cache: Callable | None = None, step_graphs: Any = None) -> Callable:
    """A Hugging Face model's forward: prefill calls (more than ``max_decode_q_len`` new tokens) run the model's own
    forward, as HF's compiled ``generate()`` does, and decode calls run ``compiled``; a decode call during which no
    graph of ``backend`` ran is counted and reported (``_counting_uncompiled_calls``).

    attnopt rewrites decode attention only, so a compiled prefill brought nothing but compile time (a graph per
    prompt length until dynamo goes dynamic). It also broke CUDA graphs: a ``StaticCache`` allocates its tensors at
    the first update and marks them static addresses only outside a compiled region; allocated inside a compiled
    prefill they stayed unmarked, the decode graphs mutated unmarked inputs, and inductor ran them without CUDA
    graphs (``generate()`` with ``mode="reduce-overhead"`` was slower than HF's on the H100).

    Decode calls over a cache that grows by concatenation (``past_key_values.is_compileable`` False: HF's
    ``DynamicCache``) go to ``growing_cache`` when given: the same backend without CUDA graphs. Under CUDA-graph
    trees the cache's tensors would be graph outputs that the next step's replay overwrites (inductor raises
    "accessing tensor output of CUDAGraphs that has been overwritten", H100, torch 2.11), and every length would be
    recorded anew. HF's own compiled ``generate()`` compiles static caches only. With ``step_graphs``
    (``attnopt.step_graphs``), decode calls over any other cache go through it: each step replays as one CUDA graph.

    This runs once per generated token, on the host, before the graph's replay is launched: it is one Python frame
    (not a wrapper per concern), and the route of the last cache object is remembered through a weak reference
    (``is_compileable`` walks every layer of the cache).
    """
    name = getattr(compiled, "__qualname__", None) or type(compiled).__name__
    last_cache: list[Any] = [None, False]  # [weak reference to the last cache seen, whether it grows]

    @functools.wraps(compiled)
    def forward(*args: Any, **kwargs: Any) -> Any:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if isinstance(ids, torch.Tensor) and ids.dim() >= 1:
            new_tokens = ids.shape[-1]
        else:
            embeds = kwargs.get("inputs_embeds")
            new_tokens = embeds.shape[-2] if isinstance(embeds, torch.Tensor) and embeds.dim() >= 2 else 0
        if new_tokens > max_decode_q_len:
            return original(*args, **kwargs)
        grows = False
        if growing_cache is not None:
            cache = kwargs.get("past_key_values", kwargs.get("cache"))  # transformers >= 5.24 names it ``cache``
            ref = last_cache[0]
            if cache is None or ref is None or ref() is not cache:
                last_cache[:] = [_weak(cache), getattr(cache, "is_compileable", True) is False]
            grows = last_cache[1]
        before = backend.graph_calls
        if grows:
            out = growing_cache(*args, **kwargs)
        elif step_graphs is not None:
            out = step_graphs(args, kwargs)
        else:
            out = compiled(*args, **kwargs)
        if backend.graph_calls == before:
            backend.note_uncompiled_call(name)
        return out

    return forward


def _weak(obj: Any) -> Callable[[], Any] | None:
    """A weak reference to ``obj``, or None for objects that take none (then the route is decided per call)."""
    try:
        return weakref.ref(obj)
    except TypeError:
        return None


class FallbackWarning(UserWarning):
    """A call of an optimized model or function ran without any graph attnopt compiled."""


def _counting_uncompiled_calls(compiled: Callable, backend: Backend) -> Callable:
    """Wrap ``compiled`` so that a call during which no attnopt-compiled graph ran is counted on ``backend``
    (``last_plans(...).calls_without_attnopt``) and reported loudly, once: dynamo falls back to eager without an
    error when it hits a recompile limit or skips a frame, and attnopt then rewrites nothing."""

    @functools.wraps(compiled)
    def call(*args: Any, **kwargs: Any) -> Any:
        before = backend.graph_calls
        out = compiled(*args, **kwargs)
        if backend.graph_calls == before:
            backend.note_uncompiled_call(getattr(compiled, "__qualname__", None) or type(compiled).__name__)
        return out

    return call


def _never_eager_over_shards(compiled: Callable, model: torch.nn.Module) -> Callable:
    """Run ``compiled`` so that dynamo never silently falls back to eager.

    A sharded cache's update is a graph break (``ShardedDynamicCache.update``). Dynamo treats integer module
    attributes as constants, so by default it compiled each attention layer's frames once per layer (a guard on
    ``self.layer_idx``): about two graphs per layer, each also compiled by the inner backend. With
    ``allow_unspec_int_on_nn_module`` the layer index is an input and one compilation serves every layer (tiny
    Llama on gloo: 16 graphs for 2 or 8 layers, against 17 and 29 before). The recompile limit is still raised to
    cover every layer, and hitting it raises: at the default limit (8) dynamo would otherwise run the remaining
    layers eagerly, plain attention over this rank's shard, a wrong answer.
    """
    import functools

    import torch._dynamo.config as dynamo_config

    modules = sum(1 for _ in model.modules())
    limit = max(int(dynamo_config.recompile_limit), 2 * modules + 8)

    @functools.wraps(compiled)
    def forward(*args: Any, **kwargs: Any) -> Any:
        with dynamo_config.patch(recompile_limit=limit, fail_on_recompile_limit_hit=True,
                                 allow_unspec_int_on_nn_module=True,
                                 accumulated_recompile_limit=max(int(dynamo_config.accumulated_recompile_limit),
                                                                 4 * limit)):
            return compiled(*args, **kwargs)

    return forward


def sliding_windows(model: torch.nn.Module) -> tuple[tuple[str, int], ...]:
    """``(module path, window)`` of the attention modules of ``model`` that attend through a sliding window.

    Hugging Face sets ``self.sliding_window`` on the attention modules of models with per-layer windows (Gemma 2/3,
    Qwen2 with ``use_sliding_window``, gpt-oss, ...): the window on sliding layers, None on full ones. Mistral and
    Phi-3 attention modules have no such attribute and pass ``config.sliding_window`` to the attention call. The
    paths are those of ``model.named_modules()``, which is what ``module_path`` makes of a site's module stack.
    """
    found = []
    for path, module in model.named_modules():
        attrs = vars(module)
        if "sliding_window" in attrs:
            window = attrs["sliding_window"]
        elif type(module).__name__.endswith("Attention") and hasattr(module, "config"):
            window = getattr(module.config, "sliding_window", None)
        else:
            continue
        if isinstance(window, int) and not isinstance(window, bool) and window > 0:
            found.append((path, window))
    return tuple(found)


def last_plans(obj: Any = None) -> PlanReport:
    """The plan report of an optimized model or function (every graph it compiled so far), with live call
    counts; with no argument, the report of the most recently compiled graph in this process.

    ``obj`` is what ``attnopt.optimize`` returned, or what ``torch.compile(..., backend="attnopt")`` returned
    (wrappers made without ``options`` share one report). Before anything was compiled the report is empty and its
    headline says so.
    """
    if obj is None:
        return with_call_counts(copy.deepcopy(_ALL_REPORTS[-1])) if _ALL_REPORTS else PlanReport()
    backend = obj if isinstance(obj, Backend) else getattr(obj, _BACKEND_ATTR, None)
    if backend is None:
        from .string_backend import backend_of

        backend = backend_of(obj)
    if backend is None:
        raise ValueError(f"this {type(obj).__name__} was not compiled by attnopt: pass what attnopt.optimize(model) or "
                         "torch.compile(model, backend=\"attnopt\") returned (not the original model), or call "
                         "attnopt.last_plans() for the most recent graph")
    return backend.report()
