"""Sliding-window bands proven from the mask's graph (``passes/patterns/band.py``, ``passes/window.py``): the key range
comes from the query positions (no ``key_range_from_mask`` scan); a pure band leaves no mask at all; anything not
proven (in-place edits, unknown spellings) keeps the scan, with a reason; every case equals the original."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attnopt.config import OptimizeConfig

from passgraphs import dynamo, op_nodes, qkv

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

TOL = dict(atol=2e-5, rtol=2e-5, equal_nan=True)
SPLIT = OptimizeConfig(force_plan="split_kv")
DECODE = "attnopt.decode_attention.default"
SCAN = "attnopt.key_range_from_mask.default"


def _band(spelling: str, kv: torch.Tensor, qp: torch.Tensor, w: int) -> torch.Tensor:
    if spelling == "le_gt":  # attnopt bench variants / HF's causal AND sliding_window_overlay
        return (kv <= qp) & (kv > qp - w)
    if spelling == "swapped":
        return (qp >= kv) & (qp - w < kv)
    if spelling == "lt_ge":
        return (kv < qp + 1) & (kv >= qp - w + 1)
    if spelling == "differences":
        return (kv - qp <= 0) & (qp - kv < w)
    if spelling == "functions":
        return torch.logical_and(torch.le(kv, qp), torch.gt(kv, torch.sub(qp, w)))
    if spelling == "hf":  # transformers 5 sdpa_mask: ones & causal & overlay, each .to(device)
        m = qp.new_ones((), dtype=torch.bool) & (kv <= qp).to(qp.device)
        return m & (kv > qp - w).to(qp.device)
    raise ValueError(spelling)


SPELLINGS = ["le_gt", "swapped", "lt_ge", "differences", "functions", "hf"]


def _windowed(spelling: str, w: int, per_batch: bool):
    def f(q, k, v, pos):
        n = k.shape[2]
        kv = (torch.arange(n, device=k.device) + 0)[None, None, None, :] if spelling == "hf" else torch.arange(n, device=k.device)[None, None, None, :]
        qp = pos.view(pos.shape[0], 1, -1, 1) if per_batch else pos.view(1, 1, -1, 1)
        m = _band(spelling, kv, qp, w)
        if spelling == "hf":
            m = m.expand(q.shape[0], -1, q.shape[2], n)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)
    return f


def _decode(r) -> torch.fx.Node:
    nodes = op_nodes(r.gm, DECODE)
    assert len(nodes) == 1, r.gm.code
    return nodes[0]


@settings(max_examples=14, deadline=None, suppress_health_check=list(HealthCheck))
@given(spelling=st.sampled_from(SPELLINGS), b=st.integers(1, 3), q_len=st.integers(1, 3), n=st.integers(17, 70),
       w=st.sampled_from([1, 2, 5, 16, 64, 200]), per_batch=st.booleans(), data=st.data())
def test_band_spellings_equal_the_original(spelling, b, q_len, n, w, per_batch, data):
    """Every spelling, positions near 0, near N and past it (a row may see no key), W = 1 and W > N, batch rows with
    their own positions, one or several query rows: the band is read off the graph (no scan) and the result is the
    original's. One query position per batch row drops the mask entirely; several keep it (the outermost range)."""
    rows = b if per_batch else 1
    pos = torch.tensor(data.draw(st.lists(st.lists(st.integers(-1, n + 3), min_size=q_len, max_size=q_len),
                                          min_size=rows, max_size=rows)))
    pos = pos if per_batch else pos[0]
    f = _windowed(spelling, w, per_batch)
    q, k, v = qkv(B=b, Hq=4, Hkv=2, L=q_len, N=n, D=64)
    r = dynamo(f, q, k, v, pos, config=SPLIT)
    assert r.count() == 1 and r.sites[0].window == w, r.sites
    assert list(r.ctx.window_ranges.values()) == ["band"], r.ctx.window_ranges
    assert not op_nodes(r.gm, SCAN)
    mask = _decode(r).args[3]
    if q_len == 1:
        assert mask is None and not [n for n in r.gm.graph.nodes if "arange" in str(n.target)], r.gm.code
    else:
        assert mask is not None
    torch.testing.assert_close(r.out, f(q, k, v, pos), **TOL)


def test_padding_factor_stays_the_mask():
    """HF's window AND a padding lookup, B = 2 with a left-padded row: the band gives the range, the padding alone
    is the op's mask."""
    def f(q, k, v, padding, pos):
        n = k.shape[2]
        batch = torch.arange(q.shape[0])[:, None, None, None]
        kv = (torch.arange(n) + 0)[None, None, None, :]
        qp = pos[None, None, :, None]
        m = _band("hf", kv, qp, 6) & padding[batch, kv].to(qp.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m.expand(q.shape[0], -1, 1, n), enable_gqa=True)

    q, k, v = qkv(B=2, Hq=4, Hkv=2, L=1, N=24, D=64)
    padding = torch.ones(2, 24, dtype=torch.bool)
    padding[1, :14] = False
    pos = torch.tensor([17])
    r = dynamo(f, q, k, v, padding, pos, config=SPLIT)
    assert list(r.ctx.window_ranges.values()) == ["band"] and not op_nodes(r.gm, SCAN)
    mask = _decode(r).args[3]
    assert mask is not None and str(mask.target) != "<built-in function and_>", r.gm.code
    torch.testing.assert_close(r.out, f(q, k, v, padding, pos), **TOL)


@pytest.mark.parametrize("edit", ["iand", "position_after", "mask_after"])
def test_in_place_edits_keep_the_scan(edit):
    """An in-place edit anywhere on the band's chain blocks the proof: the site keeps ``key_range_from_mask`` (a
    reason is recorded) and stays exact."""
    def f(q, k, v, pos):
        kv = torch.arange(k.shape[2])[None, None, None, :]
        qp = pos.view(1, 1, -1, 1) + 0
        if edit == "iand":
            m = kv <= qp
            m &= kv > qp - 8
        else:
            m = (kv <= qp) & (kv > qp - 8)
        if edit == "position_after":
            qp.add_(3)
        if edit == "mask_after":
            m[..., 0] = True
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)

    q, k, v = qkv(B=1, Hq=4, Hkv=2, L=1, N=33, D=64)
    pos = torch.tensor([20])
    r = dynamo(f, q, k, v, pos, config=SPLIT)
    ranges = list(r.ctx.window_ranges.values())
    assert r.count() == 1 and len(ranges) == 1 and ranges[0].startswith("scan: "), (ranges, r.gm.code)
    assert op_nodes(r.gm, SCAN)
    torch.testing.assert_close(r.out, f(q, k, v, pos), **TOL)


def test_unknown_key_source_keeps_the_scan():
    """Keys that are not ``arange(N)`` (every other key) are no band: the scan, exact."""
    def f(q, k, v, pos):
        kv = (torch.arange(k.shape[2]) * 2)[None, None, None, :]
        qp = pos.view(1, 1, -1, 1)
        m = (kv <= qp) & (kv > qp - 8)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)

    q, k, v = qkv(B=1, Hq=4, Hkv=2, L=1, N=33, D=64)
    pos = torch.tensor([40])
    r = dynamo(f, q, k, v, pos, config=OptimizeConfig(force_plan="split_kv", sliding_windows={"": 4}))
    assert all(v.startswith("scan: ") for v in r.ctx.window_ranges.values()), r.ctx.window_ranges
    torch.testing.assert_close(r.out, f(q, k, v, pos), **TOL)


@pytest.mark.parametrize("build", ["dynamo", "aot", "export"])
def test_band_across_graph_levels(build):
    """The aten spellings (``aten.arange``, ``aten.unsqueeze``, ``aten.le.Tensor``, ``aten.bitwise_and``) are the
    same band: no scan, no mask, exact."""
    import passgraphs

    f = _windowed("le_gt", 8, False)
    q, k, v = qkv(B=2, Hq=4, Hkv=2, L=1, N=40, D=64)
    pos = torch.tensor([25])
    r = getattr(passgraphs, build)(f, q, k, v, pos, config=SPLIT)
    assert list(r.ctx.window_ranges.values()) == ["band"] and not op_nodes(r.gm, SCAN), r.gm.code
    assert _decode(r).args[3] is None
    torch.testing.assert_close(r.out, f(q, k, v, pos), **TOL)


def test_band_under_dynamic_shapes():
    """A symbolic key count (the cache length marked dynamic): the band's end is clamped at the ``arange``'s
    symbolic length, no scan, no mask, and the one graph serves two cache lengths exactly."""
    from passgraphs import _runner

    torch._dynamo.reset()
    f = _windowed("le_gt", 8, True)
    ctxs, gms = [], []
    run = _runner(SPLIT, ctxs, gms)
    compiled = torch.compile(f, backend=lambda gm, inputs: run(gm, inputs).forward, fullgraph=True)
    for n, pos in ((40, [[39], [12]]), (57, [[60], [3]])):
        q, k, v = qkv(B=2, Hq=4, Hkv=2, L=1, N=n, D=64)
        torch._dynamo.mark_dynamic(k, 2)
        torch._dynamo.mark_dynamic(v, 2)
        pos = torch.tensor(pos)
        torch.testing.assert_close(compiled(q, k, v, pos), f(q, k, v, pos), **TOL)
    assert len(gms) == 1 and list(ctxs[0].window_ranges.values()) == ["band"], [c.window_ranges for c in ctxs]
    (decode,) = op_nodes(gms[0], DECODE)
    assert decode.args[3] is None and not op_nodes(gms[0], SCAN), gms[0].code
    assert not [n for n in gms[0].graph.nodes if "arange" in str(n.target)], gms[0].code  # the size, not the arange


@pytest.mark.cuda
@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_band_on_the_gpu(inner):
    """On a GPU, through ``attnopt.optimize`` (the Triton split-KV kernels, bf16): batch rows at their own positions
    (one near the start, one past the window, one at the last key), a pure band, equal to SDPA with the mask in
    float64, and again after the positions move (the range is computed on the device each call)."""
    import attnopt

    f = _windowed("le_gt", 1024, True)
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(3, 32, 1, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(3, 8, 8192, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(3, 8, 8192, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    opts = {"inner_backend": "eager"} if inner == "eager" else {}
    ours = attnopt.optimize(f, force_plan="split_kv", **opts)
    for pos in ([[5], [3000], [8191]], [[6], [3001], [4000]]):
        pos = torch.tensor(pos, device="cuda")
        want = f(q.double(), k.double(), v.double(), pos)
        torch.testing.assert_close(ours(q, k, v, pos).double(), want, atol=2e-2, rtol=2e-2)
    sites = [s for s in attnopt.last_plans(ours).sites if s.rewritten]
    assert len(sites) == 1 and sites[0].site.window == 1024, attnopt.last_plans(ours).format_table()
