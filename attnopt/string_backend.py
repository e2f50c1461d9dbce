"""The string backend, ``torch.compile(model, backend="attnopt", options={...}, mode=...)``, as a first-class route.

Dynamo calls the entry point once per graph with the ``options`` dict and ``mode`` that ``torch.compile`` was
given (the very dict object: the wrapper keeps it), and never tells it which module or function the graph came
from. So one ``Backend`` serves each options dict (and mode) and keeps its reports (``backend_for``);
``last_plans(compiled)`` reads the dict back from the wrapper that ``torch.compile`` returned (``backend_of``) and
finds that ``Backend``. Wrappers made without options (or with one dict object) share one report.

``compiled.generate(...)`` on such a wrapper runs the model's *uncompiled* forward (the wrapper forwards the
attribute to the original module, whose ``generate`` calls the original ``forward``). ``attnopt.optimize`` is the
route that reaches ``generate``; ``install_generate_warning`` makes the first ``.generate`` of an attnopt wrapper
say so, once.
"""
from __future__ import annotations

import threading
import warnings
from typing import Any

from .config import OptimizeConfig

#: (id of the options dict or None, mode) -> (the dict, kept alive so that its id stays unique, Backend)
_BACKENDS: dict[tuple[int | None, str | None], tuple[Any, Any]] = {}
_lock = threading.Lock()
_WARNED_ATTR = "_attnopt_generate_warned"


def config_of(options: dict[str, Any] | None) -> OptimizeConfig:
    """The config of ``torch.compile(..., backend="attnopt", options=options)``: ``$ATTNOPT_OPTIONS`` under
    ``options``."""
    from .backend import options_from_env

    return OptimizeConfig.from_options({**options_from_env(), **(options or {})})


def backend_for(options: dict[str, Any] | None, mode: str | None = None):
    """The one ``Backend`` of this options dict (by identity) and mode in this process, made on first use."""
    from .backend import Backend

    key = (id(options) if options else None, mode)
    with _lock:
        if key not in _BACKENDS:
            _BACKENDS[key] = (options, Backend(config_of(options), mode=mode))
        return _BACKENDS[key][1]


def _compile_wrapper(obj: Any) -> Any:
    """The ``torch._TorchCompileWrapper`` behind what ``torch.compile`` returned (an ``OptimizedModule`` or a
    compiled function), or None. Walks dynamo's callback chain (``_torchdynamo_orig_backend``); a compiled
    function holds its context in its closure."""
    ctx = getattr(obj, "dynamo_ctx", None) if "dynamo_ctx" in getattr(obj, "__dict__", {}) else None
    callback = getattr(ctx, "callback", None)
    if callback is None:
        code, cells = getattr(obj, "__code__", None), getattr(obj, "__closure__", None)
        if code is not None and cells:
            free = dict(zip(code.co_freevars, cells))
            try:
                callback = free["callback"].cell_contents if "callback" in free else free["self"].cell_contents.callback
            except (KeyError, ValueError, AttributeError):  # an empty cell, or no dynamo context
                callback = None
    for _ in range(16):
        if callback is None:
            return None
        if hasattr(callback, "compiler_fn") and isinstance(getattr(callback, "kwargs", None), dict):
            return callback
        callback = getattr(callback, "_torchdynamo_orig_backend", None)
    return None


def is_attnopt_entry(fn: Any) -> bool:
    from .backend import string_backend_entry

    return fn is string_backend_entry


def backend_of(obj: Any):
    """The ``Backend`` of an object returned by ``torch.compile(..., backend="attnopt")``; None when ``obj`` was
    not compiled that way. Raises ``ValueError`` when it was compiled by dynamo with another backend."""
    wrapper = _compile_wrapper(obj)
    if wrapper is None:
        return None
    if not is_attnopt_entry(wrapper.compiler_fn):
        name = getattr(wrapper, "compiler_name", None) or getattr(wrapper.compiler_fn, "__name__", "?")
        raise ValueError(f"this object was compiled with backend {name!r}, not attnopt; use attnopt.optimize(model) "
                         "or torch.compile(model, backend=\"attnopt\")")
    return backend_for(wrapper.kwargs.get("options"), wrapper.kwargs.get("mode"))


def _warn_generate(module: Any) -> None:
    if module.__dict__.get(_WARNED_ATTR):
        return
    wrapper = _compile_wrapper(module)
    if wrapper is None or not is_attnopt_entry(wrapper.compiler_fn):
        return
    module.__dict__[_WARNED_ATTR] = True
    name = type(module.__dict__["_modules"]["_orig_mod"]).__name__
    warnings.warn(f"{name}.generate through torch.compile(model, backend=\"attnopt\") runs the uncompiled forward: the "
                  "wrapper compiles calls of itself only. Use model = attnopt.optimize(model) to run generate() "
                  "through attnopt.", UserWarning, stacklevel=3)


def install_generate_warning() -> None:
    """Make the first ``.generate`` looked up on an attnopt ``OptimizedModule`` warn (once per wrapper).

    ``OptimizedModule.__getattr__`` (called only for attributes the wrapper lacks, such as ``generate``) gets a thin
    wrapper; any failure of the check is swallowed, so attribute lookup never breaks. Idempotent.
    """
    from torch._dynamo.eval_frame import OptimizedModule

    original = OptimizedModule.__getattr__
    if getattr(original, "_attnopt_generate_warning", False):
        return

    def __getattr__(self, name: str) -> Any:
        value = original(self, name)
        if name == "generate":
            try:
                _warn_generate(self)
            except Exception:  # noqa: BLE001 - a warning must never break attribute lookup
                pass
        return value

    __getattr__._attnopt_generate_warning = True  # type: ignore[attr-defined]
    __getattr__.__wrapped__ = original  # type: ignore[attr-defined]
    OptimizedModule.__getattr__ = __getattr__  # type: ignore[method-assign]
