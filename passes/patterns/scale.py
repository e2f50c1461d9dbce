"""Scale factors of the scores: ``x * c``, ``c * x`` and ``x / c`` with ``c`` a compile-time number, a one-element
tensor or a symbolic Python number (folded into q at run time by ``lower``).

Proves: the factor multiplies every score alike (a scalar), so it folds into one softmax scale.
"""
from __future__ import annotations

from typing import Any

import torch.fx as fx

from .nodes import _binary, _ndim, _number, is_python_scalar, kind, meta_dtype, meta_shape


#: One scale factor of an eager chain: (constant value, or None for a run-time 0-d tensor; that tensor; is_div).
Factor = tuple


def _scale_factor(node: fx.Node) -> tuple[Any, Factor] | None:
    """For ``x * c``, ``c * x`` or ``x / c`` with ``c`` a scalar (a constant, a run-time tensor of one
    element, or a symbolic Python number): ``(x, (value or None, c, is_div))``; None when ``node`` is not such
    a scaling."""
    k = kind(node)
    if k not in ("mul", "div"):
        return None
    a, b = _binary(node)
    if node.kwargs.get("rounding_mode") is not None:
        return None

    def scalar_like(c: Any) -> bool:
        if not isinstance(c, fx.Node):
            return isinstance(c, (int, float)) and not isinstance(c, bool)
        if is_python_scalar(c):
            return True
        cs = meta_shape(c)
        return cs is not None and all(isinstance(d, int) and d == 1 for d in cs) and \
            (meta_dtype(c) is None or meta_dtype(c).is_floating_point)

    if k == "mul":
        for x, c in ((a, b), (b, a)):
            if isinstance(x, fx.Node) and (_ndim(x) or 0) >= 2 and scalar_like(c):
                return x, (_number(c), c, False)
        return None
    if isinstance(a, fx.Node) and (_ndim(a) or 0) >= 2 and scalar_like(b):
        n = _number(b)
        if n == 0:
            return None
        return a, ((1.0 / n) if n is not None else None, b, True)
    return None
