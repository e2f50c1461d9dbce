"""The plan pass ranks each site shape once: every layer of a decoder is the same shape."""
from __future__ import annotations

import dataclasses
import importlib

import torch

import attnopt
from attnopt.bench.e2e import build_model
from attnopt.site import AttentionSite

plan_pass = importlib.import_module("attnopt.passes.plan")  # the package exports the pass function under this name


@torch.no_grad()
def test_identical_layers_are_ranked_once_with_the_same_answer(monkeypatch):
    calls = []
    rank = plan_pass.rank_candidates

    def counting(site, *args):
        calls.append(site.module_path)
        return rank(site, *args)

    monkeypatch.setattr(plan_pass, "rank_candidates", counting)
    model, _ = build_model("tiny", layers=3, dtype=torch.float32, device="cpu", max_positions=128)
    opt = attnopt.optimize(model, inner_backend="eager")
    ids = torch.randint(0, model.config.vocab_size, (1, 20))
    opt.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False, cache_implementation="static")
    report = attnopt.last_plans(opt)
    assert len(report.sites) == 3 and len(calls) == 1
    first = report.sites[0]
    for s in report.sites[1:]:
        assert s.candidates == first.candidates and s.rejected == first.rejected and s.chosen == first.chosen
        assert s.candidates is not first.candidates  # each report owns its lists


def test_the_ranking_key_keeps_the_module_path_only_for_saap():
    from attnopt.runtime.strategies import PlanContext

    site = AttentionSite(node="sdpa_3", module_path="model.layers.3.self_attn", pattern="sdpa", batch=1, q_heads=8,
                         kv_heads=2, head_dim=64, q_len=1, kv_len=4096, dtype="float16")
    other = dataclasses.replace(site, node="sdpa_4", module_path="model.layers.4.self_attn")
    plain = PlanContext(device_type="cuda", triton_available=True)
    assert plan_pass.ranking_key(site, plain) == plan_pass.ranking_key(other, plain)
    assert plan_pass.ranking_key(site, plain) != plan_pass.ranking_key(dataclasses.replace(other, kv_len=8192), plain)
    saap = PlanContext(device_type="cuda", triton_available=True, extras={"saap": {"index": "x.safetensors"}})
    assert plan_pass.ranking_key(site, saap) != plan_pass.ranking_key(other, saap)
