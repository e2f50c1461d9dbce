"""Adversarial spellings of the variant plans' sites (logit softcapping, ALiBi, sliding windows) and of modules the
passes cannot see into: each comes out of ``attnopt.optimize`` equal to the original, rewritten or left alone
with a reason (the standard of ``test_exactness``, applied to the variants)."""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

import attnopt

from test_exactness import _fresh_dynamo  # noqa: F401 - autouse: each case compiles afresh

H, HKV, D = 4, 2, 64
TOL = dict(atol=2e-5, rtol=2e-5)
SLOPES = torch.tensor([0.5, 0.25, -0.125, 3.0]).view(1, H, 1, 1)  # not the standard 2^(-8h/H): any per-head slope


def rep(x):
    return x.repeat_interleave(H // x.shape[1], 1)


def scores(q, k):
    return (q @ rep(k).transpose(-1, -2)) * 0.125


def inputs(b=2, L=1, n=37, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, H, L, D, generator=g) * 2, torch.randn(b, HKV, n, D, generator=g),
            torch.randn(b, HKV, n, D, generator=g))


def compare(fn, *args, plan="split_kv"):
    """Run ``fn`` through ``optimize`` (eager inner backend) and eagerly; same NaNs, close values. The sites."""
    want = fn(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
    opt = attnopt.optimize(fn, inner_backend="eager", force_plan=plan)
    got = opt(*args)
    assert torch.equal(torch.isnan(got), torch.isnan(want)), "NaN positions differ from the original"
    torch.testing.assert_close(got.nan_to_num(), want.nan_to_num(), **TOL)
    sites = attnopt.last_plans(opt).sites
    assert sites and all(s.rewritten or s.reason_untouched for s in sites)
    return sites


# ------------------------------------------------------------------------------------------- ALiBi
@pytest.mark.parametrize("heads,n_slopes,sliced", [(2, 2, slice(1, None)), (4, 6, slice(2, None)), (4, 6, slice(0, 4))])
def test_alibi_bias_sliced_along_the_heads_is_not_per_head_slopes(heads, n_slopes, sliced):
    """``(slopes * arange(N))[:, 1:]`` cuts the *heads* (an index names the leading dims). The ALiBi proof read the
    index as a slice of the keys and passed the uncut slopes: with 2 query heads and slopes of 2 heads cut to head 1
    (broadcast to both), the op applied [s0, s1] where the original applies [s1, s1] (a silent wrong answer); with 6
    slopes cut to 4 heads the compile crashed. Now the bias is applied as the additive bias it is."""
    all_slopes = torch.linspace(0.5, 2.0, n_slopes).view(1, n_slopes, 1, 1)

    def f(q, k, v):
        bias = (all_slopes * torch.arange(k.shape[-2]))[:, sliced]
        return F.softmax((q @ k.transpose(-1, -2)) * 0.125 + bias, -1) @ v

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, 1, D, generator=g), torch.randn(1, heads, 37, D, generator=g),
               torch.randn(1, heads, 37, D, generator=g))
    (site,) = compare(f, q, k, v)
    assert site.rewritten and not site.site.alibi, site.reason_untouched


ALIBI = {  # name -> (bias builder over (N keys), read as ALiBi slopes? None: either way)
    "slope_times_arange": (lambda n: SLOPES * torch.arange(n), True),
    "large_slopes": (lambda n: (SLOPES * 100) * torch.arange(n), True),
    "negated_positions": (lambda n: SLOPES * (-torch.arange(n)), None),
    "reversed_positions": (lambda n: SLOPES * (n - 1 - torch.arange(n)), None),
    "relative_to_the_query": (lambda n: SLOPES * (torch.arange(n)[None, :] - torch.arange(1)[:, None]), None),
    "positions_from_5": (lambda n: SLOPES * torch.arange(5, n + 5), True),
    "heads_as_a_leading_3d_dim": (lambda n: SLOPES.view(H, 1, 1) * torch.arange(n), True),
    "keys_sliced_step_1": (lambda n: (SLOPES * torch.arange(n + 5))[..., 5:], None),
    "every_other_position": (lambda n: SLOPES * (torch.arange(n) * 2), False),
    "flipped_positions": (lambda n: SLOPES * torch.arange(n).flip(0), False),
    "squared_positions": (lambda n: SLOPES * torch.arange(n) * torch.arange(n), False),
    "clamped_positions": (lambda n: SLOPES * torch.arange(n).clamp(max=20), False),
    "heads_flipped": (lambda n: (SLOPES * torch.arange(n)).flip(1), False),
    "rolled_positions": (lambda n: SLOPES * torch.arange(n).roll(3), False),
    "two_terms": (lambda n: SLOPES * torch.arange(n) + SLOPES * torch.arange(n), None),
    # one position column broadcast over every key: a per-row constant, no slope * j (was read as ALiBi: error 2.53)
    "one_key_column": (lambda n: SLOPES * torch.arange(1).float(), False),
    "one_key_column_shifted": (lambda n: SLOPES * (torch.arange(1).float() + 30), False),
}


@pytest.mark.parametrize("name", list(ALIBI))
def test_alibi_spellings(name):
    """Slopes that are not the standard ones (negative, large), positions spelled many ways: what is provably
    ``slope[h] * j`` plus a per-row constant is passed as slopes; anything else is applied as a general bias;
    every case equals the original."""
    build, as_alibi = ALIBI[name]

    def f(q, k, v):
        return F.softmax(scores(q, k) + build(k.shape[-2]), -1) @ rep(v)

    (site,) = compare(f, *inputs())
    assert site.rewritten, site.reason_untouched
    if as_alibi is not None:
        assert site.site.alibi == as_alibi


@pytest.mark.parametrize("edit", ["mul_", "setitem", "slopes_mul_"])
def test_alibi_positions_or_slopes_edited_before_use(edit):
    """The positions' ``arange`` written in place before the bias is made (``p.mul_(2)``, ``p[3] = 100``) is no
    longer ``j``: the bias was read as ALiBi and the op added ``slope * j`` (max error 2.0 and 3.1, a silent wrong
    answer); now it is applied as the general bias it is. Edited slopes were already refused as ALiBi."""
    def f(q, k, v):
        p = torch.arange(k.shape[-2]).float()
        slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
        if edit == "mul_":
            p.mul_(2.0)
        elif edit == "setitem":
            p[3] = 100.0
        else:
            slopes.mul_(4.0)
        return F.softmax(scores(q, k) + slopes.view(1, H, 1, 1) * p, -1) @ rep(v)

    (site,) = compare(f, *inputs())
    assert site.rewritten and not site.site.alibi, site.reason_untouched


@pytest.mark.parametrize("fill", ["neginf", "finfo_min"])
def test_alibi_with_a_fully_masked_row(fill):
    """ALiBi plus a mask that hides every key of one batch row: NaN there as the plain softmax gives (-inf), or the
    mean of V (finfo.min, the keys tied)."""
    keep = torch.rand(2, 1, 1, 37, generator=torch.Generator().manual_seed(1)) > 0.3
    keep[0] = False
    keep[1, ..., 0] = True

    def f(q, k, v, keep):
        s = scores(q, k) + SLOPES * torch.arange(k.shape[-2])
        low = torch.finfo(s.dtype).min
        s = s.masked_fill(~keep, -math.inf) if fill == "neginf" else s + torch.where(keep, 0.0, low)
        return F.softmax(s, -1) @ rep(v)

    (site,) = compare(f, *inputs(), keep)
    assert site.rewritten, site.reason_untouched


# ------------------------------------------------------------------------------------------- softcap
SOFTCAP = {  # name -> (fn of the scaled scores, rewritten?)
    "tanh_div_times_cap": (lambda s: torch.tanh(s / 5.0) * 5.0, True),
    "cap_times_tanh_mul": (lambda s: 5.0 * torch.tanh(s * 0.2), True),
    "negative_cap": (lambda s: torch.tanh(s) * -3.0, True),
    "cap_as_a_division": (lambda s: torch.tanh(s) / 0.25, True),
    "tanh_alone": (lambda s: torch.tanh(s), True),
    "constant_after_the_cap": (lambda s: torch.tanh(s / 5.0) * 5.0 + 3.0, True),
    "cap_from_a_0d_tensor": (lambda s: torch.tanh(s / 5.0) * torch.tensor(5.0), True),
    "negated_tanh": (lambda s: -torch.tanh(s) * 4.0, False),
    "constant_inside_tanh": (lambda s: torch.tanh(s / 5.0 + 1.0) * 5.0, False),
    "subtraction_inside_tanh": (lambda s: torch.tanh(s / 5.0 - 1.0) * 5.0, False),
    "sigmoid_cap": (lambda s: torch.sigmoid(s) * 5.0, False),
    "clamp_cap": (lambda s: s.clamp(-1, 1) * 5.0, False),
    "cap_times_scores": (lambda s: torch.tanh(s / 5.0) * 5.0 * torch.tanh(s), False),
    "alibi_inside_tanh": (lambda s: torch.tanh((s + SLOPES * torch.arange(s.shape[-1])) / 5.0) * 5.0, False),
    "alibi_after_the_cap": (lambda s: torch.tanh(s / 5.0) * 5.0 + SLOPES * torch.arange(s.shape[-1]), True),
}


@pytest.mark.parametrize("name", list(SOFTCAP))
def test_softcap_spellings(name):
    """Caps of either sign and order of ops, a 0-d tensor cap, ALiBi before or after the cap; forms that are not
    ``c * tanh(x)`` (a negated tanh, a constant inside it, sigmoid, clamp) are left alone with a reason."""
    cap, rewritten = SOFTCAP[name]

    def f(q, k, v):
        return F.softmax(cap(scores(q, k)), -1) @ rep(v)

    (site,) = compare(f, *inputs())
    assert site.rewritten == rewritten, site.reason_untouched


@pytest.mark.parametrize("where", ["after", "before"])
def test_softcap_with_a_fully_masked_row(where):
    """A mask after the cap (NaN for the row it hides whole, as the plain softmax) is exact; one inside the tanh is
    left alone."""
    keep = torch.rand(2, 1, 1, 37, generator=torch.Generator().manual_seed(2)) > 0.3
    keep[0] = False
    keep[1, ..., 0] = True

    def f(q, k, v, keep):
        s = scores(q, k)
        if where == "after":
            s = (torch.tanh(s / 5.0) * 5.0).masked_fill(~keep, -math.inf)
        else:
            s = torch.tanh(s.masked_fill(~keep, -math.inf) / 5.0) * 5.0
        return F.softmax(s, -1) @ rep(v)

    (site,) = compare(f, *inputs(), keep)
    assert site.rewritten == (where == "after"), site.reason_untouched


# ------------------------------------------------------------------------------------------- windows
W = 6
BANDS = {  # name -> (band of key positions kv and query positions qp, keys per row the report gives, None: any)
    "le_gt": (lambda kv, qp: (kv <= qp) & (kv > qp - W), W),
    "ge_keeps_one_more": (lambda kv, qp: (kv <= qp) & (kv >= qp - W), W + 1),
    "w_minus_one_more": (lambda kv, qp: (kv <= qp) & (kv > qp - W - 1), W + 1),
    "strict_upper_keeps_one_fewer": (lambda kv, qp: (kv < qp) & (kv > qp - W), W - 1),
    "distance_le": (lambda kv, qp: (kv <= qp) & ((qp - kv) <= W), W + 1),
    "key_plus_w": (lambda kv, qp: (kv <= qp) & (kv + W > qp), W),
    "abs_distance": (lambda kv, qp: (kv <= qp) & ((qp - kv).abs() < W), None),
    "or_the_first_key": (lambda kv, qp: ((kv <= qp) & (kv > qp - W)) | (kv == 0), None),
    "not_outside": (lambda kv, qp: ~((kv > qp) | (kv <= qp - W)), None),
    "and_a_pattern": (lambda kv, qp: (kv <= qp) & (kv > qp - W) & (torch.arange(kv.shape[-1]) % 3 != 1), None),
}


@pytest.mark.parametrize("form", ["bool", "finfo_min"])
@pytest.mark.parametrize("name", list(BANDS))
def test_window_spellings_with_hidden_rows_and_a_causal_block(name, form):
    """Three batch rows at their own positions (one before the first key: every key hidden; one in the middle; one
    at the end), four query rows each (causal inside the decode block), boolean and finfo.min additive forms:
    equal to the original; where the report names a window, it is the number of keys a row keeps."""
    band, keys = BANDS[name]
    L, n = 4, 40

    def f(q, k, v, pos):
        kv = torch.arange(k.shape[2])[None, None, None, :]
        m = band(kv, pos.view(pos.shape[0], 1, -1, 1))
        if form == "finfo_min":
            m = torch.zeros(m.shape).masked_fill(~m, torch.finfo(torch.float32).min)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)

    pos = torch.tensor([[-5 + i for i in range(L)], [17 + i for i in range(L)], [n - L + i for i in range(L)]])
    (site,) = compare(f, *inputs(b=3, L=L, n=n), pos)
    assert site.rewritten, site.reason_untouched
    if form == "bool" and keys is not None:
        assert site.site.window == keys


@pytest.mark.parametrize("plan", ["split_kv", "stream_k"])
@pytest.mark.parametrize("form", ["bool", "where_neginf", "prefix"])
def test_a_band_of_one_key_column_broadcast_over_the_keys(form, plan):
    """A band (or prefix) built from ``arange(1)``: a (B, 1, 1, 1) mask that SDPA broadcasts over every key (a row sees
    all keys when position 0 is in its band, none otherwise). The band match read the mask's key dim (1) as the key
    count and clamped the window to key 0, dropping the mask: the op attended to one key (max error 2.57). Now such a
    mask is no band: its key range is scanned, which broadcasts it."""
    def f(q, k, v, pos):
        kv = torch.arange(1)[None, None, None, :]
        u = pos.view(-1, 1, 1, 1)
        m = kv <= u if form == "prefix" else (kv <= u) & (kv > u - W)
        if form == "where_neginf":
            m = torch.where(m, 0.0, -math.inf)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)

    pos = torch.tensor([3, W + 2, -1])  # position 0 in the band, outside it, before it
    (site,) = compare(f, *inputs(b=3), pos, plan=plan)
    assert site.rewritten, site.reason_untouched
    assert site.site.window is None


# ------------------------------------------------------------------------------------------- opaque modules
@pytest.mark.parametrize("batch_first", [True, False])
def test_multihead_attention_is_left_alone_with_a_reason(batch_first):
    """``nn.MultiheadAttention`` is one opaque call in dynamo's graph: it is reported as a site left alone with the
    reason (it was not reported at all: ``explain`` showed no site), and the output is the module's."""
    mha = torch.nn.MultiheadAttention(64, 4, batch_first=batch_first).eval()

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = mha

        def forward(self, q, kv):
            return self.attn(q, kv, kv, need_weights=False)[0]

    q = torch.randn(2, 1, 64) if batch_first else torch.randn(1, 2, 64)
    kv = torch.randn(2, 40, 64) if batch_first else torch.randn(40, 2, 64)
    m = M()
    with torch.no_grad():
        opt = attnopt.optimize(m, inner_backend="eager")
        torch.testing.assert_close(opt(q, kv), m(q, kv))
    report = attnopt.last_plans(opt)
    (site,) = report.sites
    assert not site.rewritten and site.reason_untouched.startswith("nn.MultiheadAttention is left alone")
    assert "nn.MultiheadAttention" in report.format_table()


# ------------------------------------------------------------------------------------------- SAAP (opt-in)
class _Attention(torch.nn.Module):
    def __init__(self, mask_of):
        super().__init__()
        self.mask_of = mask_of

    def forward(self, q, k, v, pos, padding):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask_of(k, pos, padding), scale=0.125,
                                              enable_gqa=True)


class _Layers(torch.nn.Module):
    """``model.layers.1.self_attn``: the module path SAAP reads the layer from."""

    def __init__(self, mask_of):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([torch.nn.Module(), torch.nn.Module()])
        self.model.layers[1].self_attn = _Attention(mask_of)

    def forward(self, *args):
        return self.model.layers[1].self_attn(*args)


def _keys(k):
    return torch.arange(k.shape[2])[None, None, None, :]


SAAP_MASKS = {  # name -> (mask builder, planned as SAAP?)
    "prefix": (lambda k, pos, pad: _keys(k) <= pos.view(-1, 1, 1, 1), True),
    "no_mask": (lambda k, pos, pad: None, True),
    "prefix_and_left_padding": (lambda k, pos, pad: (_keys(k) <= pos.view(-1, 1, 1, 1)) & pad[:, None, None, :],
                                False),
    "window": (lambda k, pos, pad: (_keys(k) <= pos.view(-1, 1, 1, 1)) & (_keys(k) > pos.view(-1, 1, 1, 1) - 16),
               False),
    "finfo_min_prefix": (lambda k, pos, pad: torch.where(_keys(k) <= pos.view(-1, 1, 1, 1), 0.0,
                                                         torch.finfo(torch.float32).min), False),
    "mask_input": (lambda k, pos, pad: pad[:, None, None, :], False),
}


@pytest.fixture
def saap_index(tmp_path):
    pytest.importorskip("safetensors")
    from attnopt.runtime.saap import registry
    from attnopt.runtime.saap.index import synthetic_index

    registry.reset()
    path = tmp_path / "idx.safetensors"
    synthetic_index(6, 2, 64, clusters=8, layers=(1,), num_layers=2).save(path)
    yield str(path)
    registry.reset()


@pytest.mark.parametrize("q_len", [1, 4])
@pytest.mark.parametrize("name", list(SAAP_MASKS))
def test_saap_is_planned_only_where_its_kernels_read_the_whole_mask(name, q_len, saap_index):
    """The SAAP kernels read one valid length per batch row (no mask) and make the query rows causal inside the
    decode block. A left-padded batch's mask (a prefix AND a padding lookup, which ``mask_kind`` calls
    valid_length), a window, an additive finfo.min prefix (its hidden keys count as visible) or an input mask would
    have been read as their last visible key alone (every cluster probed, the kernel attended the padding: max error
    0.3 in the interpreter against dense); q_len 4 without a mask was made causal in the block where the original
    lets every row see every key (0.2). Those sites now keep a dense-class plan or are left alone with the reason;
    a provable prefix (or no mask) at q_len 1 is still SAAP."""
    from attnopt.passes import make_context, run_passes
    from attnopt.config import OptimizeConfig

    mask_of, planned = SAAP_MASKS[name]
    planned = planned and q_len == 1
    b, n = 2, 120
    q, k, v = torch.randn(b, 6, q_len, D), torch.randn(b, 2, n, D), torch.randn(b, 2, n, D)
    pos = torch.tensor([n - 1, 90])
    padding = torch.ones(b, n, dtype=torch.bool)
    padding[1, :30] = False
    graphs = []

    def backend(gm, example_inputs):
        ctx = make_context(OptimizeConfig(saap=saap_index, force_plan="saap"), example_inputs)
        run_passes(copy.deepcopy(gm), example_inputs, ctx=ctx)  # planned, not run (no clusters are built here)
        graphs.append(ctx)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(_Layers(mask_of), backend=backend, fullgraph=True)(q, k, v, pos, padding)
    (ctx,) = graphs
    (report,) = ctx.report.sites
    assert report.site.module_path == "model.layers.1.self_attn", report.site
    if planned:
        assert report.chosen is not None and report.chosen.kind == "saap", report.site.unsupported
    else:
        assert report.chosen is None and "force_plan='saap' does not apply" in report.site.unsupported
        assert "SAAP" in report.site.unsupported, report.site.unsupported
