"""``export_onnx`` for the plan kinds beyond one device's exact ones: tree and ring (their single-device equivalent,
also checked against a real 2-rank gloo decode), bucketed (the bucket of the exported length), and SAAP (an
``attnopt:saap_decode_attention`` node whose function body is SAAP's reference decode), each run in onnxruntime on
the CPU against PyTorch (fp32, 1e-5); and the early errors that name what can be exported.
"""
from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")
pytest.importorskip("safetensors")

from attnopt.export import EXPORTABLE_KINDS, OnnxTranslator, export_onnx  # noqa: E402
from attnopt.plan import BucketedPlan, RingPlan, SaapPlan, SplitKVPlan, StreamKPlan, TreePlan  # noqa: E402
from attnopt.runtime import ops as _ops, reference  # noqa: E402,F401  (ops registers torch.ops.attnopt.*)
from attnopt.runtime.saap import registry  # noqa: E402
from attnopt.runtime.saap.build import build_clusters  # noqa: E402
from attnopt.runtime.saap.index import LayerIndex, synthetic_index  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_export import close, nodes as ops_of  # noqa: E402  (checker-validated (domain, op) list; fp32 compare)

SCALE = 0.125
BUCKETED = BucketedPlan(bounds=(64, 4096), plans=(SplitKVPlan(num_splits=2).runtime_key(),
                                                  StreamKPlan().runtime_key()))


def run_ort(path, feeds):
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {k: (v.numpy() if isinstance(v, torch.Tensor) else v) for k, v in feeds.items()})


def attention_fn(plan: str, causal: bool = False):
    def fn(q, k, v, lengths):
        return torch.ops.attnopt.decode_attention(q, k, v, None, lengths, SCALE, causal, plan, "model.layers.1.attn")

    return fn


def decode_case(seed=0, B=2, Hq=6, Hkv=2, L=1, N=96, D=64, lengths=(85, 90)):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, Hq, L, D, generator=g), torch.randn(B, Hkv, N, D, generator=g),
               torch.randn(B, Hkv, N, D, generator=g))
    return q, k, v, torch.tensor(lengths[:B])


# --------------------------------------------------------------------------------------------- tree, ring, bucketed
EXACT_PLANS = [TreePlan(world=2), TreePlan(world=4, collective="all_reduce", hierarchical=True),
               RingPlan(world=2, variant="pass_kv"), RingPlan(world=2, variant="pass_q"), BUCKETED]


@pytest.mark.parametrize("plan,attention", [(p, "auto") for p in EXACT_PLANS] + [(EXACT_PLANS[0], "function"),
                                                                                (BUCKETED, "function")],
                         ids=lambda x: x.describe() if hasattr(x, "describe") else x)
def test_exact_plans_export_as_exact_attention(tmp_path, plan, attention):
    """Tree and ring become their single-device equivalent and a bucketed plan the plan of the exported length's
    bucket (stream_k at N=96): one standard Attention node, or the exact decode_attention body."""
    q, k, v, lengths = decode_case()
    path = tmp_path / "x.onnx"
    export_onnx(attention_fn(plan.runtime_key()), (q, k, v, lengths), path, attention=attention)
    model, ops = ops_of(path)
    if attention == "auto":
        assert ops.count(("", "Attention")) == 1 and not any(d == "attnopt" for d, _ in ops), ops
    else:
        assert ("attnopt", "decode_attention") in ops and [f.name for f in model.functions] == ["decode_attention"]
    (got,) = run_ort(path, {"q": q, "k": k, "v": v, "lengths": lengths})
    close(got, reference.decode_attention(q, k, v, valid_len=lengths, scale=SCALE))


def test_exported_as_names_the_plan_that_became_the_node(tmp_path, fresh_registry):
    t = OnnxTranslator(24)
    tree = TreePlan(world=2).runtime_key()
    assert t.resolve(tree, 96) == ("standard", tree, "tree plan, single-device equivalent")
    split = SplitKVPlan(num_splits=2).runtime_key()
    assert t.resolve(BUCKETED.runtime_key(), 40) == ("standard", split, "bucketed: split_kv at N=40")
    assert t.resolve(BUCKETED.runtime_key(), None) == ("standard", BUCKETED.runtime_key(), "bucketed: every bucket exact")
    assert OnnxTranslator(24, "function").resolve(RingPlan(world=2).runtime_key(), 8)[0] == "function"
    saap = SaapPlan(index=saap_index(tmp_path, mlp=False), probes=8, sink=4, window=16, layer=1).runtime_key()
    assert t.resolve(saap, 8)[0] == "saap"
    # a bucketed plan with a SAAP bucket: the SAAP node of the exported length's bucket, with its own plan
    mixed = BucketedPlan(bounds=(64, 4096), plans=(split, saap))
    assert t.resolve(mixed.runtime_key(), 96) == ("saap", saap, "bucketed: saap at N=96")
    q, k, v, lengths = decode_case(seed=5)
    state = build_clusters(registry.get_index(json.loads(saap)["data"]["index"]), 1, k, prompt_len=80, sink=4,
                           window=16)
    out = tmp_path / "mixed.onnx"
    export_onnx(attention_fn(mixed.runtime_key()), (q, k, v, lengths), out)
    (got,) = run_ort(out, {"q": q, "k": k, "v": v, "lengths": lengths,
                           "saap_clusters_1": state.cluster_of_positions(k.shape[2]).numpy()})
    close(got, reference.decode_attention(q, k, v, valid_len=lengths, scale=SCALE))  # every cluster probed


@pytest.mark.parametrize("plan,kwargs,match", [
    ('{"kind": "warp_drive", "version": 1, "data": {}}', {}, "exportable kinds: dense, split_kv, stream_k, tree, ring, "
                                                              "saap, bucketed"),
    (SaapPlan(index="i", layer=1).runtime_key(), {"attention": "standard"}, "no standard ONNX node"),
    (SaapPlan(index="i", layer=1).runtime_key(), {"states": True}, "decode_attention only"),
    (BucketedPlan(bounds=(64, 128), plans=(SplitKVPlan().runtime_key(), SaapPlan(index="i", layer=1).runtime_key())
                  ).runtime_key(), {"kv_len": None}, "static KV length"),
])
def test_what_cannot_be_exported_fails_early_naming_what_can(plan, kwargs, match):
    translator = OnnxTranslator(24, kwargs.pop("attention", "auto"))
    with pytest.raises(ValueError, match=match):
        translator.resolve(plan, kwargs.get("kv_len", 96), kwargs.get("states", False))


def test_unknown_kind_fails_before_the_export(tmp_path):
    """The check runs on the rewritten graph, before torch.onnx starts."""
    q, k, v, lengths = decode_case()
    with pytest.raises(ValueError, match="no ONNX export for plan kind 'warp_drive'.*exportable kinds"):
        export_onnx(attention_fn('{"kind": "warp_drive", "version": 1, "data": {}}'), (q, k, v, lengths),
                    tmp_path / "x.onnx")
    assert not (tmp_path / "x.onnx").exists()
    assert set(EXPORTABLE_KINDS) >= {"dense", "split_kv", "stream_k", "tree", "ring", "saap", "bucketed"}


_TEST_LIBS: list = []


def test_an_attnopt_op_without_translation_fails_early_naming_those_that_export(tmp_path):
    if not hasattr(torch.ops.attnopt, "export_test_identity"):  # once per process (spawned ranks import this file)
        lib = torch.library.Library("attnopt", "FRAGMENT")
        lib.define("export_test_identity(Tensor x) -> Tensor")
        lib.impl("export_test_identity", lambda x: x.clone(), "CompositeExplicitAutograd")
        torch.library.register_fake("attnopt::export_test_identity", lambda x: torch.empty_like(x), lib=lib)
        _TEST_LIBS.append(lib)
    with pytest.raises(ValueError, match="export_test_identity.default has no ONNX translation; attnopt ops that "
                                         "export: attnopt.decode_attention"):
        export_onnx(lambda x: torch.ops.attnopt.export_test_identity(x), (torch.ones(2),), tmp_path / "x.onnx")


def _sharded_decode(rank, world, q, k, v, lengths):
    """A rank's tree and ring decode over its shard of the cache (the op path, as attnopt runs it)."""
    from attnopt.runtime import distributed as D

    group = D.register_group(timeout=20, name="export")
    cache = D.ShardedKVCache(group)
    local_k, local_v = cache.update(0, k, v)
    out = {}
    for plan in (TreePlan(world=world), RingPlan(world=world, variant="pass_kv")):
        out[plan.kind] = torch.ops.attnopt.decode_attention(q, local_k, local_v, None, lengths, SCALE, False,
                                                            plan.runtime_key(), "export:" + plan.kind).numpy()
    group.cache = None  # numpy, not tensors: a tensor crosses the queue as a shared-memory handle of a dead process
    return out


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_single_device_graph_equals_the_sharded_decode_on_gloo(tmp_path):
    """Two gloo ranks decode over a sequence-sharded cache with tree and ring plans; the exported graph of each
    plan, given the whole cache, computes the same output in onnxruntime."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
    from test_distributed import ok_payloads, run_ranks  # the gloo harness

    q, k, v, lengths = decode_case(seed=3, lengths=(70, 96))
    results = ok_payloads(run_ranks(_sharded_decode, 2, q, k, v, lengths, deadline=150))
    for kind, plan in (("tree", TreePlan(world=2)), ("ring", RingPlan(world=2, variant="pass_kv"))):
        path = tmp_path / f"{kind}.onnx"
        export_onnx(attention_fn(plan.runtime_key()), (q, k, v, lengths), path)
        (got,) = run_ort(path, {"q": q, "k": k, "v": v, "lengths": lengths})
        for rank in (0, 1):
            close(got, torch.from_numpy(results[rank][kind]))


# --------------------------------------------------------------------------------------------- SAAP
def saap_index(tmp_path, mlp: bool, clusters=8, theta=10000.0):
    """A 2-layer index (layer 1 covered) for 6 query / 2 KV heads of 64: random centroids, and with ``mlp`` a
    random query MLP (hidden 16) with a BatchNorm that is not the identity."""
    index = synthetic_index(6, 2, 64, clusters, layers=(1,), num_layers=2, seed=1, rope_theta=theta)
    if mlp:
        g = torch.Generator().manual_seed(2)
        hkv, hidden = 2, 16
        weights = {"w1": torch.randn(hkv, hidden, 64, generator=g) / 8, "b1": torch.randn(hkv, hidden, generator=g),
                   "bn_mean": torch.randn(hkv, hidden, generator=g), "bn_var": torch.rand(hkv, hidden, generator=g) + 0.5,
                   "bn_weight": torch.randn(hkv, hidden, generator=g), "bn_bias": torch.randn(hkv, hidden, generator=g),
                   "w2": torch.randn(hkv, clusters, hidden, generator=g), "b2": torch.randn(hkv, clusters, generator=g)}
        index.layers[1] = LayerIndex(index.layers[1].centroids, weights)
    path = tmp_path / ("mlp.safetensors" if mlp else "centroids.safetensors")
    index.save(path)
    return str(path)


@pytest.fixture
def fresh_registry():
    registry.reset()
    yield
    registry.reset()


@pytest.mark.parametrize("mlp,L,with_lengths,opset,centroid_dtype", [
    (False, 1, True, 24, torch.float32), (False, 1, True, 24, torch.bfloat16), (True, 1, True, 24, None),
    (True, 2, False, 23, None)], ids=["centroids-fp32", "centroids-bf16", "mlp", "mlp-q2-no-valid-len-opset23"])
def test_saap_exports_its_sparse_decode_as_a_function_body(tmp_path, fresh_registry, monkeypatch, mlp, L,
                                                           with_lengths, opset, centroid_dtype):
    """The SAAP node's body picks the same clusters and attends to the same keys as the op's PyTorch path (the
    reference decode); it differs from dense attention, so the selection is really exercised. The index is in
    the file, the clusters of the keys are a graph input, ``saap_cluster_inputs`` makes them from the registry.
    The file holds the centroids as the rule rounds them (``saap_rule.CENTROID_DTYPE``, both ways)."""
    import attnopt.runtime.kernels.saap_rule as rule
    from attnopt.export_saap import saap_cluster_inputs

    if centroid_dtype is not None:
        monkeypatch.setattr(rule, "CENTROID_DTYPE", centroid_dtype)

    path = saap_index(tmp_path, mlp)
    q, k, v, lengths = decode_case(seed=4, L=L)
    index = registry.get_index(path)
    registry.set_state(path, 1, build_clusters(index, 1, k, prompt_len=80, sink=4, window=16))
    plan = SaapPlan(index=path, probes=3, sink=4, window=16, layer=1)
    lengths = lengths if with_lengths else None

    def fn(q, k, v):
        return torch.ops.attnopt.decode_attention(q, k, v, None, lengths, SCALE, False, plan.runtime_key(), "s1")

    want = fn(q, k, v)
    out = tmp_path / "saap.onnx"
    export_onnx(fn, (q, k, v), out, opset=opset)
    model, ops = ops_of(out)
    name = "saap_decode_attention_mlp" if mlp else "saap_decode_attention"
    assert ops.count(("attnopt", name)) == 1 and [f.name for f in model.functions] == [name]
    assert [i.name for i in model.graph.input] == ["q", "k", "v", "saap_clusters_1"]

    class Report:  # what saap_cluster_inputs reads of a PlanReport
        sites = [type("Site", (), {"rewritten": True, "chosen": plan})()]

    feeds = {"q": q, "k": k, "v": v, **saap_cluster_inputs(Report, k.shape[2])}
    (got,) = run_ort(out, feeds)
    close(got, want)
    dense = reference.decode_attention(q, k, v, valid_len=lengths, scale=SCALE)
    assert np.abs(got - dense.numpy()).max() > 1e-2
    if not mlp:  # the centroids in the file: the ones the op scores with (rounded by the rule), not the index's own
        cents = index.layers[1].centroids
        tensors = [*model.graph.initializer, *(a.t for n in [*model.graph.node, *model.functions[0].node]
                                               if n.op_type == "Constant" for a in n.attribute if a.name == "value")]
        stored = [onnx.numpy_helper.to_array(t) for t in tensors if tuple(t.dims) == tuple(cents.shape)]
        assert len(stored) == 1 and np.array_equal(stored[0], rule.scoring_centroids(cents).float().numpy())
        assert np.array_equal(stored[0], cents.numpy()) is (centroid_dtype == torch.float32)
        close(onnx.reference.ReferenceEvaluator(model).run(None, {k_: np.asarray(v_) for k_, v_ in
                                                                  ((n, t.numpy() if isinstance(t, torch.Tensor) else t)
                                                                   for n, t in feeds.items())})[0], want)


def test_saap_layer_outside_the_index_fails_early(tmp_path, fresh_registry):
    plan = SaapPlan(index=saap_index(tmp_path, mlp=False), layer=0)
    with pytest.raises(ValueError, match=r"layer 0 is not in the index .*\(layers \[1\]\)"):
        export_onnx(attention_fn(plan.runtime_key()), decode_case(), tmp_path / "x.onnx")
    assert not (tmp_path / "x.onnx").exists()


@pytest.mark.parametrize("change, message", [({"rotated": True}, "clusters rotated keys .* de-roped indexes only"),
                                               ({"refine": 2}, r"refines its centroids .*\(refine=2\)")])
def test_saap_rotated_or_refined_index_is_refused_before_the_export(tmp_path, fresh_registry, change, message):
    from dataclasses import replace

    from attnopt.export_saap import export_saap_clusters
    from attnopt.runtime.saap import load_index

    path = tmp_path / "changed.safetensors"
    replace(load_index(saap_index(tmp_path, mlp=False)), **change).save(path)
    plan = SaapPlan(index=str(path), layer=1)
    with pytest.raises(ValueError, match=message):
        export_onnx(attention_fn(plan.runtime_key()), decode_case(), tmp_path / "x.onnx")
    assert not (tmp_path / "x.onnx").exists()
    with pytest.raises(ValueError, match="export_saap_clusters: .*" + message):
        export_saap_clusters(str(path), str(tmp_path / "c.onnx"), batch=1, max_cache_len=64, sink=1, window=4)


def test_saap_with_every_cluster_probed_is_dense_attention(tmp_path, fresh_registry):
    """All 8 clusters probed: the node attends to every key, so ORT's output is exact attention."""
    path = saap_index(tmp_path, mlp=False)
    q, k, v, lengths = decode_case(seed=5)
    index = registry.get_index(path)
    state = build_clusters(index, 1, k, prompt_len=80, sink=4, window=16)
    plan = SaapPlan(index=path, probes=8, sink=4, window=16, layer=1)
    out = tmp_path / "all.onnx"
    export_onnx(attention_fn(plan.runtime_key()), (q, k, v, lengths), out)
    (got,) = run_ort(out, {"q": q, "k": k, "v": v, "lengths": lengths,
                           "saap_clusters_1": state.cluster_of_positions(k.shape[2]).numpy()})
    close(got, reference.decode_attention(q, k, v, valid_len=lengths, scale=SCALE))


# --------------------------------------------------------------------------------------------- SmolLM2 decode step
def plan_for_two_ranks(monkeypatch):
    """Make the export's planning context a 2-rank one, where tree and ring are candidates (no group is needed to
    plan; the export never runs the op)."""
    import attnopt.passes as passes

    make = passes.make_context
    monkeypatch.setattr(passes, "make_context", lambda config, example_inputs=(), **kw: make(
        config, example_inputs, **{**kw, "world_size": 2}))


class BucketingTuner:
    """A tuner that measured a bucketed choice: split_kv up to 32 keys, stream_k above (the step's cache has 48)."""

    def choose(self, site, ranked, **kw):  # kw: the planner's valid_len_sharing and graphed
        from attnopt.tuning import Choice

        return Choice(plan=BucketedPlan(bounds=(32, 4096), plans=(SplitKVPlan(num_splits=2).runtime_key(),
                                                                   StreamKPlan().runtime_key())), choice="measured")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["split_kv", "stream_k", "tree", "ring", "bucketed"])  # dense: test_export.py
def test_smollm2_shaped_decode_step_for_every_exact_kind(tmp_path, monkeypatch, kind):
    """A SmolLM2-135M-shaped Llama (9/3 heads of 64, hidden 576, 2 of its 30 layers, random weights, a 48-slot static
    cache) planned with each exact kind (tree and ring as a 2-rank planner picks them, bucketed as a tuner does):
    every site is one Attention-24 node with ``nonpad_kv_seqlen`` and no repeat_kv copy, and onnxruntime matches
    PyTorch on this step and the next, with the same next token."""
    from test_export import check_decode_steps, export_decode_step, smollm2_shaped

    from attnopt.tuning import use_tuner

    if kind in ("tree", "ring"):
        plan_for_two_ranks(monkeypatch)
    path = tmp_path / f"smollm2_{kind}.onnx"
    with use_tuner(BucketingTuner()) if kind == "bucketed" else contextlib.nullcontext():
        step, inputs, report = export_decode_step(smollm2_shaped(2), path, **({} if kind == "bucketed" else
                                                                              {"force_plan": kind}))
    assert [s.chosen.kind for s in report.sites] == [kind, kind]
    note = {"tree": "; tree plan, single-device equivalent", "ring": "; ring plan, single-device equivalent",
            "bucketed": "; bucketed: stream_k at N=48"}.get(kind, "")
    assert {s.exported_as for s in report.sites} == {f"onnx:Attention-24 (nonpad_kv_seqlen{note})"}
    _, ops = ops_of(path)
    assert ops.count(("", "Attention")) == 2 and ("", "Expand") not in ops, ops
    check_decode_steps(path, step, inputs)


@pytest.mark.slow
def test_smollm2_shaped_decode_step_with_saap(tmp_path, monkeypatch, fresh_registry):
    """The same step with SAAP at layer 1 (an index with a query MLP; layer 0 stays dense, as the index leaves it):
    layer 0 is an Attention node, layer 1 an attnopt:saap_decode_attention_mlp node, and onnxruntime, fed the
    clusters that the prefill built, matches the rewritten graph run in PyTorch (the op's reference SAAP decode) on
    this step and the next; SAAP really drops keys (the logits differ from dense attention's)."""
    from test_export import smollm2_shaped

    from attnopt.commands.export_onnx import example_step
    from attnopt.export import StaticCacheDecodeStep, rewrite_for_export
    from attnopt.export_saap import saap_cluster_inputs
    from attnopt.config import OptimizeConfig

    model = smollm2_shaped(2)
    index = synthetic_index(9, 3, 64, 8, layers=(1,), num_layers=2, seed=1, rope_theta=100000.0)
    g = torch.Generator().manual_seed(2)
    index.layers[1] = LayerIndex(index.layers[1].centroids, {
        "w1": torch.randn(3, 16, 64, generator=g) / 8, "b1": torch.randn(3, 16, generator=g),
        "bn_mean": torch.zeros(3, 16), "bn_var": torch.ones(3, 16), "bn_weight": torch.ones(3, 16),
        "bn_bias": torch.randn(3, 16, generator=g), "w2": torch.randn(3, 8, 16, generator=g),
        "b2": torch.zeros(3, 8)})
    index_file = str(tmp_path / "smol.safetensors")
    index.save(index_file)
    step = StaticCacheDecodeStep(model)
    position, max_len = 36, 48
    inputs = example_step(step, batch=1, max_cache_len=max_len, position=position, seed=0)
    # the prefill's clusters: layer 1's keys [sink, position - window) assigned to the index's clusters
    registry.set_state(index_file, 1, build_clusters(registry.get_index(index_file), 1, inputs[4], position, 1, 8))
    names = step.cache_names()
    options = dict(saap=index_file, saap_probes=2, saap_sink=1, saap_window=8, force_plan="saap")
    path = tmp_path / "smollm2_saap.onnx"
    report = export_onnx(step, inputs, path, input_names=["input_ids", "cache_position", *names], **options)
    assert [s.rewritten and s.chosen.kind for s in report.sites] == [False, "saap"]
    assert report.sites[1].exported_as == "attnopt:saap_decode_attention_mlp (function body)"
    model_proto, ops = ops_of(path)
    assert ("attnopt", "saap_decode_attention_mlp") in ops and ("", "Attention") in ops
    gm, _ = rewrite_for_export(step, inputs, {}, OptimizeConfig(**options))
    clusters = saap_cluster_inputs(report, max_len)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feed_names = [i.name for i in session.get_inputs()]
    assert feed_names == ["input_ids", "cache_position", *names, "saap_clusters_1"]
    for _ in range(2):
        got = session.run(None, {**{n: t.numpy() for n, t in zip(feed_names, inputs)}, **clusters})
        with torch.no_grad():
            want = gm(*[t.clone() for t in inputs])
            dense = step(*[t.clone() for t in inputs])
        for g_, w in zip(got, want):
            close(g_, w)
        assert (got[0] - dense[0].numpy()).__abs__().max() > 1e-4
        token = torch.from_numpy(got[0][:, -1]).argmax(-1, keepdim=True)
        assert torch.equal(token, want[0][:, -1].argmax(-1, keepdim=True))
        inputs = (token, inputs[1] + 1, *want[1:])


def test_saap_clusters_from_the_exported_assignment_graph(tmp_path, fresh_registry):
    """A deployment without PyTorch: ``export_saap_clusters``'s graph makes, from the cache's keys, exactly the
    clusters the runtime builds at prefill (for any prompt length, one shorter than sink + window too), and the
    decode graph fed them computes what the op computes."""
    from attnopt.export_saap import export_saap_clusters

    path = saap_index(tmp_path, mlp=False)
    q, k, v, lengths = decode_case(seed=6)
    assign = tmp_path / "assign.onnx"
    assert export_saap_clusters(path, assign, batch=2, max_cache_len=96, sink=4, window=16) == ["saap_clusters_1"]
    index = registry.get_index(path)
    for prompt_len in (96, 10, 80):
        (clusters,) = run_ort(assign, {"prompt_len": np.array(prompt_len), "keys_1": k})
        want = build_clusters(index, 1, k, prompt_len, sink=4, window=16)
        np.testing.assert_array_equal(clusters, want.cluster_of_positions(96).numpy())
    registry.set_state(path, 1, want)  # the last prompt: 80 keys
    plan = SaapPlan(index=path, probes=2, sink=4, window=16, layer=1)
    decode = tmp_path / "decode.onnx"
    export_onnx(attention_fn(plan.runtime_key()), (q, k, v, lengths), decode)
    (got,) = run_ort(decode, {"q": q, "k": k, "v": v, "lengths": lengths, "saap_clusters_1": clusters})
    close(got, attention_fn(plan.runtime_key())(q, k, v, lengths))
    with pytest.raises(ValueError, match=r"layers \[0\] are not in the SAAP index"):
        export_saap_clusters(path, assign, batch=2, max_cache_len=96, sink=4, window=16, layers=[0])


def test_saap_node_ranks_clusters_as_the_kernel_and_reference_do():
    """The SAAP function body's selection in onnxruntime: the group scores cut as the kernel's 16-bit keys cut them
    (the same order over zeros, fp32 subnormals, powers of two and one-ulp neighbours), and TopK's ties broken by the
    lowest index, so that it picks exactly ``top_clusters``' set."""
    import onnx.parser

    from attnopt.onnx_functions import _SAAP_CUT
    from attnopt.runtime.saap.decode import selection_keys, top_clusters

    text = ('<ir_version: 10, opset_import: ["" : 24]>\ncut (float[N] s_scores, int64[1] k) => (float[N] s_rank, '
            'int64[M] top) {' + _SAAP_CUT + '    v, top = TopK <axis = -1, largest = 1, sorted = 1> (s_rank, k)\n}')
    model = onnx.parser.parse_model(text)
    onnx.checker.check_model(model)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    g = torch.Generator().manual_seed(0)
    near = torch.randint(0x3F00, 0x3F90, (500,), generator=g, dtype=torch.int32) << 16  # bf16 values near 0.5-1.1
    near = (near | torch.randint(0, 3, (500,), generator=g, dtype=torch.int32)).view(torch.float32)  # many ties
    special = torch.tensor([0.0, 1e-40, 3e-39, 2.0 ** -126, 2.0 ** -20, 0.99999994, 1.0, 2.0, 3.99])
    x = torch.cat([torch.rand(2000, generator=g) ** 8, special, near])
    rank, top = session.run(None, {"s_scores": x.numpy(), "k": np.array([700])})
    rank, keys = torch.from_numpy(rank), selection_keys(x)
    assert torch.equal(rank[:, None] < rank[None, :], keys[:, None] < keys[None, :])
    assert top.tolist() == top_clusters(x, 700).tolist()


def test_saap_node_follows_the_rules_key_width(monkeypatch):
    """The SAAP function body cuts the scores only for the rule's 16-bit keys; at 32 bits it ranks them as they are."""
    import attnopt.runtime.kernels.saap_rule as rule
    from attnopt.onnx_functions import function_proto

    def ops(name):
        return [n.op_type for n in function_proto(name, 24).node]

    assert rule.SELECT_KEY_BITS == 16 and "Floor" in ops("saap_decode_attention")
    monkeypatch.setattr(rule, "SELECT_KEY_BITS", 32)
    assert "Floor" not in ops("saap_decode_attention") and "Floor" not in ops("saap_decode_attention_mlp")
    assert "Identity" in ops("saap_decode_attention")
