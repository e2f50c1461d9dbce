"""Launching a compiled Triton kernel with little host time, exactly.

``kernel[grid](...)`` binds every argument, specialises it, looks the compiled kernel up and builds launch
metadata on each call. Measured on the H100 machine's host (``benchmarks/results/experiments/launch-overhead-*.json``):
44 µs for the 71-argument split-KV kernel, against 6-8 µs for the compiled kernel's own launcher. An eager
decode step pays this once per layer and launch.

:class:`KernelLauncher` keeps, per kernel, the compiled kernels it has seen, under a key that determines the
compilation exactly:

* level 1: the grid, the constexprs and options, each pointer argument's dtype and 16-byte alignment, and the
  *exact* scalar arguments. A decode step over a static cache repeats this key, so it costs one tuple hash.
* level 2: the same with each scalar replaced by its Triton specialisation (an int equal to 1 is a constant;
  other ints are 32- or 64-bit by range and flagged when divisible by 16; floats and bools are not
  specialised). A dynamic cache, whose length and strides change every step, lands here: no recompilation
  and no binder, only the specialisation of the scalars. A ``tl.constexpr`` parameter passed by position (the
  decode kernels' head dims ``D`` and ``DV``) is compiled into the kernel: it keys by its value at both levels.
  (Keyed by its specialisation, D=80, 96 and 128, all multiples of 16, shared the kernel compiled first for any
  of them where the launch was otherwise alike (the same padded BLOCK_D): on the H100 the planner bench, one
  process over many shapes, returned rel err 1.04 at D=96 and 0.68 at D=80, and a sweep every D=128 launch wrong
  after the D=80 ones, main 6c52fb6.)

Only a miss at both levels goes through ``kernel[grid](...)``, which compiles (or finds) the kernel and
launches it. Launches go straight to the compiled kernel's launcher on the current device's current stream,
as Triton's own path does. The interpreter and active launch hooks (profilers) always take Triton's path.
``ATTNOPT_LAUNCH_CACHE=0`` turns the direct path off.
"""
from __future__ import annotations

import os
from typing import Any

import torch

from . import interpreting

#: Remembered exact launches per kernel; the table is emptied when it grows past this (a dynamic cache adds a
#: key per step, and a level-2 hit refills it at the cost of one specialisation).
MAX_EXACT = 512

_INT32_MIN, _INT32_MAX = -(2 ** 31), 2 ** 31 - 1
_INT64_MAX = 2 ** 63 - 1


def scalar_spec(x: Any):
    """Triton's specialisation of one non-constexpr scalar argument, as a hashable value (None when ``x`` is not
    a scalar this launcher knows). Checked against Triton's own ``native_specialize_impl`` in the tests."""
    t = type(x)
    if t is bool:
        return "u1"
    if t is int:
        if x == 1:
            return 1
        width = 32 if _INT32_MIN <= x <= _INT32_MAX else (64 if x <= _INT64_MAX else 65)
        return width if x % 16 else -width
    if t is float:
        return "fp32"
    return None


def _ptr_key(a: Any):
    """dtype and 16-byte alignment of a pointer argument; everything a tensor descriptor's type depends on."""
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() & 15
    base = getattr(a, "base", None)
    if isinstance(base, torch.Tensor):
        return ("desc", base.dtype, base.data_ptr() & 15, len(a.shape), tuple(a.block_shape),
                getattr(a, "padding", None), getattr(a, "round_f32_to_tf32", None))
    raise TypeError(f"not a pointer argument: {type(a).__name__}")


def constexpr_positions(fn) -> tuple[int, ...]:
    """Indices of ``fn``'s ``tl.constexpr`` parameters: from Triton's parameters where it has them, else (the
    interpreter's function) from the annotations of the Python function (strings under postponed evaluation)."""
    params = getattr(fn, "params", None)
    if params:
        return tuple(i for i, p in enumerate(params) if getattr(p, "is_constexpr", False))
    import inspect

    py = getattr(fn, "fn", fn)
    return tuple(i for i, p in enumerate(inspect.signature(py).parameters.values())
                 if "constexpr" in str(p.annotation))


def _hooks_active() -> bool:
    try:
        from triton import knobs
    except ImportError:  # pragma: no cover - older Triton: hooks live elsewhere; be safe
        return True
    hook = knobs.runtime.launch_enter_hook
    return hook is not None and (not hasattr(hook, "calls") or bool(hook.calls))


def _current_stream(device: int) -> int:
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw(device) if raw is not None else torch.cuda.current_stream(device).cuda_stream


class KernelLauncher:
    """Direct launches of one ``@triton.jit`` function (see the module docstring).

    The function's leading arguments named ``*_ptr`` or ``*_desc`` are its pointer arguments (tensors or tensor
    descriptors); every later positional argument must be an int, float or bool. Constexprs and launch options
    go in keyword arguments, whose values must be hashable.
    """

    def __init__(self, fn):
        self.fn = fn
        names = list(fn.arg_names)
        self._names = names
        self.n_ptr = next((i for i, n in enumerate(names) if not n.endswith(("_ptr", "_desc"))), len(names))
        params = getattr(fn, "params", None) or []
        self._defaults = {p.name: p.default for p in params if getattr(p, "has_default", False)}
        #: Positions (among the scalars, after the pointers) of the ``tl.constexpr`` parameters: keyed by value.
        self.constexpr_scalars = tuple(i - self.n_ptr for i in constexpr_positions(fn) if i >= self.n_ptr)
        self._exact: dict = {}
        self._by_spec: dict = {}
        self.direct = 0  # launches through a remembered kernel (either level)
        self.jit = 0  # launches through kernel[grid](...)

    def __call__(self, grid: tuple, *args, **kwargs):
        """Launch ``fn[grid](*args, **kwargs)``."""
        if interpreting() or os.environ.get("ATTNOPT_LAUNCH_CACHE", "1") == "0" or not args \
                or not isinstance(args[0], torch.Tensor) or not args[0].is_cuda or _hooks_active():
            return self.fn[grid](*args, **kwargs)
        n = self.n_ptr
        device = torch.cuda.current_device()
        meta = tuple(kwargs.items())
        ptrs = tuple([_ptr_key(a) for a in args[:n]])
        scalars = args[n:]
        grid3 = tuple(grid) + (1,) * (3 - len(grid))
        key1 = (device, grid3, meta, ptrs, scalars)
        entry = self._exact.get(key1)
        if entry is None:
            spec = self.scalar_key(scalars)
            if None in spec:  # an argument this launcher cannot key: Triton's path, nothing remembered
                self.jit += 1
                return self.fn[grid](*args, **kwargs)
            key2 = (device, meta, ptrs, spec)
            entry = self._by_spec.get(key2)
            if entry is None:
                self.jit += 1
                compiled = self.fn[grid](*args, **kwargs)
                if compiled is None or not hasattr(compiled, "function"):
                    return compiled
                rest = tuple(kwargs[m] if m in kwargs else self._defaults.get(m) for m in self._names[len(args):])
                entry = self._by_spec[key2] = (compiled, compiled.run, compiled.function,
                                               compiled.packed_metadata, rest)
                self._remember(key1, entry)
                return compiled
            self._remember(key1, entry)
        compiled, run, function, packed, rest = entry
        self.direct += 1
        run(grid3[0], grid3[1], grid3[2], _current_stream(device), function, packed, None, None, None, *args, *rest)
        return compiled

    def scalar_key(self, scalars: tuple) -> tuple:
        """The level-2 key of the scalar arguments: Triton's specialisation of each (``scalar_spec``; None where it
        has none), a positional constexpr's own value."""
        spec = [scalar_spec(x) for x in scalars]
        for i in self.constexpr_scalars:
            if i < len(spec) and spec[i] is not None:
                spec[i] = ("constexpr", scalars[i])
        return tuple(spec)

    def _remember(self, key1: tuple, entry: tuple) -> None:
        if len(self._exact) >= MAX_EXACT:
            self._exact.clear()
        self._exact[key1] = entry
