"""``export_onnx``: the graph as attnopt rewrote it, as an ONNX model.

The model is traced with ``torch.export``, attnopt's passes (detect -> plan -> lower) rewrite its decode-time
attention into ``attnopt::decode_attention`` calls, and ``torch.onnx.export`` translates the rewritten graph:

* a site whose plan ONNX can express (``dense``, ``split_kv``, ``stream_k``: each computes exact attention; the
  plan only says how a GPU schedules it) becomes one standard ``Attention`` node (opset 23 or 24) over the
  un-expanded K/V: GQA from the shapes, no ``repeat_kv`` copies. At opset 24 a valid length (a static cache's
  ``valid_len_from_mask``; under a dense plan, derived from a boolean mask the same way) goes to
  ``nonpad_kv_seqlen``; at opset 23, and with ``is_causal`` (whose alignment ``nonpad_kv_seqlen`` would move to
  bottom-right), it is folded into the mask;
* the split-KV / stream-K variants: a sliding window is its mask AND keys from ``key_start`` on (a band site may
  carry no mask at all: ``passes/window.py``); a logit cap
  is ``Attention``'s ``softcap`` (scale times the cap: it computes ``c * tanh(s / c)``, attnopt ``c * tanh(s)``);
  ALiBi's ``slope[h] * j`` is added to the mask. A negative cap, and ALiBi over fp16 / bf16 Q (a mask of Q's type
  would round it), become the function body, which takes the cap as an attribute and ALiBi in its fp32 bias;
* ``tree`` and ``ring`` plans export as their single-device equivalent, the same standard node. Their result is
  exact attention over the whole (sequence-sharded) cache: local attention plus a merge of softmax states across
  ranks. ONNX has no process group and ONNX Runtime's only collectives (``com.microsoft`` AllGather/AllReduce) exist
  only in its NCCL builds, so a per-rank graph would need a collective between every layer's attention and the
  rest of the layer, which no stock runtime runs. The exported graph is the one a single device deploys: it takes
  the whole cache. A graph that was rewritten on a rank of a sharded cache (``shard_mask_columns``) is refused;
* a ``bucketed`` plan exports as the plan of the bucket of the exported (static) KV length, or, when the length is
  symbolic and every bucket is exact attention, as that one exact node;
* a ``saap`` plan (sparse: sink + recent window + top clusters, not exact) becomes an ``attnopt:saap_decode_attention``
  node whose function body is SAAP's reference decode; the index becomes initializers and each layer's key
  clusters a graph input (``attnopt/export_saap.py``);
* otherwise (``attention="function"``, or an op ONNX has no standard node for, such as
  ``attnopt::decode_attention_states`` and ``attnopt::merge_states``) the site becomes an ``attnopt`` domain node
  whose ONNX function body (``attnopt/onnx_functions.py``) is stored in ``model.functions``: ONNX Runtime, or any
  runtime without attnopt's kernels, runs the body.

Anything else (another plan kind, ``check_close``, a sharded mask) raises ``ValueError`` before the export starts.
Each rewritten site's ``SiteReport.exported_as`` says what it became (``onnx:Attention-24``,
``attnopt:decode_attention (function body)``).

The translations themselves (``OnnxTranslator``) and the exportable kinds live in ``attnopt/onnx_translator.py``;
``StaticCacheDecodeStep`` (below) makes an HF decode step over a static cache exportable.
"""
from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from .config import OptimizeConfig
from .onnx_translator import (ATTENTION_FORMS, EXPORTABLE_KINDS, FUNCTION_KINDS, OPSETS, RESOLVED_KINDS,
                              SINGLE_DEVICE_KINDS, STANDARD_KINDS, OnnxTranslator)
from .report import PlanReport


class _FunctionModule(torch.nn.Module):
    """Makes a plain function traceable by ``torch.export``."""

    def __init__(self, fn: Callable):
        super().__init__()
        self.fn = fn

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


def export_onnx(model_or_fn: torch.nn.Module | Callable, example_inputs: Sequence[Any], path: str | Path,
                opset: int = 24, *, example_kwargs: dict[str, Any] | None = None, attention: str = "auto",
                input_names: Sequence[str] | None = None, output_names: Sequence[str] | None = None,
                config: OptimizeConfig | dict | None = None, **options: Any) -> PlanReport:
    """Export ``model_or_fn`` as attnopt rewrites it to the ONNX file ``path``; return the plan report.

    Parameters
    ----------
    model_or_fn : torch.nn.Module or callable
        Traced with ``torch.export.export(..., strict=False)`` on the example inputs (static shapes).
    example_inputs : sequence
        Positional example inputs; ``example_kwargs`` the keyword ones.
    path : str or Path
        Where the ``.onnx`` file goes (weights over 2 GB go to an external data file beside it).
    opset : int
        23 or 24 (``nonpad_kv_seqlen`` needs 24; onnxruntime runs 24 from 1.24 on).
    attention : str
        One of ``ATTENTION_FORMS``.
    input_names, output_names : sequence of str, optional
        Names of the ONNX graph's inputs and outputs (a function's inputs default to its parameter names).
    config, **options
        ``OptimizeConfig`` options for the passes (``force_plan``, ``strategies``, ``hardware``, ...). ``verify``
        must stay off: it compares against the original attention at run time, which an export cannot.

    Returns
    -------
    PlanReport
        One ``SiteReport`` per attention site, with ``exported_as`` set on every rewritten site; also appended to
        the plan log when one is configured (``plan_log`` / ``$ATTNOPT_PLAN_LOG``), for ``attnopt plans``.
    """
    if opset not in OPSETS:
        raise ValueError(f"opset {opset!r} has no standard Attention node; valid: {', '.join(map(str, OPSETS))}")
    if attention not in ATTENTION_FORMS:
        raise ValueError(f"unknown attention form {attention!r}; valid: {', '.join(ATTENTION_FORMS)}")
    cfg = config.replace(**options) if isinstance(config, OptimizeConfig) else OptimizeConfig.from_options(config or {}, **options)
    if cfg.verify:
        raise ValueError("verify=True checks the rewrite against the original attention at run time, which an "
                         "exported graph cannot do; export with verify=False")
    if cfg.force_plan is not None and cfg.force_plan not in EXPORTABLE_KINDS:
        raise ValueError(f"force_plan={cfg.force_plan!r} has no ONNX form; exportable kinds: "
                         f"{', '.join(EXPORTABLE_KINDS)}")
    module = model_or_fn if isinstance(model_or_fn, torch.nn.Module) else _FunctionModule(model_or_fn)
    args, kwargs = tuple(example_inputs), dict(example_kwargs or {})
    if input_names is None and module is not model_or_fn and not kwargs:
        input_names = _parameter_names(model_or_fn, len(args))
    gm, report = rewrite_for_export(module, args, kwargs, cfg)
    translator = OnnxTranslator(opset, attention)
    translator.check_graph(gm)
    import torch.onnx as torch_onnx

    with warnings.catch_warnings():
        # ``ep.module()`` has no eval(); the graph was traced in eval mode, so the exporter's warning is moot.
        warnings.filterwarnings("ignore", message="Exporting a model while it is in training mode")
        program = torch_onnx.export(gm, args, kwargs=kwargs or None, dynamo=True, opset_version=opset,
                                    custom_translation_table=translator.table(), input_names=input_names,
                                    output_names=output_names, verbose=False)
    translator.add_functions(program.model)
    path = Path(path)
    if path.parent and not path.parent.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
    program.save(str(path))
    import onnx

    onnx.checker.check_model(str(path), full_check=True)
    for s in report.sites:
        if s.rewritten and s.key in translator.exported:
            s.exported_as = translator.exported[s.key]
    log_path = cfg.resolved_plan_log()
    if log_path:
        from .backend import append_plan_log

        append_plan_log(log_path, report)
    return report


def rewrite_for_export(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any],
                       config: OptimizeConfig) -> tuple[torch.fx.GraphModule, PlanReport]:
    """``torch.export`` ``module``, then attnopt's passes over the exported graph. Returns the rewritten
    (unlifted, re-exportable) ``GraphModule``, traced in eval mode, and the plan report."""
    from attnopt.passes import make_context, run_passes

    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            program = torch.export.export(module, args, kwargs, strict=False)
    finally:
        module.train(was_training)
    gm = program.module()
    flat = [x for x in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    ctx = make_context(config, flat)
    # the shared-prefix cascade's op (prefix and suffixes apart) has no ONNX form: its check says so
    ctx.plan_context = dataclasses.replace(ctx.plan_context, extras={**ctx.plan_context.extras, "onnx_export": True})
    gm, report = run_passes(gm, flat, ctx=ctx)
    return gm, report


def _parameter_names(fn: Callable, count: int) -> list[str] | None:
    """The names of ``fn``'s first ``count`` positional parameters, or None when it takes ``*args``."""
    import inspect

    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return positional[:count] if len(positional) >= count else None


__all__ = ["export_onnx", "rewrite_for_export", "OnnxTranslator", "StaticCacheDecodeStep", "OPSETS", "ATTENTION_FORMS", "STANDARD_KINDS",
           "SINGLE_DEVICE_KINDS", "FUNCTION_KINDS", "RESOLVED_KINDS", "EXPORTABLE_KINDS"]


class StaticCacheDecodeStep(torch.nn.Module):
    """One decode step of a Hugging Face causal LM over a static KV cache that comes in and goes out as tensors,
    the form an ONNX graph needs (it has no in-place state).

    ``forward(input_ids, cache_position, key_0, value_0, key_1, value_1, ...)`` returns
    ``(logits, key_0, value_0, ...)``: the caches with this step's keys and values written at ``cache_position``
    (in place, and returned). Shapes: ``input_ids`` (B, L) int64, ``cache_position`` (L,) int64 (the positions of
    the L new tokens; the keys before ``cache_position[0]`` are the valid ones), each cache (B, Hkv, max_len, D).
    Attention runs over the whole preallocated cache with a valid-length mask, which attnopt detects and the
    export turns into ``nonpad_kv_seqlen``.
    """

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def cache_names(self) -> list[str]:
        layers = self.model.config.num_hidden_layers
        return [f"{kind}_{i}" for i in range(layers) for kind in ("key", "value")]

    def empty_caches(self, batch: int, max_cache_len: int) -> list[torch.Tensor]:
        """Zero caches for this model: (B, Hkv, max_cache_len, D) per layer, keys and values interleaved."""
        cfg = self.model.config
        heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        param = next(self.model.parameters())
        return [torch.zeros(batch, heads, max_cache_len, head_dim, dtype=param.dtype, device=param.device)
                for _ in self.cache_names()]

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor, *caches: torch.Tensor):
        from transformers import StaticCache

        if len(caches) != 2 * self.model.config.num_hidden_layers:
            raise ValueError(f"expected {2 * self.model.config.num_hidden_layers} cache tensors (a key and a value "
                             f"per layer), got {len(caches)}")
        cache = StaticCache(config=self.model.config, max_cache_len=caches[0].shape[2])
        for layer, keys, values in zip(cache.layers, caches[0::2], caches[1::2]):
            layer.lazy_initialization(keys, values)
            layer.keys, layer.values = keys, values
            layer.cumulative_length = cache_position[0].clone()
        out = self.model(input_ids=input_ids, past_key_values=cache, use_cache=True)
        return (out.logits, *[t for layer in cache.layers for t in (layer.keys, layer.values)])
