"""Values that a graph computes from constants alone, evaluated once at compile time.

ALiBi's slopes (``2 ** -(8 h / H)``, MPT's ``1 / 2 ** base``) are built in the traced forward from ``arange`` and
Python numbers: a handful of tiny launches per step, more than the slope term adds to the kernels. What depends on
no graph input, no attribute and no random op is the same on every call, so the lowering evaluates it here, on the
device the graph names, with the graph's own ops (the value is the one the original computes), and reads it as a
constant.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

#: Ops never folded: their value differs per call.
_RANDOM = ("rand", "normal", "bernoulli", "dropout", "multinomial", "uniform", "exponential", "poisson")


def constant_value(node: fx.Node, limit: int = 64) -> torch.Tensor | None:
    """The real tensor ``node`` evaluates to when it depends only on constants (at most ``limit`` nodes: calls of
    functions and methods whose inputs are numbers, devices, dtypes and such calls) and none of them is written in
    place anywhere in the graph (the value read at run time could then differ from the one evaluated), else None."""
    from .mutation import MutationIndex, mutated_args

    needed: set[fx.Node] = set()
    todo = [node]
    while todo:
        n = todo.pop()
        if n in needed:
            continue
        name = str(getattr(n.target, "__name__", n.target)).lower()
        if n.op not in ("call_function", "call_method") or any(r in name for r in _RANDOM) or len(needed) >= limit:
            return None
        needed.add(n)
        todo.extend(n.all_input_nodes)
    writes = MutationIndex(node.graph)
    if any(writes.written(n) or mutated_args(n) for n in needed):
        return None
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    env: dict[fx.Node, Any] = {}
    try:
        with unset_fake_temporarily(), torch.no_grad():
            for n in node.graph.nodes:  # graph order is a topological order
                if n not in needed:
                    continue
                args = fx.node.map_arg(n.args, env.__getitem__)
                kwargs = fx.node.map_arg(n.kwargs, env.__getitem__)
                if n.op == "call_function":
                    env[n] = n.target(*args, **kwargs)
                else:
                    env[n] = getattr(args[0], n.target)(*args[1:], **kwargs)
    except Exception:  # noqa: BLE001 - anything that does not evaluate here is simply not folded
        return None
    value = env.get(node)
    if not isinstance(value, torch.Tensor) or isinstance(value, torch._subclasses.FakeTensor) \
            or value.device.type == "meta":
        return None
    return value
