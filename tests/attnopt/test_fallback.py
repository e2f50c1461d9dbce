"""No silent fallback to eager: many optimized models in one process keep running attnopt's graphs, and a call that
ran without them is counted in ``last_plans`` and reported once."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import attnopt
from attnopt.api import FallbackWarning


class TinyAttention(torch.nn.Module):
    """One decode attention over a KV cache passed in: (1, 4, 1, 64) queries against (1, 2, N, 64) keys."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(64, 64)

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(self.proj(q), k, v, enable_gqa=True)


def _qkv(n=40):
    return torch.randn(1, 4, 1, 64), torch.randn(1, 2, n, 64), torch.randn(1, 2, n, 64)


@torch.no_grad()
def test_many_models_of_one_class_all_run_attnopt():
    """Dynamo counts recompilations per code object, and every model of a class shares ``forward``: the ninth
    optimized model used to run eagerly, silently (recompile_limit is 8)."""
    q, k, v = _qkv()
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        for _ in range(12):
            model = TinyAttention()
            opt = attnopt.optimize(model, inner_backend="eager")
            torch.testing.assert_close(opt(q, k, v), model(q, k, v), atol=1e-5, rtol=1e-5)
            report = attnopt.last_plans(opt)
            assert report.calls_without_attnopt == 0
            assert [s.calls for s in report.rewritten] == [1]


@torch.no_grad()
def test_many_shapes_of_one_model_keep_running_attnopt():
    model = TinyAttention()
    opt = attnopt.optimize(model, inner_backend="eager")
    for n in range(33, 45):
        q, k, v = _qkv(n)
        torch.testing.assert_close(opt(q, k, v), model(q, k, v), atol=1e-5, rtol=1e-5)
    assert attnopt.last_plans(opt).calls_without_attnopt == 0


@torch.no_grad()
@torch._dynamo.config.patch(recompile_limit=1, automatic_dynamic_shapes=False)
def test_eager_fallback_is_counted_and_warned_once():
    model = TinyAttention()
    opt = attnopt.optimize(model, inner_backend="eager")
    opt(*_qkv(40))
    with pytest.warns(FallbackWarning, match="ran without attnopt"):
        opt(*_qkv(41))  # a second static shape: over the limit, dynamo runs the frame eagerly
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)  # once: the third fallback call does not warn again
        out = opt(*_qkv(42))
    assert out.shape == (1, 4, 1, 64)
    report = attnopt.last_plans(opt)
    assert report.calls_without_attnopt == 2
    assert "2 call(s) ran WITHOUT attnopt" in report.headline()
    assert attnopt.last_plans(opt).to_dict()["calls_without_attnopt"] == 2


@torch.no_grad()
@torch._dynamo.config.patch(recompile_limit=1, automatic_dynamic_shapes=False)
def test_optimized_function_counts_fallback_too():
    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    opt = attnopt.optimize(attend, inner_backend="eager")
    opt(*_qkv(40))
    with pytest.warns(FallbackWarning):
        opt(*_qkv(41))
    assert attnopt.last_plans(opt).calls_without_attnopt == 1


@torch.no_grad()
def test_hf_prefill_runs_eagerly_and_leaves_the_static_cache_marked():
    """A prefill through an optimized HF model runs the model's own forward: the StaticCache allocates its tensors
    outside any compiled region and marks them static (CUDA graphs need that); decode steps run attnopt."""
    from transformers import StaticCache

    from attnopt.bench.e2e import build_model

    model, _ = build_model("tiny", layers=None, dtype=torch.float32, device="cpu", max_positions=256)
    opt = attnopt.optimize(model, inner_backend="eager")
    ids = torch.randint(0, model.config.vocab_size, (1, 40))
    cache = StaticCache(config=model.config, max_cache_len=64)
    ref_cache = StaticCache(config=model.config, max_cache_len=64)
    out = opt(input_ids=ids, past_key_values=cache, use_cache=True)
    ref = model(input_ids=ids, past_key_values=ref_cache, use_cache=True)
    torch.testing.assert_close(out.logits, ref.logits)
    assert hasattr(cache.layers[0].keys, "_dynamo_static_input_type")  # marked by HF's eager lazy initialization
    assert not attnopt.last_plans(opt).sites  # nothing compiled for the prefill
    tok = out.logits[:, -1:].argmax(-1)
    for _ in range(3):
        out = opt(input_ids=tok, past_key_values=cache, use_cache=True)
        ref = model(input_ids=tok, past_key_values=ref_cache, use_cache=True)
        torch.testing.assert_close(out.logits, ref.logits, atol=1e-5, rtol=1e-5)
        tok = out.logits[:, -1:].argmax(-1)
    report = attnopt.last_plans(opt)
    assert len(report.rewritten) == model.config.num_hidden_layers
    assert report.calls_without_attnopt == 0
    tokens = opt.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False, cache_implementation="static")
    assert torch.equal(tokens, model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                                              cache_implementation="static"))


@torch.no_grad()
@pytest.mark.parametrize("cache", ["static", "dynamic"])
def test_reduce_overhead_runs_growing_caches_without_cuda_graphs(monkeypatch, cache, inner_compiles):
    """With mode="reduce-overhead" and inductor's CUDA-graph trees (step_graphs=False), decode calls over a
    DynamicCache (its tensors grow by concatenation, so CUDA-graph replays would overwrite them: inductor raises on
    the H100) compile without CUDA graphs; static caches keep them. With attnopt's step graphs (the default), what
    they do not record (here on the CPU: everything) runs the same trees-compiled forward; the steps they record run
    a forward compiled without CUDA graphs (tests/attnopt/test_step_graphs.py, tests/models/test_cuda_graphs.py).
    Every route runs attnopt's rewritten graphs and gives the original's tokens."""
    import attnopt.passes as passes_module
    from attnopt.bench.e2e import build_model

    graphed = []  # what the planner is told: plans replayed in CUDA graphs, or launched from the host
    make_context = passes_module.make_context

    def recording_context(*args, **kwargs):
        graphed.append(kwargs["graphed"])
        return make_context(*args, **kwargs)

    monkeypatch.setattr(passes_module, "make_context", recording_context)
    model, _ = build_model("tiny", layers=None, dtype=torch.float32, device="cpu", max_positions=256)
    ids = torch.randint(0, model.config.vocab_size, (1, 24))
    kw = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False, cache_implementation=cache)
    for step_graphs in (True, False):  # on the CPU nothing is recorded: both routes compile as the trees do
        inner_compiles.clear()
        graphed.clear()
        opt = attnopt.optimize(model, inner_backend="eager", mode="reduce-overhead", step_graphs=step_graphs)
        assert torch.equal(opt.generate(ids, **kw), model.generate(ids, **kw))
        modes = {compiled.mode for compiled in inner_compiles}
        assert modes == {None if cache == "dynamic" else "reduce-overhead"}
        # growing caches run without CUDA graphs, and their plans are chosen knowing it; with the eager inner backend
        # the trees do not replay graphs either (on a GPU, step graphs' own compile is told graphed=True)
        assert set(graphed) == {False}
    backend = opt._attnopt_backend  # the first call's parts attnopt owns, which bench e2e reports
    assert backend.pass_seconds > 0 and backend.inner_compile_seconds > 0
    report = attnopt.last_plans(opt)
    assert len(report.rewritten) >= model.config.num_hidden_layers and report.calls_without_attnopt == 0


def test_hf_forward_routes_each_call_by_its_cache_and_counts_uncompiled_decode_calls():
    """The one wrapper around an optimized HF model's forward: prefill to the model's own forward, decode over a
    growing cache to the graphs without CUDA graphs, other decode calls to the CUDA-graph ones. The route is
    remembered per cache object, so a new cache (a new ``generate()`` call) is routed afresh."""
    from attnopt.api import _hf_forward
    from attnopt.backend import Backend

    class Cache:
        def __init__(self, compileable):
            self.is_compileable = compileable

    backend, calls = Backend(), []

    def graph(name, runs_graph=True):
        def fn(*args, **kwargs):
            calls.append(name)
            backend.graph_calls += runs_graph
            return name
        return fn

    fwd = _hf_forward(graph("graphed"), graph("original", runs_graph=False), 4, backend, growing_cache=graph("grows"))
    static, dynamic = Cache(True), Cache(False)
    one, prompt = torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 9, dtype=torch.long)
    assert fwd(input_ids=prompt, past_key_values=dynamic) == "original"  # a prefill: not counted as a fallback
    assert [fwd(input_ids=one, past_key_values=c) for c in (dynamic, dynamic, static, static, dynamic)] == \
        ["grows", "grows", "graphed", "graphed", "grows"]
    assert fwd(one, past_key_values=Cache(True)) == "graphed"  # input_ids given positionally
    assert fwd(inputs_embeds=torch.zeros(1, 9, 8), past_key_values=static) == "original"
    assert fwd(inputs_embeds=torch.zeros(1, 1, 8), past_key_values=None) == "graphed"
    assert backend.uncompiled_calls == 0
    eager = _hf_forward(graph("eager", runs_graph=False), graph("original"), 4, backend)
    with pytest.warns(FallbackWarning, match="ran without attnopt"):
        eager(input_ids=one, past_key_values=dynamic)
    eager(input_ids=one, past_key_values=static)
    assert backend.uncompiled_calls == 2
