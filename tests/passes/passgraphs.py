"""Helpers for the pass tests: build dynamo / aot_autograd / make_fx / export graphs of small attention
functions, run ``attnopt.passes`` over them, and return the output together with the pass context."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn.functional as F

from attnopt.config import OptimizeConfig
from attnopt.passes import make_context, run_passes

DENSE = OptimizeConfig(force_plan="dense")
OP = "attnopt.decode_attention.default"


@dataclass
class Run:
    """The result of compiling ``fn`` with the passes: output, the pass contexts (one per graph), graphs."""

    out: Any
    ctxs: list
    gms: list

    @property
    def ctx(self):
        assert len(self.ctxs) == 1, f"expected one graph, got {len(self.ctxs)}"
        return self.ctxs[0]

    @property
    def gm(self):
        return self.gms[-1]

    @property
    def sites(self):
        return [m.site for c in self.ctxs for m in c.matches]

    @property
    def reports(self):
        return [s for c in self.ctxs for s in c.report.sites]

    def count(self, pattern: str | None = None) -> int:
        return sum(v for c in self.ctxs for k, v in c.rewrite_counts.items() if pattern is None or k == pattern)


def op_nodes(gm: fx.GraphModule, name: str = OP) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and str(n.target) == name]


def _runner(config: OptimizeConfig, ctxs: list, gms: list):
    def passes(gm, example_inputs):
        ctx = make_context(config, example_inputs)
        gm, _ = run_passes(gm, example_inputs, ctx=ctx)
        ctxs.append(ctx)
        gms.append(gm)
        return gm

    return passes


def dynamo(fn: Callable, *args, config: OptimizeConfig = DENSE, dynamic: bool | None = False) -> Run:
    """``torch.compile(fn, backend=<run the passes, then run the graph eagerly>)``."""
    torch._dynamo.reset()
    ctxs, gms = [], []
    run = _runner(config, ctxs, gms)

    def backend(gm, example_inputs):
        return run(gm, example_inputs).forward

    out = torch.compile(fn, backend=backend, dynamic=dynamic, fullgraph=True)(*args)
    return Run(out, ctxs, gms)


def aot(fn: Callable, *args, config: OptimizeConfig = DENSE) -> Run:
    """aot_autograd (inference, aten level): the passes run in the forward compiler."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    torch._dynamo.reset()
    ctxs, gms = [], []
    run = _runner(config, ctxs, gms)
    backend = aot_autograd(fw_compiler=lambda gm, ex: make_boxed_func(run(gm, ex).forward))
    with torch.no_grad():
        out = torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return Run(out, ctxs, gms)


def fx_trace(fn: Callable, *args, config: OptimizeConfig = DENSE, mode: str = "fake") -> Run:
    """``make_fx`` (aten level), then the passes, then the lowered module on ``args``."""
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(fn, tracing_mode=mode)(*args)
    ctx = make_context(config, args)
    gm, _ = run_passes(gm, args, ctx=ctx)
    return Run(gm(*args), [ctx], [gm])


class _Wrap(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def export(fn: Callable, *args, config: OptimizeConfig = DENSE, decompose: bool = False) -> Run:
    """``torch.export.export`` (optionally ``run_decompositions()``), then the passes on ``ep.module()``."""
    ep = torch.export.export(_Wrap(fn), tuple(args))
    if decompose:
        ep = ep.run_decompositions()
    gm = ep.module()
    ctx = make_context(config, args)
    gm, _ = run_passes(gm, args, ctx=ctx)
    return Run(gm(*args), [ctx], [gm])


# --------------------------------------------------------------------------------------------- attention forms
def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Hugging Face's GQA expansion: (B, Hkv, N, D) -> (B, Hkv * n_rep, N, D)."""
    b, h, s, d = x.shape
    if n_rep == 1:
        return x
    return x[:, :, None, :, :].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


def sdpa_gqa(q, k, v, mask=None):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


def sdpa_repeat_kv(q, k, v, mask=None):
    g = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, repeat_kv(k, g), repeat_kv(v, g), attn_mask=mask)


def eager_hf(q, k, v, mask=None):
    """transformers' ``eager_attention_forward``: repeat_kv, scale, sliced float mask, fp32 softmax, dropout."""
    g = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, g), repeat_kv(v, g)
    s = torch.matmul(q, k.transpose(2, 3)) * (q.shape[-1] ** -0.5)
    if mask is not None:
        s = s + mask[:, :, :, : k.shape[-2]]
    p = F.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
    p = F.dropout(p, p=0.0, training=False)
    return torch.matmul(p, v)


def float_mask(bool_mask: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """HF's additive mask: 0 where attended, finfo.min elsewhere."""
    return torch.zeros(bool_mask.shape, dtype=dtype).masked_fill(~bool_mask, torch.finfo(dtype).min)


def qkv(B=1, Hq=8, Hkv=2, L=1, N=37, D=64, Dv=None, dtype=torch.float32):
    q = torch.randn(B, Hq, L, D, dtype=dtype)
    k = torch.randn(B, Hkv, N, D, dtype=dtype)
    v = torch.randn(B, Hkv, N, Dv or D, dtype=dtype)
    return q, k, v


def rand_bool_mask(B, L, N, heads=1):
    m = torch.rand(B, heads, L, N) > 0.3
    m[..., 0] = True
    return m


def default_scale(d: int) -> float:
    return 1.0 / math.sqrt(d)
