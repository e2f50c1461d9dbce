"""``attnopt.SharedPrefixCache`` with a tiny random-init Hugging Face Llama: parallel sampling and beam search from
one prompt keep the prompt once, and through ``attnopt.optimize`` every decode site becomes the cascade, with
tokens identical to the original model's (greedy and fixed-seed sampling)."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import attnopt  # noqa: E402
from attnopt.runtime.ops import CALL_COUNTS  # noqa: E402

VOCAB = 128
ROWS = 4
NEW_TOKENS = 6


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _model(attn: str = "sdpa"):
    torch.manual_seed(0)
    # head_dim 64: a head dim the kernels take (the cascade's check is the kernels')
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                      max_position_embeddings=1024, attn_implementation=attn, pad_token_id=0,
                                      bos_token_id=1, eos_token_id=2)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.generation_config.eos_token_id = None  # never stop early: every row decodes NEW_TOKENS tokens
    model.generation_config.pad_token_id = 0
    return model


def _prompt(length: int = 24) -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, length), generator=torch.Generator().manual_seed(1))


def _generate(model, ids, cache=None, seed=None, **kw):
    """ROWS rows from one prompt: ``num_return_sequences`` when sampling, else ROWS copies of the prompt (greedy
    generate takes one sequence per input row); beam search: one row with ``num_beams`` beams."""
    if seed is not None:
        torch.manual_seed(seed)
    if kw.get("do_sample"):
        kw["num_return_sequences"] = ROWS
    elif not kw.get("num_beams"):
        ids = ids.expand(ROWS, -1)
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                              past_key_values=cache, **kw)


def test_cache_keeps_the_prompt_once_and_is_exact_without_attnopt():
    model = _model()
    ids = _prompt()
    cache = attnopt.SharedPrefixCache.prefill(model, ids[:, :-1])
    out = _generate(model, ids, cache, do_sample=False)
    ref = _generate(model, ids, do_sample=False)
    assert torch.equal(out, ref)
    layer = cache.layers[0]
    assert cache.prefix_length == ids.shape[1] - 1 and layer.prefix_keys.shape[0] == 1
    assert layer.keys.shape[0] == ROWS and layer.suffix_length == NEW_TOKENS  # the last prompt token + 5 generated
    assert cache.get_seq_length() == ids.shape[1] + NEW_TOKENS - 1


@pytest.mark.parametrize("attn", ["sdpa", pytest.param("eager", marks=pytest.mark.slow)])
@pytest.mark.parametrize("sampling", [False, True])
def test_parallel_sampling_through_optimize_is_the_cascade_and_exact(attn, sampling):
    model = _model(attn)
    ids = _prompt()
    kw = dict(do_sample=True, top_k=0, temperature=1.0) if sampling else dict(do_sample=False)
    ref = _generate(model, ids, seed=7, **kw)  # the original: a DynamicCache, the prompt computed for every row
    # force_plan: at these tiny shapes the CPU cost model prefers SDPA; the planner's choice at real sizes is tested
    # in tests/runtime/test_cascade.py
    optimized = attnopt.optimize(model, inner_backend="eager", force_plan="cascade")
    before = CALL_COUNTS.copy()
    cache = attnopt.SharedPrefixCache.prefill(model, ids[:, :-1])
    out = _generate(optimized, ids, cache, seed=7, **kw)
    assert torch.equal(out, ref), "tokens differ from the original model"
    report = attnopt.last_plans(optimized)
    cascade = [s for s in report.sites if s.rewritten and s.chosen.kind == "cascade"]
    layers = {f"model.layers.{i}.self_attn" for i in range(2)}
    assert {s.site.module_path for s in cascade} == layers, report.format_table(width=220)
    assert all(s.site.shared_prefix == ids.shape[1] - 1 for s in cascade)
    # every decode step (the uncached last prompt token, then NEW_TOKENS - 1 generated ones) ran the cascade op
    ran = sum(CALL_COUNTS[s.key] - before.get(s.key, 0) for s in cascade)
    assert ran == 2 * NEW_TOKENS
    assert "cascade" in report.format_table(width=220)


@pytest.mark.slow
def test_beam_search_reorders_the_suffixes_only():
    model = _model()
    ids = _prompt()
    ref = _generate(model, ids, num_beams=3, do_sample=False)
    cache = attnopt.SharedPrefixCache.prefill(model, ids[:, :-1])
    optimized = attnopt.optimize(model, inner_backend="eager", force_plan="cascade")
    out = _generate(optimized, ids, cache, num_beams=3, do_sample=False)
    assert torch.equal(out, ref)
    assert cache.layers[0].prefix_keys.shape[0] == 1
    sites = [s for s in attnopt.last_plans(optimized).sites if s.rewritten]
    assert sites and all(s.chosen.kind == "cascade" and s.site.batch == 3 and s.calls for s in sites)


def test_cache_errors_are_clear():
    model = _model()
    with pytest.raises(ValueError, match="one prompt"):
        attnopt.SharedPrefixCache.prefill(model, torch.ones(2, 5, dtype=torch.long))
    cache = attnopt.SharedPrefixCache.prefill(model, _prompt(6))
    k = torch.randn(3, 2, 1, 64)
    cache.update(k, k, 0)
    with pytest.raises(ValueError, match="same rows"):
        cache.update(torch.randn(2, 2, 1, 64), torch.randn(2, 2, 1, 64), 0)
    with pytest.raises(ValueError, match="cannot crop 2 tokens"):
        cache.layers[0].crop(-2)


@pytest.mark.cuda
@pytest.mark.parametrize("sampling", [False, True])
def test_parallel_sampling_on_the_gpu_runs_the_cascade_kernels(sampling):
    """The same on a GPU (fp32, so that tokens compare exactly): the cascade's Triton kernels run inside generate.
    (At this size three launches cost more than the bytes saved, so the planner would keep SDPA: forced here.)"""
    model = _model().cuda()
    ids = _prompt(600).cuda()
    kw = dict(do_sample=True, top_k=0, temperature=1.0) if sampling else dict(do_sample=False)
    ref = _generate(model, ids, seed=7, **kw)
    optimized = attnopt.optimize(model, inner_backend="eager", force_plan="cascade")
    cache = attnopt.SharedPrefixCache.prefill(model, ids[:, :-1])
    out = _generate(optimized, ids, cache, seed=7, **kw)
    assert torch.equal(out, ref), "tokens differ from the original model"
    report = attnopt.last_plans(optimized)
    decode = [s for s in report.sites if s.rewritten]
    assert decode and all(s.chosen.kind == "cascade" for s in decode), report.format_table(width=220)
