"""``lower``: the rewritten graphs call ``attnopt.decode_attention`` and compute what the originals computed."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from attnopt.config import OptimizeConfig
from attnopt.runtime.ops import CALL_COUNTS, reset_runtime_state

from passgraphs import (aot, dynamo, eager_hf, export, float_mask, fx_trace, op_nodes, qkv, rand_bool_mask,
                        repeat_kv, sdpa_gqa, sdpa_repeat_kv)

TOL = dict(atol=2e-5, rtol=2e-5)

# (G, L, D, N): the odd shapes of DESIGN.md, covered pairwise rather than as a full product.
SHAPES = [(1, 1, 64, 7), (3, 2, 80, 37), (4, 4, 96, 65), (8, 1, 128, 129), (3, 4, 64, 1), (8, 2, 80, 63),
          (4, 1, 128, 33), (1, 2, 96, 17)]


def _case(G, L, D, N, B=2, Hkv=2):
    q, k, v = qkv(B=B, Hq=G * Hkv, Hkv=Hkv, L=L, N=N, D=D)
    return q, k, v


@pytest.mark.parametrize("G,L,D,N", SHAPES)
@pytest.mark.parametrize("mask", ["none", "bool", "float"])
def test_sdpa_dynamo_matches(G, L, D, N, mask):
    if N <= L:
        N = L + 1
    q, k, v = _case(G, L, D, N)
    m = None
    if mask != "none":
        m = rand_bool_mask(2, L, N)
        m = m if mask == "bool" else float_mask(m)
    r = dynamo(sdpa_gqa, q, k, v, m)
    assert r.count("sdpa") == 1
    assert len(op_nodes(r.gm)) == 1
    torch.testing.assert_close(r.out, sdpa_gqa(q, k, v, m), **TOL)


@pytest.mark.parametrize("G,L,D,N", SHAPES[:4])
def test_eager_hf_dynamo_repeat_kv_reads_unexpanded_cache(G, L, D, N):
    q, k, v = _case(G, L, D, N)
    m = float_mask(rand_bool_mask(2, L, N + 5))  # longer than N: the graph slices it
    r = dynamo(eager_hf, q, k, v, m)
    assert r.count("eager_matmul") == 1
    (op,) = op_nodes(r.gm)
    k_arg, v_arg = op.args[1], op.args[2]
    assert k_arg.op == "placeholder" and v_arg.op == "placeholder"  # no expand/reshape copy feeds the op
    assert not [n for n in r.gm.graph.nodes if n.op == "call_method" and n.target in ("expand", "reshape")
                and n.users and op in n.users]
    assert not any(n.target == torch.matmul for n in r.gm.graph.nodes)  # the eager chain is gone
    assert r.sites[0].gqa_source == ("repeat_kv" if G > 1 else "mha")
    torch.testing.assert_close(r.out, eager_hf(q, k, v, m), **TOL)


@pytest.mark.parametrize("G,L,D,N", SHAPES[:3])
def test_sdpa_repeat_kv_dynamo(G, L, D, N):
    q, k, v = _case(G, L, D, N)
    m = rand_bool_mask(2, L, N)
    r = dynamo(sdpa_repeat_kv, q, k, v, m)
    (op,) = op_nodes(r.gm)
    assert op.args[1].op == "placeholder"
    assert not [n for n in r.gm.graph.nodes if n.op == "call_method" and n.target in ("expand", "reshape")]
    torch.testing.assert_close(r.out, sdpa_repeat_kv(q, k, v, m), **TOL)


@pytest.mark.parametrize("L,N", [(1, 9), (2, 9), (4, 13)])
def test_is_causal_top_left(L, N):
    q, k, v = _case(3, L, 64, N)

    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    r = dynamo(f, q, k, v)
    assert r.count("sdpa") == 1 and r.sites[0].is_causal and r.sites[0].mask_kind == "causal"
    torch.testing.assert_close(r.out, f(q, k, v), **TOL)


@pytest.mark.parametrize("fn", [sdpa_gqa, eager_hf], ids=["sdpa", "eager"])
@pytest.mark.parametrize("G,L,D,N", [(3, 2, 80, 37), (4, 1, 64, 9)])
def test_aot_autograd_aten_graph(fn, G, L, D, N):
    q, k, v = _case(G, L, D, N)
    m = rand_bool_mask(2, L, N)
    m = m if fn is sdpa_gqa else float_mask(m)
    r = aot(fn, q, k, v, m)
    expected = "sdpa_flash_cpu" if fn is sdpa_gqa else "eager_bmm"
    assert r.count(expected) == 1, r.ctx.rewrite_counts
    (op,) = op_nodes(r.gm)
    assert op.args[1].op == "placeholder"
    assert not any(str(n.target) == "aten.bmm.default" for n in r.gm.graph.nodes)
    torch.testing.assert_close(r.out, fn(q, k, v, m), **TOL)


@pytest.mark.parametrize("decompose", [False, True])
@pytest.mark.parametrize("fn", [sdpa_gqa, sdpa_repeat_kv, eager_hf], ids=["sdpa", "sdpa_repeat_kv", "eager"])
def test_export(fn, decompose):
    q, k, v = _case(3, 2, 64, 21)
    m = float_mask(rand_bool_mask(2, 2, 21))
    r = export(fn, q, k, v, m, decompose=decompose)
    assert r.count() == 1, [s.unsupported for s in r.sites]
    (op,) = op_nodes(r.gm)
    assert op.args[1].op == "placeholder"
    torch.testing.assert_close(r.out, fn(q, k, v, m), **TOL)


@pytest.mark.parametrize("fn", [sdpa_gqa, eager_hf], ids=["sdpa", "eager"])
def test_make_fx(fn):
    q, k, v = _case(4, 1, 96, 19)
    m = float_mask(rand_bool_mask(2, 1, 19))
    r = fx_trace(fn, q, k, v, m)
    assert r.count() == 1 and len(op_nodes(r.gm)) == 1
    torch.testing.assert_close(r.out, fn(q, k, v, m), **TOL)


def test_einsum_masked_fill():
    def f(q, k, v, keep):
        s = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(q.shape[-1])
        s = s.masked_fill(~keep, float("-inf"))
        return torch.einsum("bhqk,bhkd->bhqd", s.softmax(-1), v)

    q, k, v = qkv(B=2, Hq=4, Hkv=4, L=2, N=23, D=80)
    keep = rand_bool_mask(2, 2, 23)
    r = dynamo(f, q, k, v, keep)
    assert r.count("eager_einsum") == 1
    assert r.sites[0].mask_kind == "arbitrary" and r.sites[0].scale == pytest.approx(1 / math.sqrt(80))
    torch.testing.assert_close(r.out, f(q, k, v, keep), **TOL)


@pytest.mark.parametrize("build", [dynamo, aot, fx_trace], ids=["dynamo", "aot", "make_fx"])
@pytest.mark.parametrize("swap", ["scores", "values", "both"])
def test_einsum_with_its_operands_swapped(build, swap):
    """An einsum's operands commute: ``einsum("bhkd,bhqd->bhqk", k, q)`` is the score product and
    ``einsum("bhkd,bhqk->bhqd", v, p)`` the value product; the output's letters say which operand is which."""
    def f(q, k, v, keep):
        if swap in ("scores", "both"):
            s = torch.einsum("bhkd,bhqd->bhqk", k, q)
        else:
            s = torch.einsum("bhqd,bhkd->bhqk", q, k)
        p = (s / math.sqrt(q.shape[-1])).masked_fill(~keep, float("-inf")).softmax(-1)
        if swap in ("values", "both"):
            return torch.einsum("bhkd,bhqk->bhqd", v, p)
        return torch.einsum("bhqk,bhkd->bhqd", p, v)

    q, k, v = qkv(B=2, Hq=4, Hkv=4, L=2, N=23, D=64)
    keep = rand_bool_mask(2, 2, 23)
    r = build(f, q, k, v, keep)
    assert r.count() == 1, r.sites
    assert r.sites[0].kv_len == 23 and r.sites[0].q_len == 2
    torch.testing.assert_close(r.out, f(q, k, v, keep), **TOL)


@pytest.mark.parametrize("build", [dynamo, aot], ids=["dynamo", "aot"])
def test_einsum_whose_equation_makes_v_the_probabilities_is_left_alone(build):
    """``einsum("bhqk,bhkd->bhqd", v, p)`` labels V as the probabilities: it computes v @ p, not attention. With
    q_len = N = D every shape agrees, so only the operands' roles tell; nothing is rewritten and the answer is the
    original's."""
    def f(q, k, v):
        p = torch.einsum("bhqd,bhkd->bhqk", q, k).softmax(-1)
        return torch.einsum("bhqk,bhkd->bhqd", v, p)

    q, k, v = qkv(B=1, Hq=2, Hkv=2, L=8, N=8, D=8)
    r = build(f, q, k, v)
    assert r.count() == 0, r.sites
    torch.testing.assert_close(r.out, f(q, k, v), **TOL)


def test_repeat_interleave_and_scale_on_q():
    def f(q, k, v):
        k = k.repeat_interleave(3, dim=1)
        v = torch.repeat_interleave(v, 3, dim=1)
        s = (q / 8.0) @ k.transpose(-1, -2)
        return torch.softmax(s, dim=-1) @ v

    q, k, v = qkv(B=1, Hq=6, Hkv=2, L=4, N=31, D=64)
    r = dynamo(f, q, k, v)
    assert r.count("eager_matmul") == 1
    site = r.sites[0]
    assert site.gqa_source == "repeat_interleave" and site.kv_heads == 2 and site.scale == pytest.approx(0.125)
    (op,) = op_nodes(r.gm)
    assert op.args[1].op == "placeholder"
    torch.testing.assert_close(r.out, f(q, k, v), **TOL)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_dtype_preserved(dtype):
    """A low-precision eager chain whose additive mask provably holds only 0 and -inf is rewritten; the same
    chain with a graph-input mask (which may hold finfo.min, whose fully hidden rows the original rounds in
    this dtype) is left alone with that reason."""
    q, k, v = qkv(B=1, Hq=6, Hkv=2, L=1, N=40, D=64, dtype=dtype)
    keep = rand_bool_mask(1, 1, 40)

    def f(q, k, v, keep):
        return eager_hf(q, k, v, torch.zeros((), dtype=q.dtype).masked_fill(~keep, float("-inf")))

    untouched = dynamo(eager_hf, q, k, v, float_mask(keep, dtype))
    assert untouched.count() == 0 and "cannot be reproduced" in untouched.sites[0].unsupported
    r = dynamo(f, q, k, v, keep)
    assert r.count() == 1 and r.out.dtype == dtype
    ref = f(q.float(), k.float(), v.float(), keep)
    tol = 2e-3 if dtype == torch.float16 else 2e-2
    torch.testing.assert_close(r.out.float(), ref, atol=tol, rtol=tol)


def test_symbolic_kv_len_is_rewritten():
    """The second decode step of a DynamicCache recompiles with a symbolic KV length (mark_dynamic here)."""
    q, k, v = qkv(B=1, Hq=4, Hkv=2, L=1, N=29, D=64)
    torch._dynamo.mark_dynamic(k, 2)
    torch._dynamo.mark_dynamic(v, 2)
    r = dynamo(sdpa_gqa, q, k, v, dynamic=None)
    site = r.sites[0]
    assert site.kv_len is None and site.kv_len_hint == 29 and site.q_len == 1, site
    assert r.count("sdpa") == 1
    torch.testing.assert_close(r.out, sdpa_gqa(q, k, v), **TOL)


def test_valid_len_wired_for_masks_under_kernel_plans_that_need_one():
    """stream-K gets a device valid length from the mask (one ``valid_len_from_mask`` node); split-KV reads the mask
    over its own tiles (``mask_tiles.py``) and gets none, nor does the dense plan; all equal SDPA."""
    q, k, v = qkv(B=2, Hq=4, Hkv=2, L=1, N=21, D=64)
    m = rand_bool_mask(2, 1, 21)
    for kind, scans in (("stream_k", 1), ("split_kv", 0), ("dense", 0)):
        r = dynamo(sdpa_gqa, q, k, v, m, config=OptimizeConfig(force_plan=kind))
        assert not r.sites[0].unsupported, r.sites[0].unsupported
        assert r.reports[0].chosen.kind == kind
        assert len(op_nodes(r.gm, "attnopt.valid_len_from_mask.default")) == scans, kind
        assert len(op_nodes(r.gm, "attnopt.decode_attention.default")) == 1, kind
        torch.testing.assert_close(r.out, sdpa_gqa(q, k, v, m), atol=1e-4, rtol=1e-4)


def test_split_kv_over_a_static_mask_runs_the_mask_tiles_kernel(monkeypatch):
    """A static cache through SDPA with HF's bool mask (B, 1, 1, N) under split-KV, the Triton kernels interpreted: the
    lowered graph launches no mask scan, the kernel reads the mask over its own tiles, and NaN in the cache's unused
    slots (past each row's tokens) never reaches the output."""
    from attnopt.runtime.kernels import interpreting

    if not interpreting():
        pytest.skip("needs TRITON_INTERPRET=1 (tests/conftest.py sets it)")
    monkeypatch.setenv("ATTNOPT_CPU_KERNELS", "interpret")
    q, k, v = qkv(B=2, Hq=4, Hkv=2, L=1, N=150, D=64)
    lengths = torch.tensor([13, 97])
    m = (torch.arange(150)[None, :] < lengths[:, None])[:, None, None, :]
    ref = sdpa_gqa(q, k, v, m)
    for b, n in enumerate(lengths.tolist()):
        k[b, :, n:] = float("nan")
        v[b, :, n:] = float("nan")
    r = dynamo(sdpa_gqa, q, k, v, m, config=OptimizeConfig(force_plan="split_kv"))
    assert r.reports[0].chosen.kind == "split_kv" and not op_nodes(r.gm, "attnopt.valid_len_from_mask.default")
    torch.testing.assert_close(r.out, ref, atol=1e-4, rtol=1e-4)


def test_verify_wraps_with_check_close():
    reset_runtime_state()
    q, k, v = qkv(B=1, Hq=4, Hkv=2, L=2, N=15, D=64)
    r = dynamo(sdpa_gqa, q, k, v, config=OptimizeConfig(force_plan="dense", verify=True, verify_calls=1))
    assert len(op_nodes(r.gm, "attnopt.check_close.default")) == 1
    assert len(op_nodes(r.gm)) == 1
    key = r.reports[0].key
    assert key and CALL_COUNTS["verify:" + key] == 1 and CALL_COUNTS[key] == 1
    torch.testing.assert_close(r.out, sdpa_gqa(q, k, v), **TOL)


def test_skip_sites_by_node_and_module():
    q, k, v = qkv(B=1, Hq=4, Hkv=2, L=1, N=15, D=64)
    r = dynamo(sdpa_gqa, q, k, v)
    name = r.sites[0].node
    r = dynamo(sdpa_gqa, q, k, v, config=OptimizeConfig(force_plan="dense", skip_sites=(name,)))
    assert r.count() == 0 and not op_nodes(r.gm)
    assert r.reports[0].reason_untouched == "skipped by config.skip_sites"


def test_report_marks_rewritten_and_key():
    q, k, v = qkv(B=1, Hq=4, Hkv=2, L=1, N=15, D=64)
    r = dynamo(lambda q, k, v: sdpa_gqa(q, k, v) + sdpa_gqa(q * 2, k, v), q, k, v)
    assert r.count("sdpa") == 2
    keys = [s.key for s in r.reports]
    assert all(s.rewritten for s in r.reports) and len(set(keys)) == 2
    assert all(key.startswith(r.ctx.graph_id + ":") for key in keys)


@pytest.mark.parametrize("build", [dynamo, aot], ids=["dynamo", "aot"])
def test_runtime_scalar_scale_is_folded_into_q(build):
    """A 0-d scale tensor (e.g. a buffer) is not a compile-time constant: lower multiplies q by it."""
    def f(q, k, v, temp):
        s = (q @ k.transpose(-1, -2)) * 0.125 / temp
        return torch.softmax(s, -1) @ v

    q, k, v = qkv(B=1, Hq=4, Hkv=4, L=2, N=21, D=64)
    temp = torch.tensor(0.7)
    r = build(f, q, k, v, temp)
    assert r.count() == 1 and r.sites[0].scale == pytest.approx(0.125)
    torch.testing.assert_close(r.out, f(q, k, v, temp), **TOL)


def _einsum_attn(q, k, v, keep):
    k, v = repeat_kv(k, q.shape[1] // k.shape[1]), repeat_kv(v, q.shape[1] // v.shape[1])
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~keep, float("-inf"))
    return torch.einsum("bhqk,bhkd->bhqd", s.softmax(-1), v)


@pytest.mark.parametrize("build", [fx_trace, aot, export], ids=["make_fx", "aot", "export"])
def test_einsum_at_aten_level(build):
    """aten decomposes einsum into unsqueeze/permute/view/bmm chains; the layout tracker sees through them."""
    q, k, v = qkv(B=2, Hq=6, Hkv=2, L=2, N=21, D=64)
    keep = rand_bool_mask(2, 2, 21)
    r = build(_einsum_attn, q, k, v, keep)
    assert r.count() == 1 and r.sites[0].gqa_source == "repeat_kv", r.sites
    (op,) = op_nodes(r.gm)
    assert op.args[1].op == "placeholder"
    torch.testing.assert_close(r.out, _einsum_attn(q, k, v, keep), **TOL)


@pytest.mark.parametrize("build", [dynamo, aot], ids=["dynamo", "aot"])
def test_cache_in_bnhd_layout_is_read_through_a_permute(build):
    """K/V kept as (B, N, H, D) and permuted in the graph: the op gets free permute views, no copies."""
    def f(q, k_bnhd, v_bnhd):
        s = q @ k_bnhd.permute(0, 2, 3, 1) * 0.125
        return torch.softmax(s, -1) @ v_bnhd.transpose(1, 2)

    q = torch.randn(2, 4, 2, 64)
    k, v = torch.randn(2, 19, 4, 64), torch.randn(2, 19, 4, 64)
    r = build(f, q, k, v)
    assert r.count() == 1 and r.sites[0].kv_len == 19 and r.sites[0].kv_heads == 4, r.sites
    (op,) = op_nodes(r.gm)
    assert str(op.args[1].target) == "aten.permute.default" and op.args[1].args[0].op == "placeholder"
    torch.testing.assert_close(r.out, f(q, k, v), **TOL)


@pytest.mark.parametrize("build", [dynamo, aot, fx_trace], ids=["dynamo", "aot", "make_fx"])
def test_size_one_dims_mqa(build):
    """B = 1, one KV head (MQA, G = 8), q_len = 1: size-1 dims make the aten layouts ambiguous; still exact."""
    q, k, v = qkv(B=1, Hq=8, Hkv=1, L=1, N=17, D=64)
    m = float_mask(rand_bool_mask(1, 1, 17))
    r = build(eager_hf, q, k, v, m)
    assert r.count() == 1 and r.sites[0].kv_heads == 1 and r.sites[0].q_heads == 8, r.sites
    torch.testing.assert_close(r.out, eager_hf(q, k, v, m), **TOL)


def test_restride_matches_original_layout():
    """aten graphs may ``view`` the attention output under its original strides: lower reproduces them."""
    import torch.fx as fx

    from attnopt.passes.lower import _restride

    like = torch.empty(2, 5, 3, 8).transpose(1, 2)  # (2, 3, 5, 8) with (B, L, H, D) memory order
    g = fx.Graph()
    x = g.placeholder("x")
    g.output(_restride(g, x, like))
    gm = fx.GraphModule(torch.nn.Module(), g)
    src = torch.randn(2, 3, 5, 8)
    out = gm(src)
    assert out.stride() == like.stride() and torch.equal(out, src)
    g2 = fx.Graph()
    y = g2.placeholder("y")
    assert _restride(g2, y, torch.empty(2, 3, 5, 8)) is y  # contiguous: nothing inserted


@pytest.mark.parametrize("build", [dynamo, aot], ids=["dynamo", "aot"])
def test_gpt2_style_eager(build):
    """GPT-2's eager attention: scale as a division by torch.full([], sqrt(d)), causal where() with finfo.min,
    softmax then ``.type(dtype)``."""
    def f(q, k, v):
        w = torch.matmul(q, k.transpose(-1, -2))
        w = w / torch.full([], v.size(-1) ** 0.5, dtype=w.dtype, device=w.device)
        n, L = k.size(-2), q.size(-2)
        causal = torch.ones(n, n, dtype=torch.bool).tril()[None, None, n - L:n, :n]
        w = torch.where(causal, w, torch.full([], torch.finfo(w.dtype).min, dtype=w.dtype))
        w = F.softmax(w, dim=-1).type(v.dtype)
        return torch.matmul(w, v)

    q, k, v = qkv(B=2, Hq=4, Hkv=4, L=2, N=13, D=64)
    r = build(f, q, k, v)
    # where(causal, w, finfo.min) replaces scores by a finite value: a row it hides whole gives the mean of V,
    # which the rewrite does not reproduce, so the site is found (scale read) and left alone with that reason.
    assert r.count() == 0 and r.sites[0].scale == pytest.approx(0.125), r.sites
    assert "finite masking value" in r.sites[0].unsupported
    torch.testing.assert_close(r.out, f(q, k, v), **TOL)


def test_verify_raises_on_a_wrong_rewrite():
    """``verify`` compares against the original: a (deliberately) wrong scale is caught on the first call."""
    import dataclasses

    from attnopt.passes import detect, lower, make_context, plan
    from attnopt.runtime.ops import VerificationError
    from torch.fx.experimental.proxy_tensor import make_fx

    reset_runtime_state()
    q, k, v = qkv(B=1, Hq=4, Hkv=2, L=1, N=15, D=64)
    gm = make_fx(lambda q, k, v: sdpa_gqa(q, k, v), tracing_mode="fake")(q, k, v)
    ctx = make_context(OptimizeConfig(force_plan="dense", verify=True), (q, k, v))
    plan(detect(gm, ctx), ctx)
    rep = ctx.report.sites[0]
    rep.site = dataclasses.replace(rep.site, scale=rep.site.scale * 3)  # simulate a bug in the rewrite
    gm = lower(gm, ctx)
    with pytest.raises(VerificationError, match="differs from the original"):
        gm(q, k, v)


@pytest.mark.parametrize("plan", ["dense", "split_kv"])
def test_verify_accepts_nan_where_the_original_has_nan(plan):
    """An eager softmax over a fully masked row gives NaN, and so does the rewrite (``empty_rows == "nan"``): equal.
    ``verify`` compared |new - ref| <= bound, which is False for NaN, and raised on a correct rewrite."""
    import attnopt

    def f(q, k, v, m):
        s = q @ k.repeat_interleave(2, 1).transpose(-1, -2) * 0.125
        return s.masked_fill(~m, float("-inf")).softmax(-1) @ v.repeat_interleave(2, 1)

    reset_runtime_state()
    q, k, v = qkv(B=2, Hq=4, Hkv=2, L=1, N=15, D=64)
    m = torch.rand(2, 1, 1, 15, generator=torch.Generator().manual_seed(0)) > 0.3
    m[0] = False  # batch row 0: no visible key
    opt = attnopt.optimize(f, inner_backend="eager", verify=True, force_plan=plan)
    out = opt(q, k, v, m)
    assert bool(torch.isnan(out[0]).all()) and not bool(torch.isnan(out[1]).any())
    (site,) = attnopt.last_plans(opt).sites
    assert site.rewritten and site.verified == 1


def test_symbolic_batch_valid_len_uses_sym_size():
    kinds = ["stream_k"]  # a plan that takes a device valid length (split-KV reads the mask itself)
    q, k, v = qkv(B=3, Hq=4, Hkv=2, L=1, N=21, D=64)
    m = rand_bool_mask(3, 1, 21)
    for t in (q, k, v, m):
        torch._dynamo.mark_dynamic(t, 0)
    r = dynamo(sdpa_gqa, q, k, v, m, config=OptimizeConfig(force_plan=kinds[0]), dynamic=None)
    if r.sites[0].unsupported:
        pytest.skip(f"{kinds[0]} does not apply here: {r.sites[0].unsupported}")
    assert r.sites[0].batch is None and r.count() == 1
    (vl,) = op_nodes(r.gm, "attnopt.valid_len_from_mask.default")
    assert not isinstance(vl.args[1], int)  # the batch comes from a sym_size node
    torch.testing.assert_close(r.out, sdpa_gqa(q, k, v, m), atol=1e-4, rtol=1e-4)


def test_runtime_scale_tensor_does_not_promote_half_q():
    """A (1, 1, 1, 1) fp32 temperature times fp16 q would promote q to fp32: lower casts it first."""
    def f(q, k, v, temp):
        return torch.softmax((q @ k.transpose(-1, -2)).float() * temp, -1).to(q.dtype) @ v

    q, k, v = qkv(B=1, Hq=4, Hkv=4, L=1, N=21, D=64, dtype=torch.float16)
    temp = torch.full((1, 1, 1, 1), 0.125)
    r = dynamo(f, q, k, v, temp)
    assert r.count() == 1 and r.out.dtype == torch.float16
    torch.testing.assert_close(r.out.float(), f(q.float(), k.float(), v.float(), temp), atol=2e-3, rtol=2e-3)


class _AttentionWithScaleAttribute(torch.nn.Module):
    """Hugging Face style: the softmax scale is a Python float attribute (``self.scaling``). Under
    ``dynamic=True`` dynamo turns it into a 0-d float64 graph input read back with ``.item()``: a symbolic float
    that the SDPA call specialises (dynamo then guards on it) and the eager chain keeps symbolic."""

    def __init__(self, eager: bool, scaling: float):
        super().__init__()
        self.eager, self.scaling = eager, scaling

    def forward(self, q, k, v):
        g = q.shape[1] // k.shape[1]
        k, v = repeat_kv(k, g), repeat_kv(v, g)
        if not self.eager:
            return F.scaled_dot_product_attention(q, k, v, scale=self.scaling)
        s = torch.matmul(q, k.transpose(2, 3)) * self.scaling
        return torch.matmul(F.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype), v)


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "sdpa"])
def test_symbolic_float_scale_under_dynamic_shapes(eager):
    """The scale follows the attribute after a change: a symbolic scale is passed on at run time (eager chain),
    a specialised one is a constant that dynamo guards (SDPA recompiles), never a stale trace-time value."""
    from passgraphs import _runner

    torch._dynamo.reset()
    ctxs, gms = [], []
    run = _runner(OptimizeConfig(force_plan="dense"), ctxs, gms)
    mod = _AttentionWithScaleAttribute(eager, 0.3)
    compiled = torch.compile(mod, backend=lambda gm, ex: run(gm, ex).forward, dynamic=True, fullgraph=True)
    for n in (21, 40):
        q, k, v = qkv(B=1, Hq=6, Hkv=2, L=1, N=n, D=64)
        for t in (q, k, v):  # HF's head count and head dim come from constant views: static
            torch._dynamo.mark_static(t, 1)
            torch._dynamo.mark_static(t, 3)
        torch._dynamo.mark_static(q, 2)
        for scale in (0.3, 0.07):
            mod.scaling = scale
            want = F.scaled_dot_product_attention(q, repeat_kv(k, 3), repeat_kv(v, 3), scale=scale)
            torch.testing.assert_close(compiled(q, k, v), want, **TOL)
    sites = [m.site for c in ctxs for m in c.matches]
    assert sites and all(s.unsupported is None and s.kv_len is None for s in sites), sites
    assert all(c.rewrite_counts == {"eager_matmul" if eager else "sdpa": 1} for c in ctxs)
    assert all(len(op_nodes(gm)) == 1 for gm in gms)
    # The eager chain keeps the scale symbolic (one graph for both values); SDPA specialises it (one per value).
    assert len(ctxs) == (1 if eager else 2), len(ctxs)


def test_layers_sharing_a_mask_share_one_valid_len():
    """Three attention layers reading one mask compute its valid length once per call, not once per layer (it was a
    reduction and a host round trip per layer of every decode step)."""
    kinds = ["stream_k"]  # a plan that takes a device valid length (split-KV reads the mask itself)
    q, k, v = qkv(B=2, Hq=4, Hkv=2, L=1, N=21, D=64)
    m = rand_bool_mask(2, 1, 21)

    def three_layers(q, k, v, m):
        x = q
        for _ in range(3):
            x = sdpa_gqa(x, k, v, m) * 0.5 + q
        return x

    r = dynamo(three_layers, q, k, v, m, config=OptimizeConfig(force_plan=kinds[0]))
    if r.sites[0].unsupported:
        pytest.skip(f"{kinds[0]} does not apply here: {r.sites[0].unsupported}")
    assert r.count() == 3
    (vl,) = op_nodes(r.gm, "attnopt.valid_len_from_mask.default")
    assert len(vl.users) == 3
    torch.testing.assert_close(r.out, three_layers(q, k, v, m), atol=1e-4, rtol=1e-4)
