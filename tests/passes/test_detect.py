"""``detect``: every attention site is found with the right fields; prefill and unsupported variants are
reported with a reason and left untouched."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from attnopt.config import OptimizeConfig
from attnopt.passes import make_context
from attnopt.passes.detect import detect
from attnopt.passes.patterns import PATTERNS, module_path

from passgraphs import (aot, dynamo, eager_hf, export, float_mask, fx_trace, op_nodes, qkv, rand_bool_mask,
                        repeat_kv, sdpa_gqa, sdpa_repeat_kv)

TOL = dict(atol=2e-5, rtol=2e-5)


def _untouched(r, reason_part: str):
    assert r.count() == 0 and not op_nodes(r.gm)
    assert len(r.sites) == 1, r.sites
    assert r.sites[0].unsupported and reason_part in r.sites[0].unsupported, r.sites[0].unsupported
    assert r.reports[0].reason_untouched == r.sites[0].unsupported


# ------------------------------------------------------------------------------------------- site fields
def test_sdpa_site_fields():
    q, k, v = qkv(B=2, Hq=9, Hkv=3, L=2, N=41, D=80, Dv=96)
    m = rand_bool_mask(2, 2, 41)
    r = dynamo(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=0.3, enable_gqa=True),
               q, k, v, m)
    (s,) = r.sites
    assert (s.pattern, s.batch, s.q_heads, s.kv_heads, s.head_dim, s.v_head_dim, s.q_len, s.kv_len) == \
        ("sdpa", 2, 9, 3, 80, 96, 2, 41)
    assert s.dtype == "float32" and s.scale == pytest.approx(0.3) and not s.is_causal
    assert s.gqa_source == "enable_gqa" and s.mask_kind == "arbitrary" and s.unsupported is None
    assert s.node == "scaled_dot_product_attention" and s.kv_len_hint == 41
    assert r.ctx.matches[0].output.name == s.node


def test_default_scale_and_no_mask():
    q, k, v = qkv(B=1, Hq=4, Hkv=4, L=1, N=10, D=96)
    r = dynamo(lambda q, k, v: F.scaled_dot_product_attention(q, k, v), q, k, v)
    (s,) = r.sites
    assert s.scale == pytest.approx(1 / math.sqrt(96)) and s.mask_kind == "none" and s.gqa_source == "mha"


@pytest.mark.parametrize("builder,pattern,gqa", [
    ("dynamo", "eager_matmul", "repeat_kv"), ("aot", "eager_bmm", "repeat_kv"), ("aot_sdpa", "sdpa_flash_cpu", "enable_gqa"),
    ("export", "eager_matmul", "repeat_kv"), ("export_sdpa", "sdpa", "enable_gqa"), ("export_sdpa_decomp", "eager_bmm", "repeat_kv"),
    ("make_fx", "eager_bmm", "repeat_kv"),
])
def test_site_fields_across_graph_levels(builder, pattern, gqa):
    q, k, v = qkv(B=2, Hq=6, Hkv=2, L=2, N=23, D=64)
    m = float_mask(rand_bool_mask(2, 2, 23))
    fn = sdpa_gqa if "sdpa" in builder else eager_hf
    run = {"dynamo": dynamo, "aot": aot, "aot_sdpa": aot, "export": export, "export_sdpa": export,
           "make_fx": fx_trace}.get(builder)
    r = export(fn, q, k, v, m, decompose=True) if builder == "export_sdpa_decomp" else run(fn, q, k, v, m)
    (s,) = r.sites
    assert s.pattern == pattern and s.gqa_source == gqa
    assert (s.batch, s.q_heads, s.kv_heads, s.head_dim, s.q_len, s.kv_len) == (2, 6, 2, 64, 2, 23)
    assert s.scale == pytest.approx(0.125) and s.unsupported is None and s.mask_kind == "arbitrary"
    torch.testing.assert_close(r.out, fn(q, k, v, m), **TOL)


def test_graph_order_and_module_path():
    class Attn(torch.nn.Module):
        def forward(self, q, k, v):
            return sdpa_gqa(q, k, v)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([Attn(), Attn()])

        def forward(self, q, k, v):
            return self.layers[1](self.layers[0](q, k, v), k, v)

    q, k, v = qkv(B=1, Hq=4, Hkv=2, L=1, N=12, D=64)
    r = dynamo(Model(), q, k, v)
    assert [s.module_path for s in r.sites] == ["layers.0", "layers.1"]
    assert r.count("sdpa") == 2
    r = dynamo(Model(), q, k, v, config=OptimizeConfig(force_plan="dense", skip_sites=("layers.0",)))
    assert r.count("sdpa") == 1 and [s.rewritten for s in r.reports] == [False, True]


def test_sliding_windows_config_marks_window_sites():
    """``config.sliding_windows`` (what ``attnopt.optimize`` reads off the model) names modules by path: their sites
    with a mask are rewritten as window sites (``site.window``, shown in the plan table), the op reads the keys from
    the start ``key_range_from_mask`` finds on; the other module's site is a plain one; the config survives JSON."""
    class Attn(torch.nn.Module):
        def forward(self, q, k, v, mask):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([Attn(), Attn()])

        def forward(self, q, k, v, mask):
            return self.layers[1](self.layers[0](q, k, v, mask), k, v, mask)

    q, k, v = qkv(B=1, Hq=2, Hkv=2, L=1, N=12, D=64)
    mask = torch.zeros(1, 1, 1, 12, dtype=torch.bool)
    mask[..., 6:] = True  # the last 6 keys: a window
    cfg = OptimizeConfig(force_plan="split_kv", sliding_windows={"layers.1": 6})
    assert OptimizeConfig.from_json(cfg.to_json()) == cfg and cfg.sliding_windows == (("layers.1", 6),)
    r = dynamo(Model(), q, k, v, mask, config=cfg)
    assert [s.rewritten for s in r.reports] == [True, True]
    assert [s.site.window for s in r.reports] == [None, 6]
    # only the window site finds its start, with its valid length, in one scan of the mask; the plain site's
    # split-KV programs read the mask over their own tiles (no scan ahead of it)
    assert len(op_nodes(r.gm, "attnopt.key_range_from_mask.default")) == 1
    assert not op_nodes(r.gm, "attnopt.valid_len_from_mask.default")
    assert "window=6" in r.ctx.report.format_table(width=200)
    torch.testing.assert_close(r.out, Model()(q, k, v, mask), **TOL)


def test_optimize_reads_sliding_windows_off_the_modules():
    """``attnopt.api.sliding_windows``: an int ``sliding_window`` attribute (Gemma 2, Qwen2 sliding layers), None on
    full layers, or ``config.sliding_window`` of an ``*Attention`` module without the attribute (Mistral)."""
    from types import SimpleNamespace

    from attnopt.api import sliding_windows

    class SlidingAttention(torch.nn.Module):
        def __init__(self, window):
            super().__init__()
            self.sliding_window = window

    class MistralLikeAttention(torch.nn.Module):
        def __init__(self, window):
            super().__init__()
            self.config = SimpleNamespace(sliding_window=window)

    model = torch.nn.ModuleDict({"a": SlidingAttention(16), "b": SlidingAttention(None), "c": MistralLikeAttention(32),
                                 "d": MistralLikeAttention(None), "e": SlidingAttention(True)})
    assert sliding_windows(model) == (("a", 16), ("c", 32))


def test_module_path_normalisation():
    class N:
        meta = {"nn_module_stack": {"a": ("L['self'].model", object), "b": ("L['self'].model.layers[3].self_attn", object)}}

    assert module_path(N()) == "model.layers.3.self_attn"
    N.meta = {"nn_module_stack": {"b": ("getattr(L['self'].model.layers, '12').self_attn", object)}}
    assert module_path(N()) == "model.layers.12.self_attn"
    N.meta = {}
    assert module_path(N()) == ""


def test_detect_is_non_mutating_and_reports_in_order():
    q, k, v = qkv(B=1, Hq=4, Hkv=2, L=1, N=12, D=64)
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(lambda q, k, v: eager_hf(q, k, v) + sdpa_gqa(q, k, v), tracing_mode="fake")(q, k, v)
    before = str(gm.graph)
    ctx = make_context(OptimizeConfig(), (q, k, v))
    detect(gm, ctx)
    assert str(gm.graph) == before
    assert [m.site.pattern for m in ctx.matches] == ["eager_bmm", "sdpa_flash_cpu"]


def test_patterns_registry_examples_are_detected():
    """Every documented eager example of a pattern that can be traced on CPU is found by detect."""
    q, k, v = qkv(B=1, Hq=6, Hkv=2, L=2, N=19, D=64)
    keep = rand_bool_mask(1, 2, 19)
    for name in ("sdpa", "eager_matmul", "eager_einsum"):
        fn = PATTERNS[name].example
        kk, vv = (repeat_kv(k, 3), repeat_kv(v, 3)) if name != "sdpa" else (k, v)
        r = dynamo(fn, q, kk, vv, keep if name == "eager_einsum" else float_mask(keep))
        assert [s.pattern for s in r.sites] == [name] and r.count(name) == 1
    r = fx_trace(PATTERNS["sdpa_flash_cpu"].example, q, repeat_kv(k, 3), repeat_kv(v, 3), float_mask(keep))
    assert r.count("sdpa_flash_cpu") == 1


# ------------------------------------------------------------------------------------------- decode rule
def test_prefill_static_is_not_rewritten():
    q, k, v = qkv(B=1, Hq=4, Hkv=2, L=12, N=12, D=64)
    _untouched(dynamo(sdpa_gqa, q, k, v), "prefill")


def test_prefill_long_query_is_not_rewritten():
    q, k, v = qkv(B=1, Hq=4, Hkv=2, L=17, N=40, D=64)
    _untouched(dynamo(sdpa_gqa, q, k, v), "max_decode_q_len=16")


def test_prefill_symbolic_q_len_is_not_rewritten():
    q, k, v = qkv(B=1, Hq=4, Hkv=2, L=5, N=40, D=64)
    torch._dynamo.mark_dynamic(q, 2)
    _untouched(dynamo(sdpa_gqa, q, k, v, dynamic=None), "prefill: symbolic q_len")


def test_min_kv_len():
    q, k, v = qkv(B=1, Hq=4, Hkv=2, L=1, N=40, D=64)
    r = dynamo(sdpa_gqa, q, k, v, config=OptimizeConfig(force_plan="dense", min_kv_len=64))
    _untouched(r, "min_kv_len=64")


# ------------------------------------------------------------------------------------------- unsupported variants
@pytest.mark.parametrize("spelling", ["gemma2", "cap_first", "aten"])
def test_softcapping_is_rewritten_with_its_cap(spelling):
    """Gemma 2's ``tanh(scores * scaling / cap) * cap`` (+ mask after the cap): the cap is read off the chain, the
    scale is the argument's (``scaling / cap``), the dense plan is refused with a reason (SDPA cannot cap) and the
    split-KV plan gives the original's output, in dynamo and aten graphs."""
    mask = torch.where(rand_bool_mask(1, 1, 33), 0.0, float("-inf"))

    def f(q, k, v, mask):
        s = q @ k.transpose(-1, -2)
        if spelling == "cap_first":
            s = torch.tanh((s / 50.0) * 0.125) * 50.0
        else:
            s = torch.tanh(s * 0.125 / 50.0) * 50.0
        return torch.softmax(s + mask, -1) @ v

    q, k, v = qkv(B=1, Hq=4, Hkv=4, L=1, N=33, D=64)
    build = aot if spelling == "aten" else dynamo
    r = build(f, q, k, v, mask, config=OptimizeConfig(force_plan="split_kv"))
    (s,) = r.sites
    assert s.softcap == 50.0 and math.isclose(s.scale, 0.125 / 50.0) and r.count() == 1, s
    torch.testing.assert_close(r.out, f(q, k, v, mask), **TOL)
    dense = build(f, q, k, v, mask)
    assert dense.count() == 0 and "logit softcapping (cap=50)" in (dense.reports[0].reason_untouched or "")


@pytest.mark.parametrize("case", ["mask_inside", "runtime_cap", "two_tanh", "constant_inside"])
def test_softcap_near_misses_are_left_alone(case):
    """Anything but the exact chain keeps its reason: a mask inside tanh, a cap that is a tensor, two tanh, a
    constant added inside tanh (not softmax-invariant there)."""
    mask = torch.where(rand_bool_mask(1, 1, 33), 0.0, float("-inf"))
    cap = torch.tensor(50.0)

    def f(q, k, v, mask, cap):
        s = q @ k.transpose(-1, -2) * 0.125
        if case == "mask_inside":
            s = torch.tanh(s / 50.0 + mask) * 50.0
        elif case == "runtime_cap":
            s = torch.tanh(s / cap) * cap + mask
        elif case == "two_tanh":
            s = torch.tanh(torch.tanh(s / 50.0) * 50.0) + mask
        else:
            s = torch.tanh(s / 50.0 + 1.0) * 50.0 + mask
        return torch.softmax(s, -1) @ v

    q, k, v = qkv(B=1, Hq=4, Hkv=4, L=1, N=33, D=64)
    r = dynamo(f, q, k, v, mask, cap, config=OptimizeConfig(force_plan="split_kv"))
    why = {"mask_inside": "inside the softcap", "runtime_cap": "run-time cap", "two_tanh": "more than one tanh",
           "constant_inside": "constant added to the scores inside"}[case]
    _untouched(r, why)
    torch.testing.assert_close(r.out, f(q, k, v, mask, cap))


@pytest.mark.parametrize("spelling", ["mpt", "bloom_no_padding", "single_slope"])
def test_alibi_bias_becomes_slopes(spelling):
    """An eager ALiBi bias built in the graph (MPT's ``slopes * arange(1 - n, 1)``, Bloom's ``slopes[:, None, None] *
    arange(n)``, one slope for all heads) plus a causal mask: the bias is proved a per-head slope times the key
    position, the op adds it from the slopes (``site.alibi``; the mask stays a mask) and the output is the
    original's. SDPA cannot take slopes, so the dense plan is refused with a reason."""
    def f(q, k, v, slopes, mask):
        n = k.shape[-2]
        if spelling == "mpt":
            bias = slopes.view(1, -1, 1, 1) * torch.arange(1 - n, 1, dtype=torch.int32).view(1, 1, 1, n)
        elif spelling == "bloom_no_padding":
            bias = (slopes[:, None, None] * torch.arange(n))[None]
        else:
            bias = slopes[:1].view(1, 1, 1, 1) * torch.arange(n, dtype=torch.float32)[None, None, None, :]
        s = q @ k.transpose(-1, -2) * 0.125 + bias
        return torch.softmax(s + mask, -1) @ v

    q, k, v = qkv(B=2, Hq=4, Hkv=4, L=2, N=33, D=64)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    mask = torch.where(rand_bool_mask(2, 2, 33), 0.0, float("-inf"))
    r = dynamo(f, q, k, v, slopes, mask, config=OptimizeConfig(force_plan="split_kv"))
    (site,) = r.sites
    assert r.count() == 1 and site.alibi and site.mask_kind == "arbitrary", site
    (op,) = op_nodes(r.gm)
    assert "alibi_slopes" in op.kwargs
    torch.testing.assert_close(r.out, f(q, k, v, slopes, mask), **TOL)
    dense = dynamo(f, q, k, v, slopes, mask)
    assert dense.count() == 0 and "ALiBi" in (dense.reports[0].reason_untouched or "")


@pytest.mark.parametrize("inner", ["eager", "aot_eager"])
def test_alibi_slopes_built_from_constants_are_folded_and_shared(inner):
    """Two layers reading one ALiBi bias whose slopes the forward builds from constants (MPT's ``1 / 2 ** base``):
    the slopes are evaluated once at compile time into one buffer both ops read, so no ``arange``/``pow`` nor a
    cast or copy of them is left to run per step; the output is the original's."""
    def slopes_of(heads):
        base = torch.arange(1, heads + 1, dtype=torch.int64).float() * (8 / heads)
        return 1.0 / torch.pow(2, base)

    def f(q, k, v):
        n = k.shape[-2]
        bias = slopes_of(q.shape[1]).view(1, -1, 1, 1) * torch.arange(1 - n, 1, dtype=torch.int32).view(1, 1, 1, n)
        x = torch.softmax(q @ k.transpose(-1, -2) * 0.125 + bias, -1) @ v
        return torch.softmax(x @ k.transpose(-1, -2) * 0.125 + bias, -1) @ v

    q, k, v = qkv(B=1, Hq=4, Hkv=4, L=1, N=33, D=64)
    r = (aot if inner == "aot_eager" else dynamo)(f, q, k, v, config=OptimizeConfig(force_plan="split_kv"))
    assert r.count() == 2 and all(s.alibi for s in r.sites)
    ops = op_nodes(r.gm)
    slopes = {op.kwargs["alibi_slopes"] for op in ops}
    assert len(slopes) == 1 and next(iter(slopes)).op == "get_attr"  # one folded buffer for both sites
    buffer = getattr(r.gm, next(iter(slopes)).target)
    torch.testing.assert_close(buffer, slopes_of(4), rtol=0, atol=0)
    names = {str(getattr(n.target, "__name__", n.target)) for n in r.gm.graph.nodes}
    assert not any("pow" in x or "arange" in x for x in names), names
    torch.testing.assert_close(r.out, f(q, k, v), **TOL)


def _bloom_attention(q, k, v, padding, mask, beta=1.0, bias_fill=None):
    """Bloom's eager attention (transformers 5.x): the ALiBi bias from the 2-D mask's cumsum, folded into
    ``baddbmm(alibi, q, k^T, beta, alpha)``, viewed (B, H, L, N), the additive mask, fp32 softmax, ``bmm`` with V."""
    b, h, n, d = k.shape
    slopes = 2.0 ** (-8.0 * torch.arange(1, h + 1, dtype=torch.float32) / h)
    positions = ((padding.cumsum(-1) - 1) * padding)[:, None, :]
    alibi = (slopes[..., None] * positions).reshape(b * h, 1, n).to(q.dtype)
    if bias_fill is not None:
        alibi = alibi.masked_fill(padding.repeat_interleave(h, 0)[:, None, :] == 0, bias_fill)
    s = alibi.baddbmm(batch1=q.reshape(b * h, -1, d), batch2=k.reshape(b * h, -1, d).transpose(-1, -2), beta=beta,
                      alpha=d ** -0.5)
    s = s.view(b, h, -1, n)
    if mask is not None:
        s = s + mask
    p = F.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.bmm(p.view(b * h, -1, n), v.reshape(b * h, -1, d))
    return out.view(b, h, -1, d)


def test_constant_slopes_written_in_place_are_not_folded():
    """A slopes tensor built from constants but edited in place (``base.mul_(2)`` after ``arange``) is not evaluated
    at compile time (the graph's value is the edited one): the result equals the original's either way."""
    from attnopt.passes.constants import constant_value

    def f(q, k, v):
        n = k.shape[-2]
        base = torch.arange(1, 5, dtype=torch.float32)  # 4 heads: constants alone
        base.mul_(2.0)
        slopes = 1.0 / torch.pow(2, base)
        bias = slopes.view(1, -1, 1, 1) * torch.arange(n, dtype=torch.float32).view(1, 1, 1, n)
        return torch.softmax(q @ k.transpose(-1, -2) * 0.125 + bias, -1) @ v

    import operator

    for edit in (False, True):  # 1 / 2 ** arange(1, 5), its arange edited in place (mul_) or not
        g = torch.fx.Graph()
        base = g.call_function(torch.arange, (1, 5), {"dtype": torch.float32})
        if edit:
            g.call_method("mul_", (base, 2.0))
        slopes = g.call_function(operator.truediv, (1.0, g.call_function(torch.pow, (2, base))))
        g.output(slopes)
        value = constant_value(slopes)
        # unedited: evaluated, equal to the eager value; edited: its arange's storage is written, so not folded
        assert value is None if edit else torch.equal(value, 1.0 / torch.pow(2, torch.arange(1, 5.0)))
    q, k, v = qkv(B=1, Hq=4, Hkv=4, L=1, N=33, D=64)
    r = dynamo(f, q, k, v, config=OptimizeConfig(force_plan="split_kv"))
    assert not any(n.op == "get_attr" and "alibi" in str(n.target) for n in r.gm.graph.nodes)
    torch.testing.assert_close(r.out, f(q, k, v), **TOL)


@pytest.mark.parametrize("case", ["padded", "no_mask", "hidden_row"])
def test_bloom_baddbmm_bias_joins_the_mask(case):
    """Bloom's ``baddbmm(alibi, q, k^T, alpha)``: the score product with its scale, the bias (positions from the
    padding mask's cumsum: not provably slope * j) viewed as (B, H, L, N) and added to the additive mask, one
    arbitrary mask for the op; left padding, no mask, and a bias that hides a whole row with -inf (the original's
    NaN row, which the op's NaN guard gives). Output equal to the original's."""
    q, k, v = qkv(B=2, Hq=4, Hkv=4, L=1, N=33, D=64)
    padding = torch.ones(2, 33, dtype=torch.long)
    padding[1, :5] = 0  # left padding of row 1
    hidden = torch.where(padding.bool(), 0.0, torch.finfo(torch.float32).min)[:, None, None, :]
    mask = None if case == "no_mask" else hidden
    fill = float("-inf") if case == "hidden_row" else None
    if case == "hidden_row":
        padding[0] = 0  # every key of row 0 gets -inf from the bias
    r = dynamo(_bloom_attention, q, k, v, padding, mask, 1.0, fill, config=OptimizeConfig(force_plan="split_kv"))
    (site,) = r.sites
    assert r.count("eager_baddbmm") == 1 and site.mask_kind == "arbitrary" and not site.alibi, site
    want = _bloom_attention(q, k, v, padding, mask, 1.0, fill)
    if case == "hidden_row":
        assert want[0].isnan().all() and r.out[0].isnan().all()
        want, got = want[1:], r.out[1:]
    else:
        got = r.out
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("case", ["beta", "half", "bool_mask"])
def test_bloom_baddbmm_left_alone_where_not_provable(case):
    """A scaled bias (beta != 1), the bias summed with the scores in fp16 (the original's rounding), a boolean mask
    with the bias: each is a reason, and the output stays the original's."""
    dtype = torch.float16 if case == "half" else torch.float32
    q, k, v = (t.to(dtype) for t in qkv(B=1, Hq=2, Hkv=2, L=1, N=17, D=64))
    padding = torch.ones(1, 17, dtype=torch.long)

    def f(q, k, v, padding):
        if case == "bool_mask":
            b, h, n, d = k.shape
            alibi = torch.zeros(b * h, 1, n, dtype=q.dtype)
            s = alibi.baddbmm(q.reshape(b * h, -1, d), k.reshape(b * h, -1, d).transpose(-1, -2), alpha=0.125)
            s = s.view(b, h, -1, n).masked_fill(padding[:, None, None, :] == 0, float("-inf"))
            p = F.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
            return torch.bmm(p.view(b * h, -1, n), v.reshape(b * h, -1, d)).view(b, h, -1, d)
        return _bloom_attention(q, k, v, padding, None, 0.5 if case == "beta" else 1.0)

    r = dynamo(f, q, k, v, padding, config=OptimizeConfig(force_plan="split_kv"))
    why = {"beta": "beta=0.5", "half": "float16", "bool_mask": "boolean mask with baddbmm"}[case]
    assert r.count() == 0 and why in (r.sites[0].unsupported or ""), r.sites[0]
    torch.testing.assert_close(r.out, f(q, k, v, padding))


@pytest.mark.parametrize("case", ["step2", "from_input", "half"])
def test_biases_that_are_not_provably_alibi_stay_masks(case):
    """A bias over positions with step 2, a bias read from an input, a bias rounded to fp16: not ALiBi; each is
    applied exactly as a general additive mask (the dense plan rewrites them)."""
    def f(q, k, v, slopes, given):
        n = k.shape[-2]
        if case == "step2":
            bias = slopes.view(1, -1, 1, 1) * torch.arange(0, 2 * n, 2, dtype=torch.float32).view(1, 1, 1, n)
        elif case == "from_input":
            bias = given
        else:
            bias = (slopes.view(1, -1, 1, 1) * torch.arange(n, dtype=torch.float32)).half().float()
        return torch.softmax(q @ k.transpose(-1, -2) * 0.125 + bias, -1) @ v

    q, k, v = qkv(B=1, Hq=4, Hkv=4, L=1, N=33, D=64)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    given = slopes.view(1, -1, 1, 1) * torch.arange(33.0)
    r = dynamo(f, q, k, v, slopes, given)
    assert r.count() == 1 and not r.sites[0].alibi and r.sites[0].mask_kind == "arbitrary", r.sites
    torch.testing.assert_close(r.out, f(q, k, v, slopes, given), **TOL)


def test_training_dropout_sdpa_is_not_rewritten():
    q, k, v = qkv(B=1, Hq=4, Hkv=4, L=1, N=33, D=64)
    r = dynamo(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=0.1), q, k, v)
    _untouched(r, "training-mode dropout (dropout_p=0.1)")


def test_training_dropout_eager_is_not_rewritten():
    def f(q, k, v):
        p = torch.softmax(q @ k.transpose(-1, -2) * 0.125, -1)
        return F.dropout(p, p=0.2, training=True) @ v

    q, k, v = qkv(B=1, Hq=4, Hkv=4, L=1, N=33, D=64)
    _untouched(dynamo(f, q, k, v), "training-mode dropout")


def test_used_lse_is_not_rewritten():
    def f(q, k, v):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(q, k, v)
        return out, lse

    q, k, v = qkv(B=1, Hq=4, Hkv=4, L=1, N=33, D=64)
    r = fx_trace(f, q, k, v)
    _untouched(r, "log-sum-exp")


def test_used_lse_in_training_graph_is_not_rewritten():
    """aot_autograd with grad: the backward needs the LSE, so the forward's fused SDPA is left alone."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from passgraphs import _runner

    q, k, v = qkv(B=1, Hq=4, Hkv=4, L=1, N=33, D=64)
    q.requires_grad_(True)
    ctxs, gms = [], []
    run = _runner(OptimizeConfig(force_plan="dense"), ctxs, gms)
    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=lambda gm, ex: make_boxed_func(run(gm, ex).forward),
                           bw_compiler=lambda gm, ex: make_boxed_func(gm.forward))
    out = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v), backend=backend)(q, k, v)
    out.sum().backward()
    sites = [m.site for c in ctxs for m in c.matches]
    assert sites and all(s.unsupported and "log-sum-exp" in s.unsupported for s in sites), sites
    assert sum(sum(c.rewrite_counts.values()) for c in ctxs) == 0


def test_softmax_that_is_not_attention_is_ignored():
    def f(x, w):
        return torch.softmax(x @ w, -1).sum(-1)

    r = dynamo(f, torch.randn(3, 5), torch.randn(5, 7))
    assert r.sites == []


def test_attention_weights_used_elsewhere_is_not_rewritten():
    def f(q, k, v):
        p = torch.softmax(q @ k.transpose(-1, -2) * 0.125, -1)
        return p @ v, p

    q, k, v = qkv(B=1, Hq=4, Hkv=4, L=1, N=33, D=64)
    _untouched(dynamo(f, q, k, v), "probabilities are also used")


def test_scale_after_mask_is_not_rewritten():
    def f(q, k, v, m):
        s = (q @ k.transpose(-1, -2) + m) * 0.125
        return torch.softmax(s, -1) @ v

    q, k, v = qkv(B=1, Hq=4, Hkv=4, L=1, N=33, D=64)
    m = float_mask(rand_bool_mask(1, 1, 33))
    _untouched(dynamo(f, q, k, v, m), "scaled after the mask")


# ------------------------------------------------------------------------------------------- mask kinds
def _static_cache_mask(cache_position, n, batch):
    """HF static-cache style: key positions from arange compared against the query positions."""
    kv_idx = torch.arange(n)
    m = kv_idx[None, None, None, :] <= cache_position[None, None, :, None]
    return m.expand(batch, 1, cache_position.shape[0], n)


def test_valid_length_mask_kind():
    def f(q, k, v, cache_position):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=_static_cache_mask(cache_position, k.shape[2], q.shape[0]),
                                              enable_gqa=True)

    q, k, v = qkv(B=2, Hq=4, Hkv=2, L=2, N=33, D=64)
    pos = torch.tensor([10, 11])
    r = dynamo(f, q, k, v, pos)
    assert r.sites[0].mask_kind == "valid_length" and r.count("sdpa") == 1
    torch.testing.assert_close(r.out, f(q, k, v, pos), **TOL)


@pytest.mark.parametrize("spelling", ["kv > q - w", "q - w < kv", "kv >= q + (1 - w)"])
def test_sliding_window_mask_is_a_window_site(spelling):
    """A mask with a window start ``key > query - w`` (Hugging Face's ``sliding_window_overlay``) is a sliding
    window (no module object needed): never "valid_length", rewritten with ``site.window`` read off the mask, the
    kernels reading the band's keys; the output is the original's."""
    def f(q, k, v, cache_position):
        kv_idx = torch.arange(k.shape[2])[None, None, None, :]
        qp = cache_position[None, None, :, None]
        start = {"kv > q - w": lambda: kv_idx > qp - 8, "q - w < kv": lambda: qp - 8 < kv_idx,
                 "kv >= q + (1 - w)": lambda: kv_idx >= qp + (1 - 8)}[spelling]()
        m = (kv_idx <= qp) & start
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)

    q, k, v = qkv(B=1, Hq=4, Hkv=2, L=2, N=33, D=64)
    pos = torch.tensor([20, 21])
    r = dynamo(f, q, k, v, pos, config=OptimizeConfig(force_plan="split_kv"))
    assert r.count("sdpa") == 1 and r.sites[0].window == 8 and r.sites[0].mask_kind == "arbitrary"
    # the key range read off the band's positions (passes/window.py): no scan of the mask at all
    assert list(r.ctx.window_ranges.values()) == ["band"]
    assert not op_nodes(r.gm, "attnopt.key_range_from_mask.default")
    assert not op_nodes(r.gm, "attnopt.valid_len_from_mask.default")
    assert not op_nodes(r.gm, "attnopt.key_start_from_mask.default")
    torch.testing.assert_close(r.out, f(q, k, v, pos), **TOL)


def _hf_padded_causal_mask(padding, cache_position, n):
    """transformers 5.x ``sdpa_mask`` with a 2-D padding mask: ones & (kv <= q) & padding[batch, kv], expanded."""
    b = padding.shape[0]
    batch_idx = torch.arange(b)[:, None, None, None]
    q_idx = cache_position[None, None, :, None]
    kv_idx = (torch.arange(n) + 0)[None, None, None, :]
    m = q_idx.new_ones((), dtype=torch.bool) & (kv_idx <= q_idx).to(q_idx.device)
    m = m & padding[batch_idx, kv_idx].to(q_idx.device)
    return m.expand(b, -1, cache_position.shape[0], n)


@pytest.mark.parametrize("form", ["bool", "where"])
def test_valid_length_with_padding_anded_in(form):
    """HF's static-cache mask with left padding AND-ed in, as a bool (sdpa) or ``where(m, 0, min)`` (eager)."""
    def f(q, k, v, padding, cache_position):
        m = _hf_padded_causal_mask(padding, cache_position, k.shape[2])
        if form == "where":
            m = torch.where(m, torch.zeros(()), torch.finfo(torch.float32).min)
            return eager_hf(q, k, v, m)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)

    q, k, v = qkv(B=2, Hq=6, Hkv=2, L=1, N=24, D=64)
    padding = torch.ones(2, 24, dtype=torch.bool)
    padding[1, :5] = False
    pos = torch.tensor([15])
    r = dynamo(f, q, k, v, padding, pos)
    assert r.sites[0].mask_kind == "valid_length" and r.count() == 1, r.sites
    torch.testing.assert_close(r.out, f(q, k, v, padding, pos), **TOL)


@pytest.mark.parametrize("build", [dynamo, aot, export], ids=["dynamo", "aot", "export"])
def test_valid_length_across_graph_levels(build):
    def f(q, k, v, cache_position):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=_static_cache_mask(cache_position, k.shape[2], 1),
                                              enable_gqa=True)

    q, k, v = qkv(B=1, Hq=4, Hkv=2, L=1, N=19, D=64)
    pos = torch.tensor([11])
    r = build(f, q, k, v, pos)
    assert [s.mask_kind for s in r.sites] == ["valid_length"] and r.count() == 1, r.sites
    torch.testing.assert_close(r.out, f(q, k, v, pos), **TOL)


@pytest.mark.parametrize("case", ["suffix", "or", "not", "step2", "band_from_input", "key_on_both_sides"])
def test_masks_that_are_not_provably_valid_length(case):
    """Position masks that keep no prefix of the keys, or that the recognizer cannot prove to: "arbitrary", and
    (not being a recognisable sliding window) still rewritten exactly through the mask path."""
    def f(q, k, v, cache_position, lo):
        n = k.shape[2]
        kv_idx = torch.arange(n)[None, None, None, :]
        qp = cache_position[None, None, :, None]
        m = {
            "suffix": lambda: kv_idx >= qp,                       # keys from the query on
            "or": lambda: (kv_idx <= qp) | (kv_idx > n - 3),      # a prefix plus the last keys
            "not": lambda: ~(kv_idx > qp),                        # a prefix, but through a negation
            "step2": lambda: torch.arange(0, 2 * n, 2)[None, None, None, :] <= qp,
            "band_from_input": lambda: (kv_idx <= qp) & (kv_idx >= lo),  # a lower bound that is no window
            "key_on_both_sides": lambda: kv_idx <= kv_idx.flip(-1),
        }[case]()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m.expand(q.shape[0], 1, q.shape[2], n), enable_gqa=True)

    q, k, v = qkv(B=1, Hq=4, Hkv=2, L=2, N=21, D=64)
    pos, lo = torch.tensor([12, 13]), torch.tensor([[[[4], [6]]]])
    r = dynamo(f, q, k, v, pos, lo)
    (s,) = r.sites
    assert s.mask_kind == "arbitrary" and s.unsupported is None and r.count() == 1, s
    torch.testing.assert_close(r.out, f(q, k, v, pos, lo), **TOL)


def test_placeholder_mask_is_arbitrary():
    q, k, v = qkv(B=1, Hq=4, Hkv=2, L=1, N=33, D=64)
    r = dynamo(sdpa_gqa, q, k, v, rand_bool_mask(1, 1, 33))
    assert r.sites[0].mask_kind == "arbitrary"


def test_mask_that_does_not_broadcast_is_not_rewritten():
    def f(q, k, v, m):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m)

    q, k, v = qkv(B=1, Hq=4, Hkv=4, L=1, N=33, D=64)
    r = dynamo(f, q, k, v, torch.ones(1, 1, 1, 1, dtype=torch.bool))
    assert r.count() == 1  # size-1 dims broadcast
    r = dynamo(sdpa_repeat_kv, q, k, v)
    assert r.count() == 1


@pytest.mark.parametrize("build", [dynamo, aot], ids=["dynamo", "aot"])
@pytest.mark.parametrize("zero", ["tensor", "zeros", "number"])
def test_where_built_float_mask_is_a_mask(zero, build):
    """transformers builds additive masks as where(keep, 0, finfo.min); 0 comes as torch.tensor(0.0) (5.17),
    torch.zeros(()) (5.23) or a number."""
    def f(q, k, v, keep):
        z = {"tensor": lambda: torch.tensor(0.0), "zeros": lambda: torch.zeros(()), "number": lambda: 0.0}[zero]()
        mask = torch.where(keep, z, torch.finfo(torch.float32).min)
        return eager_hf(q, k, v, mask)

    q, k, v = qkv(B=1, Hq=4, Hkv=2, L=1, N=15, D=64)
    keep = rand_bool_mask(1, 1, 15)
    r = build(f, q, k, v, keep)
    assert r.count() == 1 and r.sites[0].mask_kind == "arbitrary", r.sites
    torch.testing.assert_close(r.out, f(q, k, v, keep), **TOL)


def test_grad_requiring_attention_is_not_rewritten():
    """The decode op has no backward: a dynamo graph traced with gradients on is left alone."""
    q, k, v = qkv(B=1, Hq=4, Hkv=2, L=1, N=15, D=64)
    q.requires_grad_(True)
    r = dynamo(sdpa_gqa, q, k, v)
    _untouched(r, "training: gradients flow")
    r.out.sum().backward()
    assert q.grad is not None


@pytest.mark.parametrize("dtype, fill, rewritten", [
    (torch.float32, torch.finfo(torch.float32).min, True),   # MPT's masked_fill(mask, finfo.min)
    (torch.bfloat16, torch.finfo(torch.bfloat16).min, True),
    (torch.float16, torch.finfo(torch.float16).min, False),  # -65504: the scores would not tie next to it
    (torch.float32, -1e9, False),
])
def test_masked_fill_with_an_absorbing_value_is_an_additive_mask(dtype, fill, rewritten):
    """``scores.masked_fill(~keep, finfo.min)`` (MPT) hides scores as the additive mask ``where(~keep, finfo.min, 0)``
    does: fp32 absorbs the scores next to it, so a row hidden whole gives the mean of V in both. Rewritten, and equal
    to the original on such a row; a fill the scores do not absorb (fp16's -65504, -1e9) is left alone."""
    def f(q, k, v, keep):
        s = (q @ k.transpose(-1, -2) * 0.125).masked_fill(~keep, fill)
        return torch.softmax(s.float(), -1).to(q.dtype) @ v

    q, k, v = qkv(B=2, Hq=4, Hkv=4, L=1, N=33, D=64, dtype=dtype)
    keep = rand_bool_mask(2, 1, 33)
    keep[1] = False  # batch row 1: every key hidden
    r = dynamo(f, q, k, v, keep, config=OptimizeConfig(force_plan="split_kv"))
    assert r.count() == int(rewritten), r.sites
    want = f(q, k, v, keep)
    tol = TOL if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(r.out, want, equal_nan=True, **tol)
    if not rewritten:
        assert "masked_fill with the finite value" in r.sites[0].unsupported


_FUSED_CAUSAL = {  # pattern -> (call of the fused aten op with is_causal=True, whether its causal mask is SDPA's)
    "sdpa_flash": (lambda q, k, v: torch.ops.aten._scaled_dot_product_flash_attention.default(q, k, v, 0.0, True), False),
    "sdpa_cudnn": (lambda q, k, v: torch.ops.aten._scaled_dot_product_cudnn_attention.default(
        q, k, v, None, False, 0.0, True), False),
    "sdpa_overrideable": (lambda q, k, v: torch.ops.aten._scaled_dot_product_fused_attention_overrideable.default(
        q, k, v, None, 0.0, True), False),
    "sdpa_efficient": (lambda q, k, v: torch.ops.aten._scaled_dot_product_efficient_attention.default(
        q, k, v, None, False, 0.0, True), True),
    "sdpa_flash_cpu": (lambda q, k, v: torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(
        q, k, v, 0.0, True), True),
}


@pytest.mark.parametrize("pattern", list(_FUSED_CAUSAL))
def test_fused_kernels_causal_with_fewer_queries_than_keys(pattern):
    """``is_causal`` with q_len < kv_len means SDPA's top-left mask (query i sees keys 0..i), which the op applies.
    FlashAttention aligns its causal mask bottom-right (PyTorch's dispatch sends no such call to it), and the cuDNN
    and backend-overridable kernels are not proven to follow SDPA there: a direct call of those aten ops with
    is_causal at a decode shape is left alone. The CPU flash kernel (checked against SDPA) and the efficient kernel
    (its causal mask is CausalFromTopLeft) are read as SDPA."""
    call, top_left = _FUSED_CAUSAL[pattern]
    q = torch.randn(1, 4, 2, 64, dtype=torch.float16, device="meta")
    k = torch.randn(1, 4, 30, 64, dtype=torch.float16, device="meta")
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(lambda q, k, v: call(q, k, v)[0])(q, k, k)
    ctx = make_context(OptimizeConfig(), (q, k, k))
    detect(gm, ctx)
    (m,) = ctx.matches
    assert m.site.pattern == pattern and m.site.is_causal
    if top_left:
        assert m.site.unsupported is None, m.site.unsupported
    else:
        assert "causal" in (m.site.unsupported or ""), m.site.unsupported


def test_cpu_flash_kernel_causal_is_top_left():
    """The claim the pattern rests on for the CPU flash kernel: its is_causal at q_len < kv_len is SDPA's."""
    q, k, v = (torch.randn(1, 2, n, 64) for n in (3, 11, 11))
    out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(q, k, v, 0.0, True)[0]
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))


@pytest.mark.parametrize("empty", ["heads", "head_dim", "v_head_dim", "batch"])
@pytest.mark.parametrize("form", ["sdpa", "eager"])
def test_an_empty_attention_is_left_alone(empty, form):
    """Zero heads or a zero head dim: the original returns an empty (or zero) tensor; detection raised
    ZeroDivisionError (``1 / sqrt(0)`` for SDPA's default scale, ``Hq % Hkv`` with no KV heads) and the compile failed."""
    import attnopt

    sizes = {"B": 2, "H": 2, "D": 64, "Dv": 64}
    sizes[{"heads": "H", "head_dim": "D", "v_head_dim": "Dv", "batch": "B"}[empty]] = 0
    q = torch.randn(sizes["B"], sizes["H"], 1, sizes["D"])
    k = torch.randn(sizes["B"], sizes["H"], 30, sizes["D"])
    v = torch.randn(sizes["B"], sizes["H"], 30, sizes["Dv"])

    def f(q, k, v):
        if form == "sdpa":
            return F.scaled_dot_product_attention(q, k, v)
        return F.softmax(q @ k.transpose(-1, -2) * 0.125, -1) @ v

    opt = attnopt.optimize(f, inner_backend="eager", force_plan="split_kv")
    out, ref = opt(q, k, v), f(q, k, v)
    assert out.shape == ref.shape and torch.equal(torch.isnan(out), torch.isnan(ref))
    torch.testing.assert_close(out.nan_to_num(), ref.nan_to_num())
    for s in attnopt.last_plans(opt).sites:
        assert s.rewritten or s.reason_untouched
