"""Generic tests of every registered plan kind and strategy (DESIGN.md: JSON round trip, candidates not
empty for a canonical site, results against the reference)."""
import math

import pytest
import torch

from attnopt import AttentionSite, PlanReport, SiteReport
from attnopt.hardware import builtin_profile
from attnopt.plan import PLAN_KINDS, DensePlan, SplitKVPlan, StreamKPlan, plan_from_dict, plan_from_json
from attnopt.report import Rejection
from attnopt.report_table import compact_paths
from attnopt.runtime import reference
from attnopt.runtime.strategies import STRATEGIES, PlanContext


@pytest.mark.parametrize("kind", sorted(PLAN_KINDS))
def test_every_plan_kind_round_trips(kind):
    plan = PLAN_KINDS[kind]().with_estimate(12.5)
    again = plan_from_json(plan.to_json())
    assert again == plan and again.kind == kind
    assert "est_us" not in plan.runtime_key()


def test_nan_estimate_round_trips():
    again = plan_from_json(DensePlan(reason="x").to_json())
    assert math.isnan(again.est_us) and again.reason == "x"


@pytest.mark.parametrize("bad,match", [({"kind": "warp_speed", "version": 1, "data": {}}, "registered kinds"),
                                       ({"kind": "dense", "version": 7, "data": {}}, "version 7"),
                                       ({"kind": "split_kv", "version": 1, "data": {"splits": 3}}, "unknown field"),
                                       ({"kind": "dense", "data": {}}, "lacks 'version'")])
def test_bad_plan_json(bad, match):
    with pytest.raises(ValueError, match=match):
        plan_from_dict(bad)


def _opt_in(kind, site, ctx, tmp_path):
    """Opt-in kinds need the user's input: ``saap`` a SAAP index for the site's shapes, at a layer it covers;
    ``cascade`` a site whose K/V share a prefix (several rows over a prompt)."""
    if kind == "cascade":
        import dataclasses

        return dataclasses.replace(site, batch=4, kv_len=site.kv_len + 64, shared_prefix=site.kv_len), ctx
    if kind != "saap":
        return site, ctx
    import dataclasses

    from attnopt.runtime.saap.index import synthetic_index

    path = tmp_path / "saap.safetensors"
    synthetic_index(site.q_heads, site.kv_heads, site.head_dim, clusters=16).save(path)
    return (dataclasses.replace(site, module_path="model.layers.1.self_attn"),
            dataclasses.replace(ctx, extras={"saap": {"index": str(path), "probes": 4, "sink": 1, "window": 64}}))


@pytest.mark.parametrize("kind", sorted(STRATEGIES))
def test_every_strategy_has_candidates_on_canonical_site(kind, tmp_path):
    strategy = STRATEGIES[kind]
    world = 2 if strategy.distributed else 1
    ctx = PlanContext(world_size=world, device_type="cuda", triton_available=True,
                      topology="2x-h200-nvlink" if world > 1 else None)
    site, ctx = _opt_in(kind, AttentionSite.canonical(), ctx, tmp_path)
    hw = builtin_profile("h100-sxm")
    assert strategy.check(site, hw, ctx) is None
    cands = list(strategy.candidates(site, hw, ctx))
    assert cands and all(c.kind == kind for c in cands)
    for c in cands:
        est = strategy.estimate_us(c, site, hw, ctx)
        assert est > 0 and math.isfinite(est)
        assert plan_from_json(c.to_json()) == c


@pytest.mark.parametrize("kind", sorted(k for k, s in STRATEGIES.items() if not s.distributed))
def test_every_single_device_strategy_matches_reference_on_cpu(kind):
    if kind == "saap":  # approximate by design: tests/runtime/test_saap_strategy.py checks it against its reference
        pytest.skip("saap is approximate attention; compared with the SAAP reference in test_saap_strategy.py")
    if kind == "cascade":  # its op takes the prefix and suffixes apart: tests/runtime/test_cascade.py
        pytest.skip("cascade runs on a shared prefix plus suffixes; compared with the reference in test_cascade.py")
    strategy = STRATEGIES[kind]
    site = AttentionSite.canonical(q_heads=6, kv_heads=2, head_dim=64, kv_len=37, dtype="float32")
    ctx = PlanContext(device_type="cpu")
    plan = next(iter(strategy.candidates(site, builtin_profile("cpu"), ctx)))
    q = torch.randn(2, 6, 2, 64); k = torch.randn(2, 2, 37, 64); v = torch.randn(2, 2, 37, 64)
    mask = torch.rand(2, 1, 2, 37) > 0.2
    mask[..., 0] = True
    state = strategy.prepare(plan, q, k, v)
    out = strategy.run(state, plan, q, k, v, mask, None, 0.125, False)
    torch.testing.assert_close(out.double(), reference.sdpa_float64(q, k, v, attn_mask=mask, scale=0.125),
                               atol=1e-5, rtol=1e-5)


def test_plan_report_round_trip_and_table():
    site = AttentionSite.canonical()
    chosen = SplitKVPlan(num_splits=8).with_estimate(20.0)
    sr = SiteReport(site=site, chosen=chosen, candidates=[chosen, DensePlan().with_estimate(30.0)],
                    rejected=[Rejection("tree", "needs a process group")], rewritten=True, key="g0:sdpa")
    left = SiteReport(site=AttentionSite.canonical(node="sdpa_1", q_len=None, unsupported="prefill: q_len is symbolic"))
    report = PlanReport(sites=[sr, left], profile="h100-sxm", graph="g0")
    again = PlanReport.from_json(report.to_json())
    assert again.to_dict() == report.to_dict()
    table = report.format_table(width=220)
    for text in ("split_kv", "model.layers.0.self_attn", "needs a process group", "prefill: q_len is symbolic",
                 "dense: 30.0"):
        assert text in table, text
    assert report.summary() == "2 attention site(s), 1 rewritten, 1 left alone"


# ---------------------------------------------------------------------------------------- the plans table
def _decode(layer, plan=None, n=8192, graph="g1", calls=0, **kw):
    """A rewritten decode site of layer ``layer``: split_kv chosen over dense, stream_k, and rejected tree/ring."""
    site = AttentionSite.canonical(node=f"sdpa_{layer}", module_path=f"model.layers.{layer}.self_attn", kv_len=n, **kw)
    chosen = plan or SplitKVPlan(num_splits=8).with_estimate(20.0)
    cands = [chosen, SplitKVPlan(num_splits=4).with_estimate(25.0), SplitKVPlan(num_splits=2).with_estimate(40.0),
             StreamKPlan(grid=132).with_estimate(22.0), StreamKPlan(grid=66).with_estimate(30.0),
             DensePlan().with_estimate(60.0)]
    cands.sort(key=lambda p: p.est_us)
    return SiteReport(site=site, chosen=chosen, candidates=cands, rewritten=True, calls=calls, graph=graph,
                      key=f"{graph}:sdpa_{layer}",
                      rejected=[Rejection("tree", "needs a process group (world size 1)"),
                                Rejection("ring", "needs a process group (world size 1)")])


def _prefill(layer, graph="g0"):
    site = AttentionSite.canonical(node=f"sdpa_{layer}", module_path=f"model.layers.{layer}.self_attn", q_len=None,
                                   kv_len=None, kv_len_hint=37, mask_kind="causal", is_causal=True,
                                   unsupported="prefill: symbolic q_len")
    return SiteReport(site=site, graph=graph)


def _rows(report, **kw):
    """The rendered table and its data rows, each a list of cells (a cell's wrapped lines joined by spaces)."""
    text = report.format_table(width=200, **kw)
    rows, cur = [], None
    for line in text.splitlines():
        if line.startswith("│"):
            parts = [p.strip() for p in line.split("│")[1:-1]]
            if parts[0]:  # the graph cell is filled on the first line of a row only
                cur = [[p] for p in parts]
                rows.append(cur)
            else:
                for cell, p in zip(cur, parts):
                    cell.append(p)
    return text, [[" ".join(x for x in cell if x) for cell in row] for row in rows]


def test_shape_str_shows_what_is_known():
    assert AttentionSite.canonical().shape_str() == "B=1 H=32/8 q=1 N=8192 D=128"
    sym = AttentionSite.canonical(q_len=None, kv_len=None, kv_len_hint=37)
    assert sym.shape_str() == "B=1 H=32/8 q=? N~37 D=128"
    unknown = AttentionSite(node="x", module_path="", pattern="sdpa", batch=None, q_heads=0, kv_heads=0, head_dim=0,
                            q_len=None, kv_len=None, dtype="float32")
    assert unknown.shape_str() == "B=? H=?/? q=? N=? D=?"
    assert AttentionSite.canonical(v_head_dim=64).shape_str().endswith("D=128 Dv=64")


@pytest.mark.parametrize("paths,expected", [
    (["model.layers.0.self_attn"], "model.layers.0.self_attn"),
    ([f"model.layers.{i}.self_attn" for i in range(30)], "model.layers.{0..29}.self_attn"),
    (["m.l.3.a", "m.l.0.a", "m.l.1.a", "m.l.7.a", "m.l.8.a", "m.l.9.a", "m.l.1.a"], "m.l.{0,1,3,7..9}.a"),
    (["enc.attn", "dec.self_attn", "dec.cross_attn"], "enc.attn (+2 more)"),
    (["", ""], "(top level)"),
])
def test_compact_paths(paths, expected):
    assert compact_paths(paths) == expected


def test_identical_sites_collapse_into_one_row_and_different_shapes_do_not():
    report = PlanReport(sites=[_decode(0), _decode(1), _decode(2, n=4096)], profile="h100-sxm")
    assert [len(g) for g in report.groups()] == [2, 1]
    text, rows = _rows(report)
    assert len(rows) == 2, text
    assert rows[0][:3] == ["g1", "2", "model.layers.{0,1}.self_attn"], rows[0]
    assert rows[1][:3] == ["g1", "1", "model.layers.2.self_attn"] and "N=4096" in rows[1][3], rows[1]
    assert rows[0][5].startswith("split_kv num_splits=8") and rows[0][6] == "20.0", rows[0]
    # The same sites in another graph are another row.
    report.sites.append(_decode(3, graph="g2"))
    assert [len(g) for g in report.groups()] == [2, 1, 1]


def test_group_alternatives_are_the_top_three_with_reasons_and_a_count_of_the_rest():
    report = PlanReport(sites=[_decode(0), _decode(1)], profile="h100-sxm")
    text = report.format_table(width=240)
    # Fastest other candidate of each kind, best first, with its ratio to the chosen plan; then the merged rejection.
    assert text.index("stream_k: 22.0 µs (1.1x)") < text.index("dense: 60.0 µs (3.0x)")
    assert "tree, ring: needs a process group (world size 1)" not in text  # 4th line: cut
    # 5 other candidates + 2 rejected kinds = 7 alternatives, 3 shown (stream_k, split_kv, dense).
    assert "split_kv: 25.0 µs (1.2x)" in text
    assert "+4 more" in text, text  # stream_k(grid=66), split_kv(num_splits=2), tree, ring
    assert "num_splits=4" not in text  # compact: kinds only, not every parameter
    full = report.format_table(width=240, all_sites=True)
    assert full.count("tree: needs a process group (world size 1)") == 2
    assert "num_splits=4" in full and "+4 more" not in full


def test_untouched_sites_show_shapes_and_reasons():
    report = PlanReport(sites=[_prefill(0), _prefill(1), _decode(0)], profile="h100-sxm")
    text, rows = _rows(report)
    assert len(rows) == 2, text
    graph, count, module, shape, mask, plan, est, why = rows[0]
    assert (graph, count, module) == ("g0", "2", "model.layers.{0,1}.self_attn"), rows[0]
    assert shape == "B=1 H=32/8 q=? N~37 D=128 bfloat16" and mask == "causal", rows[0]
    assert (plan, est, why) == ("left alone", "-", "why: prefill: symbolic q_len"), rows[0]
    # A site no strategy applies to lists each strategy's reason.
    none = SiteReport(site=AttentionSite.canonical(node="odd", head_dim=48),
                      rejected=[Rejection("split_kv", "head_dim 48 not supported"), Rejection("dense", "test says no")])
    text = PlanReport(sites=[none]).format_table(width=200)
    assert "why: no applicable plan" in text and "split_kv: head_dim 48 not supported" in text
    assert "dense: test says no" in text and "D=48" in text


def test_all_sites_gives_one_row_per_site():
    report = PlanReport(sites=[_prefill(0), _prefill(1), _decode(0), _decode(1), _decode(2)], profile="cpu")
    text, rows = _rows(report, all_sites=True)
    assert len(rows) == 5, text
    assert [r[2] for r in rows] == ["model.layers.0.self_attn", "model.layers.1.self_attn",
                                                       "model.layers.0.self_attn", "model.layers.1.self_attn",
                                                       "model.layers.2.self_attn"]
    assert len(_rows(report)[1]) == 2


def test_headline_counts_by_plan_kind_and_reason():
    dense = _decode(2, plan=DensePlan().with_estimate(60.0), n=4096, calls=3)
    short = SiteReport(site=AttentionSite.canonical(node="s", kv_len=5, unsupported="kv_len=5 < min_kv_len=64"),
                       graph="g1")
    report = PlanReport(sites=[_prefill(0), _decode(0, calls=2), _decode(1, calls=2), dense, short],
                        profile="h100-sxm")
    assert report.headline() == ("5 attention site(s) in 2 graph(s): 3 rewritten (2 split_kv, 1 dense), 2 left alone "
                                 "(1 prefill, 1 kv_len < min_kv_len); profile h100-sxm; 7 attnopt op call(s) so far")
    text = report.format_table(width=200)
    assert text.splitlines()[0] == report.headline()
    assert "calls" in text  # the calls column appears when there are calls
    empty = PlanReport(profile="cpu")
    assert empty.headline() == "0 attention site(s): 0 rewritten, 0 left alone; profile cpu"
    assert empty.format_table().strip() == empty.headline()


def test_merge_keeps_each_sites_graph_and_every_profile():
    a = PlanReport(sites=[SiteReport(site=AttentionSite.canonical())], profile="h100-sxm", graph="g0")
    b = PlanReport(sites=[SiteReport(site=AttentionSite.canonical())], profile="h100-sxm (calibrated)", graph="g1")
    merged = PlanReport.merge([PlanReport.from_json(a.to_json()), PlanReport.from_json(b.to_json())])
    assert [s.graph for s in merged.sites] == ["g0", "g1"]
    assert merged.profile == "h100-sxm, h100-sxm (calibrated)"
    assert [s.graph for s in PlanReport.from_json(merged.to_json()).sites] == ["g0", "g1"]
    assert len(merged.groups()) == 2


@pytest.mark.parametrize("width", [60, 80, 120])
def test_table_fits_a_narrow_console(width):
    report = PlanReport(sites=[_prefill(0), _decode(0), _decode(1)], profile="h100-sxm")
    for all_sites in (False, True):
        text = report.format_table(width=width, all_sites=all_sites)
        assert max(len(line) for line in text.splitlines()) <= width, text
