"""Generic tests of every registered plan kind and strategy (DESIGN.md: JSON round trip, candidates not
empty for a canonical site, results against the reference)."""
import math

import pytest
import torch

from attnopt import AttentionSite, PlanReport, SiteReport
from attnopt.hardware import builtin_profile
from attnopt.plan import PLAN_KINDS, DensePlan, Rejection, SplitKVPlan, plan_from_dict, plan_from_json
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


@pytest.mark.parametrize("kind", sorted(STRATEGIES))
def test_every_strategy_has_candidates_on_canonical_site(kind):
    strategy = STRATEGIES[kind]
    world = 2 if strategy.distributed else 1
    ctx = PlanContext(world_size=world, device_type="cuda", triton_available=True,
                      topology="2x-h200-nvlink" if world > 1 else None)
    site = AttentionSite.canonical()
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
