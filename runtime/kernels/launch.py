"""Relaunching a compiled Triton kernel without the JIT's per-call work.

``kernel[grid](...)`` binds every argument, computes its specialisation (pointer alignment, integer
divisibility, dtypes) and looks the compiled kernel up again on each call: tens of µs of host time for kernels
with many arguments, which a decode step in eager mode pays once per layer.

:class:`LaunchCache` remembers the compiled kernel for an *exact* argument list: every pointer value and dtype,
every integer and float, every constexpr and launch option. A later call with the same list is, by
construction, the same specialisation, so it goes straight to the compiled kernel's launcher. Any difference
(a new buffer address, a longer cache, another shape) takes the JIT path and is remembered in turn. This is
exact, never approximate: a hit cannot run a kernel compiled for other assumptions.

Hits are common where buffers persist: CUDA-graph-free decode over a static cache, the tree merge over its
persistent all-gather buffer, the split-KV workspace.
"""
from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any

import torch

from . import interpreting

#: Remembered launches per kernel (least recently used dropped first).
MAX_ENTRIES = 256


def _arg_key(a: Any):
    if isinstance(a, torch.Tensor):
        return ("t", a.data_ptr(), a.dtype)
    if isinstance(a, (bool, int, float, str)) or a is None:
        return (type(a).__name__, a)
    base = getattr(a, "base", None)
    if isinstance(base, torch.Tensor):  # a TensorDescriptor: everything the launcher encodes
        return ("d", base.data_ptr(), base.dtype, tuple(a.shape), tuple(a.strides), tuple(a.block_shape),
                getattr(a, "padding", None))
    raise TypeError(f"cannot key a launch argument of type {type(a).__name__}")


class LaunchCache:
    """Exact-argument launch memo for one ``@triton.jit`` function (CUDA only; the interpreter bypasses it)."""

    def __init__(self, fn):
        self.fn = fn
        self._names = list(fn.arg_names)
        params = getattr(fn, "params", None) or []
        self._defaults = {p.name: p.default for p in params if getattr(p, "has_default", False)}
        self._compiled: OrderedDict = OrderedDict()
        self.hits = 0
        self.misses = 0

    def __call__(self, grid: tuple, *args, **kwargs):
        """Launch ``fn[grid](*args, **kwargs)``; constexprs and options (num_warps, ...) go in ``kwargs``."""
        if interpreting() or os.environ.get("ATTNOPT_LAUNCH_CACHE", "1") == "0" or not args \
                or not isinstance(args[0], torch.Tensor) or not args[0].is_cuda:
            return self.fn[grid](*args, **kwargs)
        try:
            key = (tuple(grid), torch.cuda.current_device(), tuple(_arg_key(a) for a in args),
                   tuple(sorted((k, _arg_key(v)) for k, v in kwargs.items())))
        except TypeError:
            return self.fn[grid](*args, **kwargs)
        hit = self._compiled.get(key)
        if hit is not None:
            self._compiled.move_to_end(key)
            compiled, rest = hit
            self.hits += 1
            compiled[tuple(grid) + (1,) * (3 - len(grid))](*args, *rest)  # the compiled runner wants 3 dims
            return compiled
        self.misses += 1
        compiled = self.fn[grid](*args, **kwargs)
        if compiled is not None and hasattr(compiled, "__getitem__"):
            rest = [kwargs[n] if n in kwargs else self._defaults.get(n) for n in self._names[len(args):]]
            self._compiled[key] = (compiled, rest)  # no tensor kept alive: only constexprs and defaults
            while len(self._compiled) > MAX_ENTRIES:
                self._compiled.popitem(last=False)
        return compiled
