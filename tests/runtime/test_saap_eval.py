"""The SAAP quality harness and the ``attnopt saap`` CLI on a tiny random Llama (CPU, seconds)."""
import math
import sys
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("faiss")

from attnopt.runtime.saap import attended_keys, build_clusters, saap_decode  # noqa: E402
from attnopt.runtime.saap.decode import saap_decode_states, selectivity  # noqa: E402
from attnopt.runtime.saap.collect import collect, custom_attention  # noqa: E402
from attnopt.runtime.saap.evaluate import (Harness, Setting, corpus_text, evaluate_language,  # noqa: E402
                                           setting_for, sparse_layer_target)
from attnopt.runtime.saap.train import train_index  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=96, intermediate_size=96, num_attention_heads=6, num_key_value_heads=2,
                                   head_dim=16, num_hidden_layers=3, vocab_size=97, max_position_embeddings=2048)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.set_attn_implementation("sdpa")
    gen = torch.Generator().manual_seed(1)
    coll = collect(model, [torch.randint(0, 97, (320,), generator=gen)], queries_per_sequence=64,
                   min_query_position=64)
    index = train_index(coll, clusters=16, hidden=32, steps=20, batch=32, window=16, kmeans_iterations=4)
    return model, coll, index


def test_train_and_eval_text_parts_are_disjoint():
    train, held_out = corpus_text("train"), corpus_text("eval")
    assert len(train) > 100_000 and len(held_out) > 100_000
    assert train[:2000] not in held_out and held_out[:2000] not in train
    with pytest.raises(ValueError, match="valid: train, eval"):
        corpus_text("test")


def test_every_cluster_gives_dense_results(tiny):
    model, _, index = tiny
    ids = torch.randint(0, 97, (1, 200 + 8 + 1))[0]
    every = [Setting("mlp", 1.0, sink=1, window=4, probes=index.num_clusters),
             Setting("topk", 1.0, sink=1, window=4, probes=209)]
    harness = Harness(model, index)
    with custom_attention(model, "attnopt_saap_test", harness):
        rows, timing = evaluate_language(model, harness, [ids], 8, every)
    assert timing["prefill_s"] > 0 and timing["index_build_s"] > 0 and timing["index_build_first_s"] > 0
    dense, *full = rows
    for row in full:
        assert row["next_token_agreement"] == 1.0
        assert math.isclose(row["perplexity"], dense["perplexity"], rel_tol=1e-4)
        assert math.isclose(row["selectivity"], 1.0) and math.isclose(row["recall"], 1.0, rel_tol=1e-5)


@pytest.mark.parametrize("method,probes", [("mlp", 3), ("centroids", 3), ("window", 0), ("oracle", 3),
                                            ("topk", 20)])
def test_harness_attention_is_the_reference_decode(tiny, method, probes):
    model, _, index = tiny
    harness = Harness(model, index)
    s = Setting(method, 0.1, sink=1, window=8, probes=probes)
    harness.use(s, prompt_len=150)
    q, k, v = torch.randn(1, 6, 1, 16), torch.randn(1, 2, 151, 16), torch.randn(1, 2, 151, 16)
    out, _ = harness(types.SimpleNamespace(layer_idx=2), q, k, v, None, scaling=0.25)
    ref_index = index if method == "mlp" else index.without_mlp()
    state = build_clusters(ref_index, 2, k, 150, 1, 8)
    if method == "oracle":  # the clusters holding the most dense attention mass of the group's 3 heads
        probs = torch.softmax((q @ k.repeat_interleave(3, 1).transpose(-1, -2)) * 0.25, dim=-1)[:, :, 0]
        owner = state.cluster_of_positions(151)
        mass = torch.zeros(1, 2, index.num_clusters)
        mass.scatter_add_(-1, owner.clamp(min=0), probs.reshape(1, 2, 3, 151).sum(2) * (owner >= 0))
        keep = attended_keys(state, mass.topk(probes, dim=-1).indices, 151, 1)
        want, sel = saap_decode_states(q, k, v, keep, 0.25)[0], selectivity(keep)
    elif method == "topk":  # the 20 indexed keys of most group mass, plus sink and window
        probs = torch.softmax((q @ k.repeat_interleave(3, 1).transpose(-1, -2)) * 0.25, dim=-1)[:, :, 0]
        group = probs.reshape(1, 2, 3, 151).sum(2)
        group[..., :1] = group[..., 142:] = -1
        keep = torch.zeros(1, 2, 1, 151, dtype=torch.bool)
        keep[..., :1] = keep[..., 142:] = True
        keep.scatter_(-1, group.topk(20, dim=-1).indices[:, :, None], True)
        want, sel = saap_decode_states(q, k, v, keep, 0.25)[0], selectivity(keep)
    else:
        want, _, sel = saap_decode(ref_index, 2, state, q, k, v, probes, 0.25)
    torch.testing.assert_close(out.transpose(1, 2), want)
    assert math.isclose(harness.summary()["selectivity"], float(sel), rel_tol=1e-6)
    assert 0 < harness.summary()["recall"] < 1
    if method == "window":  # sink + window only: 1 + (151 - 142) keys
        assert math.isclose(float(sel), 10 / 151, rel_tol=1e-6)


@pytest.mark.parametrize("method", ["centroids", "mlp"])
def test_harness_picks_clusters_by_the_kernels_16_bit_rule(tiny, monkeypatch, method):
    # The quality curve must measure the set the kernel attends: scores that differ only below the rule's 16-bit
    # keys (saap_rule.SELECT_KEY_BITS) tie, and the tie goes to the lowest cluster index, where an fp32 top-k would
    # take the other cluster. Every other cluster scores far below both.
    from attnopt.runtime.kernels.saap_rule import SELECT_KEY_BITS, selection_keys
    from attnopt.runtime.saap.index import SaapIndex

    model, _, index = tiny
    k, v, q = torch.randn(1, 2, 151, 16), torch.randn(1, 2, 151, 16), torch.randn(1, 6, 1, 16)
    state = build_clusters(index.without_mlp(), 2, k, 150, 1, 8)
    sizes = (state.offsets[..., 1:] - state.offsets[..., :-1])[0]  # (Hkv, C)
    low, high = [int(c) for c in torch.nonzero(sizes.min(0).values > 0)[:2, 0]]  # non-empty in both heads
    scores = torch.full((1, 2, 1, index.num_clusters), 1e-3)
    scores[..., low] = 0.5
    scores[..., high] = 0.5 + 2.0 ** -20  # the same bf16 key, a larger fp32 score
    assert SELECT_KEY_BITS == 16 and torch.equal(selection_keys(scores[..., low]), selection_keys(scores[..., high]))
    assert int(scores[0, 0, 0].topk(1).indices) == high  # what an fp32 top-k would pick
    monkeypatch.setattr(SaapIndex, "cluster_scores", lambda self, *a, **kw: scores)
    harness = Harness(model, index)
    harness.use(Setting(method, 0.1, sink=1, window=8, probes=1), prompt_len=150)
    out, _ = harness(types.SimpleNamespace(layer_idx=2), q, k, v, None, scaling=0.25)
    for cluster, match in ((low, True), (high, False)):
        keep = attended_keys(state, torch.full((1, 2, 1), cluster), 151, 1)
        want = saap_decode_states(q, k, v, keep, 0.25)[0]
        assert torch.allclose(out.transpose(1, 2), want, atol=1e-6) is match, cluster


def test_oracle_recall_bounds_every_query_model_at_the_same_budget(tiny):
    model, _, index = tiny
    ids = torch.randint(0, 97, (1, 200 + 8 + 1), generator=torch.Generator().manual_seed(5))[0]
    settings = [Setting(m, 0.1, sink=1, window=8, probes=3) for m in ("oracle", "mlp", "centroids")]
    harness = Harness(model, index)
    with custom_attention(model, "attnopt_saap_test", harness):
        rows, _ = evaluate_language(model, harness, [ids], 8, settings)
    oracle, mlp, centroids = rows[1:]
    assert oracle["recall"] >= max(mlp["recall"], centroids["recall"]) - 1e-6
    assert oracle["recall"] < 1


def test_setting_shrinks_the_window_with_the_context(tiny):
    _, _, index = tiny
    s8 = setting_for(index, "mlp", 0.10, 8192, 64)
    s2 = setting_for(index, "mlp", 0.10, 2048, 16)
    assert s8.window == 128 and s2.window == 32 and s8.probes >= 1
    streaming = setting_for(index, "window", 0.10, 8192, 64)
    assert streaming.probes == 0 and streaming.window == round(819.2 - 4 - 32)
    with pytest.raises(ValueError, match="valid: mlp, centroids, window, oracle, topk"):
        setting_for(index, "lsh", 0.1, 8192, 64)


def test_total_selectivity_counts_the_dense_layers():
    # SmolLM2: 30 layers, layer 0 dense. 10 % of every key leaves (3 - 1) / 29 to each sparse layer
    assert math.isclose(sparse_layer_target(0.10, 30, 29), 2 / 29)
    assert math.isclose(sparse_layer_target(0.5, 4, 4), 0.5)
    with pytest.raises(ValueError, match="1 dense layer.*of 30 alone read 0.0333"):
        sparse_layer_target(0.02, 30, 29)
    with pytest.raises(ValueError, match="0 < total"):
        sparse_layer_target(0.0, 30, 29)


def test_cli_trains_an_index_from_a_collection(tmp_path, tiny):
    from attnopt.cli import main
    from attnopt.runtime.saap import load_index

    model, coll, _ = tiny
    cpath, ipath = tmp_path / "c.safetensors", tmp_path / "i.safetensors"
    coll.save(cpath)
    rc = main(["saap", "train", str(cpath), "--out", str(ipath), "--clusters", "16", "--hidden", "8", "--steps", "3",
               "--window", "16", "--mlp", "--deroped", "--refine", "0"])  # the paper's configuration
    assert rc == 0
    index = load_index(ipath, model.config)
    assert index.has_mlp and sorted(index.layers) == [1, 2] and index.train_info["hidden"] == 8
    assert not index.rotated and index.refine == 0
    assert main(["saap", "train", str(cpath), "--out", str(ipath), "--clusters", "16"]) == 0
    index = load_index(ipath, model.config)  # the defaults: rotated keys, refined at prefill, centroid scoring
    assert not index.has_mlp and index.rotated and index.refine == 2
    assert main(["saap", "train", str(cpath), "--out", str(ipath), "--clusters", "16", "--sparse-layer-0"]) == 0
    assert sorted(load_index(ipath, model.config).layers) == [0, 1, 2]
    assert main(["saap", "train", str(tmp_path / "missing.safetensors"), "--out", str(ipath)]) == 2


class _CharTokenizer:
    """Characters as token ids (mod the tiny model's vocabulary): enough for the harness's text and passkey."""

    def __call__(self, text, return_tensors=None, add_special_tokens=True):
        return types.SimpleNamespace(input_ids=torch.tensor([[ord(c) % 97 for c in text]]))

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def test_cli_eval_aims_at_total_selectivity_and_skips_what_the_dense_layer_exceeds(tmp_path, tiny, monkeypatch):
    import json

    import attnopt.commands.saap as saap_cli
    from attnopt.cli import main

    model, _, index = tiny
    ipath, out = tmp_path / "i.safetensors", tmp_path / "q.json"
    index.save(ipath)
    monkeypatch.setattr(saap_cli, "_load_model", lambda name: (model, _CharTokenizer()))
    rc = main(["saap", "eval", "--model", str(tmp_path), "--index", str(ipath), "--context", "160", "--sequences", "1",
               "--tail", "8", "--targets", "0.2,0.6", "--methods", "centroids,topk", "--passkey-lengths", "128",
               "--passkey-trials", "1", "--out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert len(res["skipped"]) == 1 and "0.2 is out of reach" in res["skipped"][0]  # layer 0 of 3 alone is 1/3
    sparse = [r for r in res["rows"] if r["method"] != "dense"]
    assert {r["method"] for r in sparse} == {"centroids", "topk"} and len(res["passkey"]) == 3
    for r in sparse + [p for p in res["passkey"] if p["method"] != "dense"]:
        assert r["target_all_layers"] == 0.6 and math.isclose(r["target"], 0.4)  # (0.6 * 3 - 1) / 2
        assert math.isclose(r["selectivity_all_layers"], (2 * r["selectivity"] + 1) / 3)


def test_gpu_quality_script_summary_picks_the_best_point_under_each_budget():
    script = _script("saap_quality_gpu")

    def row(method, C, window, probes, sel, agree, ppl):
        return {"method": method, "clusters": C, "window": window, "probes": probes, "selectivity": sel - 0.01,
                "selectivity_all_layers": sel,  # what the budgets count: every layer, the dense one included
                "recall": 0.9, "next_token_agreement": agree, "perplexity": ppl, "dense_layers": 1}

    def passkey(length, found, target, window, probes, **extra):  # scaled from the 8k point (window, probes)
        return {"length": length, "method": "mlp", "clusters": "64", "dense_layers": 1, "target": target,
                "window": window // 4, "probes": probes // 4, "point_window": window, "point_probes": probes,
                "found": found, "trials": 4, **extra}

    results = {"rows": [row("dense", None, None, None, 1.0, 1.0, 10.0),
                        row("mlp", "64", 32, 2, 0.04, 0.90, 10.5), row("mlp", "64", 32, 4, 0.09, 0.96, 10.2),
                        row("mlp", "64", 32, 8, 0.16, 0.99, 10.0), row("window", None, 400, 0, 0.05, 0.8, 12.0)],
               "passkey": [{"length": 2048, "method": "dense", "found": 3, "trials": 4},
                           passkey(2048, 3, 0.1, 32, 4), passkey(2048, 1, 0.05, 32, 2), passkey(2048, 4, 0.2, 32, 8)]}
    summary = script.summarize(results)
    by = {(r["method"], r["clusters"], r["at_most"]): r for r in summary}
    assert (0.02 in {r["at_most"] for r in summary}) is False  # nothing reaches 2 %: no row claims it
    five, ten, twenty = by[("mlp", "64", 0.05)], by[("mlp", "64", 0.1)], by[("mlp", "64", 0.2)]
    assert (five["probes"], five["passkey"], five["done"]) == (2, "1/4", False)
    assert (ten["probes"], ten["passkey"], ten["done"]) == (4, "3/4", True)  # 0.96 at 9 %, +2 % ppl, 3/4 as dense
    assert (twenty["probes"], twenty["passkey"], twenty["done"]) == (8, "4/4", False)  # done is judged at 10 %
    assert math.isclose(ten["ppl_vs_dense"], 0.02)
    assert by[("window", None, 0.05)]["passkey"] == "-" and not by[("window", None, 0.1)]["done"]
    results["passkey"][1]["selectivity_all_layers"] = 0.2  # found, but over the budget: not done
    assert not {(r["method"], r["at_most"]): r for r in script.summarize(results)}[("mlp", 0.1)]["done"]


def test_gpu_quality_script_sweep_reaches_each_target_of_the_curve():
    script = _script("saap_quality_gpu")
    paper = script.sweep_settings(2048, 8192, 64, ["window", "centroids"], layers=30, dense_layers=1)
    streaming = [s for s in paper if s.method == "window"]
    assert [s.target for s in streaming] == [0.05, 0.10, 0.20]  # 2 %: layer 0 alone reads 3.3 %
    for s in streaming:  # sink + window + half the decoded tail, on 29 sparse layers, 98 % of the target
        sparse = (s.sink + s.window + 32) / 8192
        assert 0.97 * s.target < (29 * sparse + 1) / 30 < s.target
    every = script.sweep_settings(2048, 8192, 64, ["window"], layers=30, dense_layers=0)
    assert [s.target for s in every] == [0.02, 0.05, 0.10, 0.20]
    # the 2 % point (every layer sparse) and the 5 % one (layer 0 dense) need a 32-key window and ~10-20 clusters
    centroids = {(s.window, s.probes) for s in paper if s.method == "centroids"}
    assert {(32, 10), (32, 20), (64, 10)} <= centroids and max(p for _, p in centroids) == round(0.16 * 2048)
    assert len(centroids) == len([s for s in paper if s.method == "centroids"])
    topk = script.sweep_settings(2048, 8192, 64, ["topk"])
    assert {s.window for s in topk} == {64} and [s.probes for s in topk][:2] == [41, 82]  # keys, not clusters


def test_gpu_quality_script_index_configurations():
    script = _script("saap_quality_gpu")
    assert script.parse_spec("1024") == (1024, False, True, 0, False)  # the paper's: de-roped, MLP, layer 0 dense
    assert script.parse_spec("2048rn:2") == (2048, True, False, 2, False)
    assert script.parse_spec("2048rna:2").all_layers and script.parse_spec("512n") == (512, False, False, 0, False)
    with pytest.raises(ValueError, match="<clusters>"):
        script.parse_spec("2048x")


def _script(name):
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(name, Path(__file__).parents[2] / "benchmarks" / f"{name}.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_partition_study_recalls_everything_at_full_budget_and_topk_bounds_the_window(tiny):
    model = tiny[0]
    gen = torch.Generator().manual_seed(2)
    coll = collect(model, [torch.randint(0, 97, (256,), generator=gen) for _ in range(2)], queries_per_sequence=16,
                   min_query_position=128)
    study = _script("saap_quality_partition").study
    full, _ = study(coll, 1.0, sink=2, queries=8, layers=[1], clusters=(8,), iterations=3)
    for name, value in full[1].items():
        if name.endswith("/fixed"):  # l from the mean cluster size: not every cluster, even at full budget
            continue
        assert math.isclose(value[0] if isinstance(value, tuple) else value, 1.0, rel_tol=1e-5), name
    part, info = study(coll, 0.2, sink=2, queries=8, layers=[1, 2], clusters=(8,), iterations=3)
    for row in part.values():  # the keys of most group mass beat the same count of recent keys
        assert row["topk/sum"] >= row["window"] - 1e-6
        assert 0.2 <= row["oracle/deroped/C8/sum/budget"][1] < 0.6  # whole clusters: the last one may overrun
    assert set(info["mean"]) == set(part[1])
    only, _ = study(coll, 0.2, sink=2, queries=8, layers=[1], clusters=(8,), iterations=3, names=("blocks",))
    assert {k.split("/")[1] for k in only[1] if k.startswith("oracle/")} == {"blocks"}
    with pytest.raises(ValueError, match="unknown partition.*lsh.*valid: deroped"):
        study(coll, 0.2, sink=2, queries=8, layers=[1], clusters=(8,), iterations=3, names=("lsh",))


def test_partition_study_budget_rule_takes_whole_clusters_by_mass_until_the_budget():
    script = _script("saap_quality_partition")
    assign = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2]])  # (Hkv=1, N=8); clusters of sizes 3, 2, 3
    indexed = torch.ones(1, 8, dtype=torch.bool)
    always = torch.zeros(1, 8, dtype=torch.bool)
    mass = torch.tensor([[[0.2, 0.5, 0.3]]])  # cluster 1, then 2, then 0
    keep = script.cluster_keep(mass, assign, indexed, always, torch.tensor([4.0]), "budget", 8 / 3)
    assert keep[0, 0].tolist() == [False] * 3 + [True] * 5  # 2 keys < 4, so cluster 2 too (5 keys), not cluster 0
    keep = script.cluster_keep(mass, assign, indexed, always, torch.tensor([2.0]), "budget", 8 / 3)
    assert keep[0, 0].tolist() == [False] * 3 + [True] * 2 + [False] * 3


def test_scoring_study_curves_reach_full_recall_and_refinement_keeps_them_sound(tiny):
    model = tiny[0]
    gen = torch.Generator().manual_seed(3)
    coll = collect(model, [torch.randint(0, 97, (256,), generator=gen) for _ in range(2)], queries_per_sequence=16,
                   min_query_position=128)
    script = _script("saap_quality_scoring")
    for refine in (0, 2):
        curves = script.layer_curves(coll, 1, [8], [16], [0.25, 0.5, 1.0], queries=8, sink=2, rotated=True,
                                     iterations=3, refine=refine)
        for key, curve in curves.items():
            sels, recalls = [c[1] for c in curve], [c[2] for c in curve]
            assert sels == sorted(sels) and recalls == sorted(recalls), key  # more probes: more keys, more mass
            if key[0] != "topk":  # every cluster probed: every visible key, all the mass
                assert math.isclose(recalls[-1], 1.0, rel_tol=1e-5), key
        oracle, centroids = curves[("oracle", 8, 16)], curves[("centroids", 8, 16)]
        assert oracle[0][2] >= centroids[0][2] - 1e-6 or oracle[0][1] > centroids[0][1]  # true mass ranks first
    both = {1: curves, 2: script.layer_curves(coll, 2, [8], [16], [0.25, 0.5, 1.0], queries=8, sink=2,
                                              rotated=True, iterations=3)}
    recall, sel, picks = script.allocate(both, lambda k: k[0] == "centroids", 0.6)
    assert sel <= 0.6 + 1e-9 and set(picks) == {1, 2} and 0 < recall <= 1


def test_harness_reuses_a_prompts_clusters_across_settings_and_drops_them_at_the_next_prompt(tiny):
    model, _, index = tiny
    harness = Harness(model, index.without_mlp())
    q, k, v = torch.randn(1, 6, 1, 16), torch.randn(1, 2, 151, 16), torch.randn(1, 2, 151, 16)
    layer = types.SimpleNamespace(layer_idx=2)
    outs = []
    for s in (Setting("centroids", 0.1, 1, 8, 3), Setting("oracle", 0.1, 1, 8, 3), Setting("centroids", 0.1, 1, 8, 5)):
        harness.use(s, prompt_len=150)
        outs.append(harness(layer, q, k, v, None, scaling=0.25)[0])
        fresh = Harness(model, index.without_mlp())  # builds its own clusters: the same answer
        fresh.use(s, prompt_len=150)
        torch.testing.assert_close(outs[-1], fresh(layer, q, k, v, None, scaling=0.25)[0], rtol=0, atol=0)
    assert list(harness.states) == [(2, 1, 8)]  # one build for the three settings of one sink and window
    harness.use(None, prompt_len=150)  # a dense call starts every prompt: the clusters are of the last one
    assert harness.states == {}
    harness.use(Setting("centroids", 0.1, 1, 8, 3), prompt_len=150)
    k2 = torch.randn(1, 2, 151, 16)  # another prompt's keys
    fresh = Harness(model, index.without_mlp())
    fresh.use(Setting("centroids", 0.1, 1, 8, 3), prompt_len=150)
    torch.testing.assert_close(harness(layer, q, k2, v, None, scaling=0.25)[0],
                               fresh(layer, q, k2, v, None, scaling=0.25)[0], rtol=0, atol=0)


def test_harness_sparsifies_layer_0_only_when_the_index_covers_it(tiny):
    model, coll, index = tiny
    q, k, v = torch.randn(1, 6, 1, 16), torch.randn(1, 2, 151, 16), torch.randn(1, 2, 151, 16)
    s = Setting("centroids", 0.1, sink=1, window=8, probes=2)
    dense = Harness(model, index)  # layers 1 and 2: layer 0 stays dense
    dense.use(s, prompt_len=150)
    out, _ = dense(types.SimpleNamespace(layer_idx=0, scaling=0.25), q, k, v, None, scaling=0.25)
    assert dense.stats["selectivity"] == []  # nothing sparse ran
    every = train_index(coll, clusters=16, mlp=False, layers=[0, 1, 2], kmeans_iterations=4)
    harness = Harness(model, every)
    harness.use(s, prompt_len=150)
    sparse, _ = harness(types.SimpleNamespace(layer_idx=0), q, k, v, None, scaling=0.25)
    want, _, sel = saap_decode(every, 0, build_clusters(every, 0, k, 150, 1, 8), q, k, v, 2, 0.25)
    torch.testing.assert_close(sparse.transpose(1, 2), want)
    assert math.isclose(harness.summary()["selectivity"], float(sel), rel_tol=1e-6) and float(sel) < 0.5
    assert not torch.allclose(sparse, out)


def test_gpu_quality_script_runs_the_curve_with_layer_0_sparse_and_merges_two_runs(tmp_path, tiny, monkeypatch):
    import argparse
    import json

    model = tiny[0]
    script = _script("saap_quality_gpu")
    monkeypatch.setattr(script, "load_model", lambda gguf, device: (model, _CharTokenizer()))
    # 3 layers: layer 0 dense is a third of the keys, so 0.3 is out of reach but for an index over every layer
    monkeypatch.setattr(script, "CURVE_TARGETS", (0.3, 0.6))
    # and in its sibling, whose summary and passkey points read them
    monkeypatch.setattr(sys.modules["saap_quality_summary"], "CURVE_TARGETS", (0.3, 0.6))
    monkeypatch.setattr(script, "STREAMING_TARGETS", (0.3, 0.6))
    monkeypatch.setattr(script, "SWEEP", {1 / 16: (0.1, 0.3), 1 / 8: (0.2, 0.5)})
    monkeypatch.setattr(script, "TOPK_SWEEP", {1 / 16: (0.1, 0.2, 0.4)})

    def run(clusters, methods, name):
        args = argparse.Namespace(
            gguf=None, out=str(tmp_path), out_name=name, device="cpu", context=160, train_sequences=2, queries=16,
            clusters=clusters, hidden=8, steps=3, batch=16, lr=1e-3, train_window=16, eval_sequences=1,
            eval_stride=160, tail=8, methods=methods, passkey_lengths="128", passkey_trials=1, budget_s=600,
            commit="test")
        Cs = clusters.split(",")
        return script.run(args, methods.split(","), Cs, {c: script.parse_spec(c) for c in Cs})

    a = run("16rn:1,16rna:1", "centroids,topk", "a.json")
    assert json.loads((tmp_path / "a.json").read_text())["summary"] == json.loads(json.dumps(a["summary"]))
    assert any("16rn:1: total selectivity 0.3 out of reach" in s for s in a["skipped"])
    for r in a["rows"][1:] + [p for p in a["passkey"] if p["method"] != "dense"]:
        n_sparse = 3 - r["dense_layers"]
        if r.get("clusters"):
            assert r["dense_layers"] == (0 if r["clusters"] == "16rna:1" else 1)
        assert math.isclose(r["selectivity_all_layers"], (r["selectivity"] * n_sparse + r["dense_layers"]) / 3)
    groups = {(r["method"], r["clusters"], r["dense_layers"]) for r in a["rows"][1:]}
    assert groups == {("centroids", "16rn:1", 1), ("centroids", "16rna:1", 0), ("topk", None, 1), ("topk", None, 0)}
    at_03 = {(r["method"], r["clusters"]) for r in a["summary"] if r["at_most"] == 0.3}
    assert at_03 and all(r["dense_layers"] == 0 for r in a["summary"] if r["at_most"] == 0.3)
    for r in a["summary"]:
        assert r["selectivity"] <= r["at_most"] and r["passkey"] != "-"  # each point's passkey ran and is found
    b = run("16", "mlp,centroids", "b.json")
    merged = script.merge([a, b])
    assert [r["method"] for r in merged["rows"]].count("dense") == 1 and set(merged["indexes"]) == {
        "16rn:1", "16rna:1", "16"}
    assert {(r["method"], r["clusters"]) for r in merged["summary"]} >= {("mlp", "16"), ("centroids", "16rna:1")}
    assert "timing_beside_other_runs" in merged and "index_build_s" not in merged
    with pytest.raises(ValueError, match="repeats index configuration"):
        script.merge([a, a])
    with pytest.raises(ValueError, match="'context'"):
        script.merge([a, dict(b, context=8192)])
    b["rows"][0] = dict(b["rows"][0], perplexity=b["rows"][0]["perplexity"] * 1.01)
    with pytest.raises(ValueError, match="dense perplexity.*not the same evaluation"):
        script.merge([a, b])
