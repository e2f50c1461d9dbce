"""Shared-prefix detection (``passes/patterns/prefix.py``) and the cascade rewrite: a ``cat`` of a batch-1 prefix
broadcast over the rows and per-row suffixes is found and rewritten to ``attnopt.cascade_attention`` (the ``cat``
copies go dead); near-misses keep the plain plans, with the cascade's reason."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attnopt.config import OptimizeConfig

from passgraphs import aot, dynamo, eager_hf, op_nodes, repeat_kv

CASCADE = OptimizeConfig(force_plan="cascade")
CASCADE_OP = "attnopt.cascade_attention.default"


def _parts(B=3, Hq=4, Hkv=2, L=1, P=40, S=5, D=64):
    return (torch.randn(B, Hq, L, D), torch.randn(1, Hkv, P, D), torch.randn(1, Hkv, P, D),
            torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D))


def shared_sdpa(q, kp, vp, ks, vs, mask=None):
    """Parallel sampling as a user writes it: every row's keys are the prompt's, then its own."""
    B = q.shape[0]
    k = torch.cat([kp.expand(B, -1, -1, -1), ks], dim=2)
    v = torch.cat([vp.expand(B, -1, -1, -1), vs], dim=-2)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def shared_eager(q, kp, vp, ks, vs, mask=None):
    B = q.shape[0]
    k = torch.cat([torch.broadcast_to(kp, (B,) + kp.shape[1:]), ks], dim=2)
    v = torch.cat([vp.expand_as(torch.empty(B, *vp.shape[1:])), vs], dim=2)
    return eager_hf(q, k, v, mask)


def repeated_prefix(q, kp, vp, ks, vs, mask=None):
    """Equal rows, but made by ``repeat`` (a copy), which the matcher does not take as proof."""
    B = q.shape[0]
    k = torch.cat([kp.repeat(B, 1, 1, 1), ks], dim=2)
    v = torch.cat([vp.repeat(B, 1, 1, 1), vs], dim=2)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def prefix_written_after_cat(q, kp, vp, ks, vs, mask=None):
    """The prefix changes between the cat (which copied it) and the attention: reading it then would differ."""
    B = q.shape[0]
    k = torch.cat([kp.expand(B, -1, -1, -1), ks], dim=2)
    v = torch.cat([vp.expand(B, -1, -1, -1), vs], dim=2)
    kp.mul_(2.0)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def _reasons(run):
    return {r.kind: r.reason for s in run.reports for r in s.rejected}


@pytest.mark.parametrize("fn", [shared_sdpa, shared_eager])
@pytest.mark.parametrize("L,mask", [(1, None), (2, "bool"), (1, "float")])
def test_shared_prefix_is_rewritten_to_the_cascade(fn, L, mask):
    q, kp, vp, ks, vs = _parts(L=L)
    m = None
    if mask is not None:
        m = torch.rand(3, 1, L, 45) > 0.3
        m[1] = False  # a fully hidden row
        bool_mask = mask == "bool" and fn is shared_sdpa  # eager code adds its mask: a float one
        m = m if bool_mask else torch.zeros(m.shape).masked_fill(~m, float("-inf"))
    r = dynamo(fn, q, kp, vp, ks, vs, m, config=CASCADE)
    (site,) = r.sites
    assert site.shared_prefix == 40 and "prefix=40" in site.shape_str()
    (op,) = op_nodes(r.gm, CASCADE_OP)
    assert [a.op for a in op.args[1:5]] == ["placeholder"] * 4  # the prefix and suffixes themselves
    assert not [n for n in r.gm.graph.nodes if n.target is torch.cat]  # the B-fold copies are gone
    expected = fn(q, kp, vp, ks, vs, m)
    if fn is shared_eager and m is not None:  # the plain eager softmax gives NaN on the hidden row; so must we
        assert torch.isnan(r.out[1]).all() and torch.isnan(expected[1]).all()
        r_out, expected = r.out[[0, 2]], expected[[0, 2]]
    else:
        r_out = r.out
    torch.testing.assert_close(r_out, expected, atol=2e-5, rtol=2e-5)


def test_gqa_repeat_kv_of_a_shared_prefix_is_found():
    def fn(q, kp, vp, ks, vs):
        B = q.shape[0]
        k = repeat_kv(torch.cat([kp.expand(B, -1, -1, -1), ks], dim=2), 2)
        v = repeat_kv(torch.cat([vp.expand(B, -1, -1, -1), vs], dim=2), 2)
        return F.scaled_dot_product_attention(q, k, v)

    args = _parts()
    r = dynamo(fn, *args, config=CASCADE)
    assert r.sites[0].shared_prefix == 40 and len(op_nodes(r.gm, CASCADE_OP)) == 1
    torch.testing.assert_close(r.out, fn(*args), atol=2e-5, rtol=2e-5)


def test_aten_level_graph_is_found():
    args = _parts()
    r = aot(shared_sdpa, *args, config=CASCADE)
    assert r.sites[0].shared_prefix == 40 and len(op_nodes(r.gm, CASCADE_OP)) == 1
    torch.testing.assert_close(r.out, shared_sdpa(*args), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("fn,why", [(repeated_prefix, "not provably one prefix shared"),
                                    (prefix_written_after_cat, "not provably one prefix shared")])
def test_near_misses_keep_the_plain_plans(fn, why):
    args = _parts()
    expected = fn(*[a.clone() for a in args])
    r = dynamo(fn, *args, config=OptimizeConfig())
    (site,) = r.sites
    assert site.shared_prefix is None
    assert why in _reasons(r)["cascade"]
    assert not op_nodes(r.gm, CASCADE_OP)
    torch.testing.assert_close(r.out, expected, atol=2e-5, rtol=2e-5)


def test_one_row_is_not_worth_a_cascade():
    args = _parts(B=1)
    r = dynamo(shared_sdpa, *args, config=OptimizeConfig())
    assert r.sites[0].shared_prefix == 40
    assert "batch of 1" in _reasons(r)["cascade"]
    assert not op_nodes(r.gm, CASCADE_OP)


def test_onnx_export_takes_a_plain_plan(tmp_path):
    """The cascade op has no ONNX form: an exported shared-prefix site gets a plain plan, with the reason."""
    import attnopt

    args = _parts()
    report = attnopt.export_onnx(shared_sdpa, args, tmp_path / "m.onnx")
    (site,) = report.sites
    assert site.rewritten and site.chosen.kind != "cascade" and site.exported_as
    assert any(r.kind == "cascade" and "no ONNX form" in r.reason for r in site.rejected)
    with pytest.raises(ValueError, match="no ONNX form"):
        attnopt.export_onnx(shared_sdpa, args, tmp_path / "m2.onnx", force_plan="cascade")
