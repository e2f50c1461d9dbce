"""A 30-layer model decodes through ``attnopt.optimize`` inside CUDA graphs (GPU only).

Regression test of issue 16: ``optimize(model, mode="reduce-overhead")`` failed on the first recording of
inductor's CUDA-graph trees for SmolLM2's shape (30 layers), because the split-KV workspace made at the op's first
call (during the trees' warm-up) landed in the graph's memory pool ("tensor(s) in the cudagraph pool not tracked as
outputs"); an independent run saw a segfault at the same point. Many layers are needed: one layer did not show it.

The model is SmolLM2-135M's shape with random weights, in fp32 so that greedy tokens must be identical to the
original's: HF ``generate()`` over a static and a dynamic cache, and forward steps over a static cache, with
``mode="reduce-overhead"`` and ``inner_backend="cudagraphs"``.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import attnopt  # noqa: E402
from attnopt.bench.e2e import build_model, make_cache, prefill  # noqa: E402

PROMPT_TOKENS = 700
STEPS = 12
OPTIONS = {"reduce-overhead": {"mode": "reduce-overhead"},  # attnopt's whole-step graphs (attnopt.step_graphs)
           "graph-trees": {"mode": "reduce-overhead", "step_graphs": False},  # inductor's CUDA-graph trees
           "cudagraphs": {"inner_backend": "cudagraphs"}}


@pytest.fixture(scope="module")
def model():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    m, _ = build_model("smollm2-135m", layers=None, dtype=torch.float32, device="cuda", max_positions=4096)
    assert m.config.num_hidden_layers == 30
    return m


def _ids(model, tokens=PROMPT_TOKENS):
    g = torch.Generator(device="cuda").manual_seed(3)
    return torch.randint(0, model.config.vocab_size, (1, tokens), device="cuda", generator=g)


@torch.no_grad()
def _steps(forward, model, ids, graphs: bool) -> list[int]:
    cache = make_cache(model, "static", ids.shape[1] + STEPS + 8)
    tok = prefill(model, cache, ids, chunk=512)
    tokens = [int(tok)]
    for _ in range(STEPS):
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        tok = forward(input_ids=tok, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        tokens.append(int(tok))
    return tokens


@pytest.mark.cuda
@pytest.mark.parametrize("route", list(OPTIONS))
def test_forward_steps_in_cuda_graphs_match_the_original(model, route):
    ids = _ids(model)
    expected = _steps(model.forward, model, ids, graphs=False)
    opt = attnopt.optimize(model, **OPTIONS[route])
    assert _steps(opt.forward, model, ids, graphs=True) == expected
    report = attnopt.last_plans(opt)
    assert len(report.rewritten) == 30, report.headline()
    assert report.calls_without_attnopt == 0
    if route == "reduce-overhead":  # two warm compiled steps, then each step is one replay
        assert opt._attnopt_step_graphs.replays == STEPS - 2


@pytest.mark.cuda
@pytest.mark.parametrize("prompt", [1, 7])
def test_short_prompts_over_a_static_cache_in_step_graphs(model, prompt):
    """A 7-token prompt over a static cache crashed inductor's CUDA-graph trees (a segfault in its static launcher
    while recording; HF's own compiled forward crashes the same way, torch 2.11) and, with graph partitioning off,
    attnopt's op returned strides its fake did not declare. The prompt (<= max_decode_q_len tokens) runs the
    compiled forward; the decode steps replay attnopt's whole-step graphs."""
    ids = _ids(model, prompt)
    expected = _steps(model.forward, model, ids, graphs=False)
    opt = attnopt.optimize(model, mode="reduce-overhead")
    assert _steps(opt.forward, model, ids, graphs=False) == expected
    kw = dict(max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False, cache_implementation="static")
    assert torch.equal(opt.generate(ids, **kw), model.generate(ids, disable_compile=True, **kw))
    assert opt._attnopt_step_graphs.replays > 0
    assert attnopt.last_plans(opt).calls_without_attnopt == 0


@pytest.mark.cuda
@pytest.mark.parametrize("cache", ["static", "dynamic"])
def test_generate_reduce_overhead_matches_the_original(model, cache):
    ids = _ids(model)
    kw = dict(max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False, cache_implementation=cache)
    expected = model.generate(ids, disable_compile=True, **kw)
    opt = attnopt.optimize(model, mode="reduce-overhead")
    for _ in range(2):  # the second call replays the recorded graphs
        assert torch.equal(opt.generate(ids, **kw), expected)
    report = attnopt.last_plans(opt)
    assert report.rewritten and report.calls_without_attnopt == 0, report.headline()
    assert (opt._attnopt_step_graphs.replays > 0) == (cache == "static")
