"""The ``saap`` plan kind: opt-in planning, the op's run against the SAAP reference (and dense when every cluster
is probed), the kernel path in the interpreter, the config fields, and ``attnopt.optimize`` end to end."""
import dataclasses
import math

import pytest
import torch

pytest.importorskip("safetensors")

from attnopt import AttentionSite, OptimizeConfig  # noqa: E402
from attnopt.hardware import builtin_profile  # noqa: E402
from attnopt.plan import SaapPlan  # noqa: E402
from attnopt.runtime.reference import attention_states  # noqa: E402
from attnopt.runtime.saap import build_clusters, saap_decode  # noqa: E402
from attnopt.runtime.saap import registry  # noqa: E402
from attnopt.runtime.saap.index import SaapIndexError, synthetic_index  # noqa: E402
from attnopt.runtime.strategies import STRATEGIES, PlanContext  # noqa: E402

SAAP = STRATEGIES["saap"]


@pytest.fixture
def index_path(tmp_path):
    registry.reset()
    path = tmp_path / "idx.safetensors"
    synthetic_index(6, 2, 64, clusters=8, layers=(1, 2), num_layers=3).save(path)
    yield str(path)
    registry.reset()


@pytest.fixture
def refined_path(tmp_path):
    """An index whose centroids are refined over each prompt at prefill (``SaapIndex.refine``)."""
    registry.reset()
    path = tmp_path / "refined.safetensors"
    index = synthetic_index(6, 2, 64, clusters=8, layers=(1, 2), num_layers=3)
    dataclasses.replace(index, refine=2).save(path)
    yield str(path)
    registry.reset()


def _ctx(path, probes=3, sink=1, window=8, device="cpu"):
    return PlanContext(device_type=device, extras={"saap": {"index": path, "probes": probes, "sink": sink,
                                                            "window": window}})


def _site(layer=1, **kw):
    return AttentionSite.canonical(module_path=f"model.layers.{layer}.self_attn", q_heads=6, kv_heads=2, head_dim=64,
                                   kv_len=300, dtype="float32", **kw)


def test_never_planned_without_the_index_and_layer_zero_stays_dense(index_path):
    hw = builtin_profile("cpu")
    assert "opt-in" in SAAP.check(_site(), hw, PlanContext())
    assert "layer 0" in SAAP.check(_site(layer=0), hw, _ctx(index_path))
    assert SAAP.check(_site(), hw, _ctx(index_path)) is None
    assert "mask 'arbitrary'" in SAAP.check(_site(mask_kind="arbitrary"), hw, _ctx(index_path))
    with pytest.raises(SaapIndexError, match="idx.safetensors is for 6 query / 2 KV heads"):
        SAAP.check(dataclasses.replace(_site(), q_heads=8), hw, _ctx(index_path))
    plan = next(iter(SAAP.candidates(_site(layer=2), hw, _ctx(index_path))))
    assert (plan.layer, plan.probes, plan.window, plan.index) == (2, 3, 8, index_path)
    assert SAAP.estimate_us(plan, _site(layer=2), hw, _ctx(index_path)) > 0


def test_centroid_scoring_selects_in_its_scoring_launch_and_the_mlp_does_not(tmp_path, index_path):
    # the plan's fused_select and pdl as the H100 measured them: faster with centroid scoring (fused: far slower
    # with the MLP; its chained launches are unmeasured)
    from attnopt.runtime.saap.index import LayerIndex

    hw = builtin_profile("cpu")
    plan = next(iter(SAAP.candidates(_site(), hw, _ctx(index_path))))
    assert plan.fused_select and plan.pdl
    # `attnopt bench saap` times this plan first by default (its verdict is what the planner gives a user)
    from attnopt.bench.saap_options import FUSE_CHOICES, PLANNED_FUSE
    assert FUSE_CHOICES[PLANNED_FUSE][0] == (plan.fused_select, plan.fused_merge)
    index = synthetic_index(6, 2, 64, clusters=8, layers=(1,), num_layers=3)
    g = torch.Generator().manual_seed(0)
    mlp = {"w1": torch.randn(2, 16, 64, generator=g), "b1": torch.zeros(2, 16), "bn_mean": torch.zeros(2, 16),
           "bn_var": torch.ones(2, 16), "bn_weight": torch.ones(2, 16), "bn_bias": torch.zeros(2, 16),
           "w2": torch.randn(2, 8, 16, generator=g), "b2": torch.zeros(2, 8)}
    index.layers[1] = LayerIndex(index.layers[1].centroids, mlp)
    path = str(tmp_path / "mlp.safetensors")
    index.save(path)
    plans = list(SAAP.candidates(_site(), hw, _ctx(path)))
    # no candidate of an MLP-scored index fuses the selection (the H100's slow path: 131.5 µs against 74.1 apart)
    assert plans and all(not p.fused_select and not p.pdl for p in plans)


def test_config_fields_validate_early(tmp_path, index_path):
    cfg = OptimizeConfig(saap=index_path, saap_probes=4, saap_window=16, saap_sink=2)
    assert OptimizeConfig.from_json(cfg.to_json()) == cfg
    with pytest.raises(ValueError, match="plan kind 'saap' needs an index"):
        OptimizeConfig(force_plan="saap")
    with pytest.raises(ValueError, match="no such index file"):
        OptimizeConfig(saap=str(tmp_path / "missing.safetensors"))
    with pytest.raises(ValueError, match="saap_probes must be >= 1"):
        OptimizeConfig(saap=index_path, saap_probes=0)
    with pytest.raises(TypeError, match="saap_window must be an int >= 0"):
        OptimizeConfig(saap=index_path, saap_window="64")


def test_unset_probes_sink_and_window_come_from_the_index(tmp_path, index_path):
    from attnopt.passes import saap_options

    # an index of before the recommendation: the paper's l = 32, sink 1, window 2047
    assert saap_options(OptimizeConfig(saap=index_path)) == {"index": index_path, "probes": 32, "sink": 1,
                                                            "window": 2047}
    path = str(tmp_path / "recommends.safetensors")
    index = synthetic_index(6, 2, 64, clusters=2048, layers=(1,), num_layers=2)
    index.train_info["decode"] = {"probes": 143, "sink": 4, "window": 64}  # what train_index stores at 8k
    index.save(path)
    assert saap_options(OptimizeConfig(saap=path)) == {"index": path, "probes": 143, "sink": 4, "window": 64}
    assert saap_options(OptimizeConfig(saap=path, saap_probes=7, saap_sink=0)) == {
        "index": path, "probes": 7, "sink": 0, "window": 64}
    cache = registry.saap_cache(path)
    assert (cache.saap_sink, cache.saap_window) == (4, 64)
    assert (registry.saap_cache(path, sink=2, window=9).saap_window) == 9


def _run(index_path, probes, q, k, v, prompt, valid_len=None, layer=1, **plan_fields):
    plan = SaapPlan(index=index_path, probes=probes, sink=1, window=8, layer=layer, num_splits=3, block_n=16,
                    **plan_fields)
    index = registry.get_index(index_path)
    n = k.shape[2] if valid_len is None else int(valid_len[0])
    registry.set_state(index_path, layer, build_clusters(index, layer, k[:, :, :n], prompt, 1, 8))
    state = SAAP.prepare(plan, q, k, v)
    return plan, SAAP.run(state, plan, q, k, v, None, valid_len, 0.125, False)


@pytest.mark.parametrize("probes", [2, 8])
def test_run_is_the_saap_reference_and_dense_with_every_cluster(index_path, probes):
    q, k, v = torch.randn(2, 6, 1, 64), torch.randn(2, 2, 120, 64), torch.randn(2, 2, 120, 64)
    plan, out = _run(index_path, probes, q, k, v, prompt=115)
    index = registry.get_index(index_path)
    want, _, sel = saap_decode(index, 1, registry.get_state(index_path, 1), q, k, v, probes, 0.125)
    torch.testing.assert_close(out, want)
    if probes == 8:
        torch.testing.assert_close(out, attention_states(q, k, v, scale=0.125)[0], atol=1e-5, rtol=1e-5)
    measured, calls = registry.measured_selectivity(plan.runtime_key())
    assert calls == 1 and math.isclose(measured, float(sel), rel_tol=1e-5)
    assert "selectivity" in plan.runtime_note()


def test_refined_centroids_are_what_the_op_scores_with_and_a_new_prefill_reuses_their_buffer(refined_path):
    torch.manual_seed(5)
    q, k, v = torch.randn(1, 6, 1, 64), torch.randn(1, 2, 120, 64), torch.randn(1, 2, 120, 64)
    _, out = _run(refined_path, 2, q, k, v, prompt=115)
    index, st = registry.get_index(refined_path), registry.get_state(refined_path, 1)
    assert st.centroids is not None and not torch.equal(st.centroids, index.layers[1].centroids)
    want, _, _ = saap_decode(index, 1, st, q, k, v, 2, 0.125)
    torch.testing.assert_close(out, want)
    buffer = st.centroids
    _run(refined_path, 2, q, k * 2, v, prompt=115)  # the next prompt: same shapes, the same buffer, new values
    again = registry.get_state(refined_path, 1)
    assert again.centroids is buffer and not torch.equal(buffer, want)


@pytest.mark.parametrize("which", ["index_path", "refined_path"])
def test_kernel_path_in_the_interpreter_matches_the_reference_path(which, request, monkeypatch):
    index_path = request.getfixturevalue(which)
    pytest.importorskip("triton")
    from attnopt.runtime.kernels import triton_usable

    if not triton_usable("cpu"):
        pytest.skip("the Triton interpreter is not on")
    q, k, v = torch.randn(1, 6, 1, 64), torch.randn(1, 2, 90, 64), torch.randn(1, 2, 90, 64)
    vl = torch.tensor([80])
    _, ref = _run(index_path, 3, q, k, v, prompt=70, valid_len=vl)
    monkeypatch.setenv("ATTNOPT_CPU_KERNELS", "interpret")
    _, out = _run(index_path, 3, q, k, v, prompt=70, valid_len=vl)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("window_splits", [0, 2])
def test_plan_window_splits_reach_the_kernel(index_path, monkeypatch, window_splits):
    # 0: the rule (in proportion to the keys: 1 of 3 splits here); a count: that many, same output as the reference
    pytest.importorskip("triton")
    from attnopt.runtime.kernels import saap as kernels, triton_usable

    if not triton_usable("cpu"):
        pytest.skip("the Triton interpreter is not on")
    q, k, v = torch.randn(1, 6, 1, 64), torch.randn(1, 2, 90, 64), torch.randn(1, 2, 90, 64)
    _, ref = _run(index_path, 3, q, k, v, prompt=70)
    monkeypatch.setenv("ATTNOPT_CPU_KERNELS", "interpret")
    given = []
    launch = kernels.saap_decode_kernel
    monkeypatch.setattr(kernels, "saap_decode_kernel", lambda *a, **kw: given.append(kw["window_splits"]) or launch(
        *a, **kw))
    _, out = _run(index_path, 3, q, k, v, prompt=70, window_splits=window_splits)
    assert given == [window_splits or 1]  # the rule: 9 always-attended keys against 3 clusters of about 5
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("fused,window_stream,late,warps,stages", [
    (False, False, False, 0, 2), (True, False, False, 0, 3), (False, True, False, 0, 2), (False, True, True, 0, 2),
    (True, True, True, 0, 2), (False, False, False, 8, 2), (True, False, False, 8, 2)])
def test_kernel_path_is_four_launches_and_no_torch_op_but_the_output(index_path, monkeypatch, fused, window_stream,
                                                                      late, warps, stages):
    """The run of a prepared plan: scoring, selection, attention and merge launches (fused: scoring with the selection,
    attention with the merge; window_stream: the window's attention launch apart, first, or after the scoring when
    ``late`` and not fused), the output's allocation, and nothing else (before, scoring and statistics were some 40 small torch launches); the selectivity counter
    still counts the call."""
    pytest.importorskip("triton")
    from torch.utils._python_dispatch import TorchDispatchMode

    from attnopt.runtime.kernels import triton_usable
    from attnopt.runtime.kernels.launch import KernelLauncher

    if not triton_usable("cpu"):
        pytest.skip("the Triton interpreter is not on")
    monkeypatch.setenv("ATTNOPT_CPU_KERNELS", "interpret")
    q, k, v = torch.randn(1, 6, 1, 64), torch.randn(1, 2, 90, 64), torch.randn(1, 2, 90, 64)
    plan = SaapPlan(index=index_path, probes=3, sink=1, window=8, layer=1, num_splits=3, block_n=16,
                    fused_select=fused, fused_merge=fused, window_stream=window_stream, window_after_scoring=late,
                    select_warps=warps, num_stages=stages)
    registry.set_state(index_path, 1, build_clusters(registry.get_index(index_path), 1, k, 85, 1, 8))
    state = SAAP.prepare(plan, q, k, v)
    launches, ops, widths, depths = [], [], {}, {}
    original = KernelLauncher.__call__

    def counting(self, grid, *args, **kwargs):
        launches.append(self.fn.__name__)
        widths[self.fn.__name__] = kwargs.get("num_warps")
        depths[self.fn.__name__] = kwargs.get("num_stages")
        with _Paused(recorder):
            return original(self, grid, *args, **kwargs)

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(str(func))
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(KernelLauncher, "__call__", counting)
    recorder = Recorder()
    with recorder:
        SAAP.run(state, plan, q, k, v, None, None, 0.125, False)
    want = ["_saap_rows_kernel", "_saap_kernel"] if fused else ["_saap_rows_kernel", "_saap_select_kernel",
                                                               "_saap_kernel", "_merge_states_kernel"]
    if window_stream:  # the window's launch before the selection's (fused: before the scoring, which selects)
        at = 1 if late and not fused else 0
        want = want[:at] + ["_saap_kernel"] + want[at:]
    assert launches == want, launches
    if warps:  # the plan's selection width reaches the launch that selects
        assert widths["_saap_rows_kernel" if fused else "_saap_select_kernel"] == warps, widths
    assert depths["_saap_kernel"] == stages, depths  # the plan's pipeline depth reaches the attention launch
    views = (".view.", ".select.")  # views (the LSE planes of the partials among them) launch nothing
    assert [op for op in ops if not any(v in op for v in views)] == ["aten.empty.memory_format"], ops
    assert registry.measured_selectivity(plan.runtime_key())[1] == 1


class _Paused:
    """Leave a dispatch mode for the duration (the interpreter's own tensor work inside a launch is not the op's)."""

    def __init__(self, mode):
        self.mode = mode

    def __enter__(self):
        from torch.utils._python_dispatch import _pop_mode_temporarily

        self._ctx = _pop_mode_temporarily()
        self._ctx.__enter__()

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)


def test_run_without_clusters_says_how_to_build_them(index_path):
    plan = SaapPlan(index=index_path, probes=2, sink=1, window=8, layer=2)
    q, k, v = torch.randn(1, 6, 1, 64), torch.randn(1, 2, 40, 64), torch.randn(1, 2, 40, 64)
    with pytest.raises(RuntimeError, match="no clusters were built .*saap_cache"):
        SAAP.run(SAAP.prepare(plan, q, k, v), plan, q, k, v, None, None, 0.125, False)


@pytest.mark.parametrize("static", [False, True])
def test_optimize_with_saap_on_a_tiny_llama(tmp_path, static, saap_tiny_llama):
    """attnopt.optimize(saap=...) plans saap at layers >= 1; greedy decoding with every cluster probed equals dense;
    with few clusters the logits equal the eager SAAP harness (same sparse sets); the table shows the selectivity."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("faiss")
    import attnopt
    from attnopt.runtime.saap.collect import collect, custom_attention
    from attnopt.runtime.saap.evaluate import Harness, Setting
    from attnopt.runtime.saap.train import train_index

    registry.reset()
    model = saap_tiny_llama
    coll = collect(model, [torch.randint(0, 97, (256,))], queries_per_sequence=32, min_query_position=64)
    path = tmp_path / "tiny.safetensors"
    train_index(coll, clusters=8, hidden=16, steps=10, batch=32, window=8, kmeans_iterations=3).save(path)
    prompt = torch.randint(0, 97, (1, 120))
    cache_kw = {"static": True, "max_cache_len": 140} if static else {}  # a static cache: a valid-length mask

    def greedy(m, cache, steps=4):
        out = m(input_ids=prompt, past_key_values=cache, use_cache=True)
        ids, logits = [], []
        for _ in range(steps):
            logits.append(out.logits[0, -1].float())
            ids.append(int(out.logits[0, -1].argmax()))
            out = m(input_ids=torch.tensor([[ids[-1]]]), past_key_values=cache, use_cache=True)
        return ids, torch.stack(logits)

    with torch.no_grad():
        dense_ids, dense_logits = greedy(model, transformers.DynamicCache())
        full = attnopt.optimize(model, saap=str(path), saap_probes=8, saap_window=8, saap_sink=1, force_plan="saap",
                                inner_backend="eager")
        ids, logits = greedy(full, registry.saap_cache(path, sink=1, window=8, config=model.config, **cache_kw))
        assert ids == dense_ids
        torch.testing.assert_close(logits, dense_logits, atol=1e-4, rtol=1e-4)
        report = attnopt.last_plans(full)
        saap_sites = [s for s in report.sites if s.chosen is not None and s.chosen.kind == "saap"]
        assert {s.chosen.layer for s in saap_sites} == {1, 2}  # every decode graph (static, then symbolic length)
        assert "selectivity 100.0%" in report.format_table(width=250)

        sparse = attnopt.optimize(model, saap=str(path), saap_probes=2, saap_window=8, saap_sink=1,
                                  force_plan="saap", inner_backend="eager")
        _, sparse_logits = greedy(sparse, registry.saap_cache(path, sink=1, window=8, config=model.config,
                                                              **cache_kw))
        harness = Harness(model, registry.get_index(path))
        with custom_attention(model, "attnopt_saap_test_e2e", harness):
            harness.use(Setting("mlp", 0.0, sink=1, window=8, probes=2), prompt_len=120)
            _, want = greedy(model, transformers.DynamicCache())
        torch.testing.assert_close(sparse_logits, want, atol=1e-4, rtol=1e-4)
        assert not torch.allclose(sparse_logits, dense_logits, atol=1e-3)
    registry.reset()


def test_split_count_leaves_each_heads_selection_program_room_in_the_one_wave():
    """llama3-8b at 128k and 5 % on an H100: PROGRAMS_PER_SM programs an SM, less the room of one selection program a
    head (resident beside the attention while it starts), so every attention program is resident in one wave."""
    from attnopt.hardware import builtin_profile
    from attnopt.runtime.strategies.saap import PROGRAMS_PER_SM, SELECT_PROGRAM_ROOM, split_count
    from attnopt.site import AttentionSite

    h100 = builtin_profile("h100-sxm")
    site = AttentionSite(node="n", module_path="model.layers.1.self_attn", pattern="sdpa", batch=1, q_heads=32,
                         kv_heads=8, head_dim=128, q_len=1, kv_len=131072, dtype="bfloat16", gqa_source="enable_gqa")
    splits = split_count(site, h100, 77, 1, 1638, 2048)
    assert splits == 64
    assert 8 * (splits + SELECT_PROGRAM_ROOM) <= PROGRAMS_PER_SM * h100.sm_count
