"""Coverage of Hugging Face decoder architectures: every decode-time attention layer is found, rewritten and run.

Random-init tiny configs (2 layers, small hidden sizes) that keep what matters for detection: GQA with odd group
sizes (6 query heads over 2 or 3 KV heads), MQA, MHA, partial rotary, fused QKV, and the head_dim quirks of each
family. Each architecture runs with ``attn_implementation`` "eager" and "sdpa", and with DynamicCache and
StaticCache (``generate(..., cache_implementation="static")``).

For each case:

* greedy generation of ``NEW_TOKENS`` tokens through ``attnopt.optimize`` is identical to the original model;
* the logits of every decode step equal the original's within fp32 tolerance;
* every decode graph has exactly one rewritten site per attention layer, and each attention layer's op ran once
  per decode step during ``generate`` (from ``SiteReport.calls``, i.e. ``runtime.ops.CALL_COUNTS``);
* prefill sites are left alone with a "prefill" reason.

The prompt is longer than ``max_decode_q_len`` (16) so that prefill is unambiguous with both cache kinds; a
separate test covers a short prompt over a static cache, where the prefill itself is a multi-token
decode-shaped site. The variant models (sliding windows: Mistral, Gemma 2/3, Starcoder2, Qwen2 with windows;
logit softcapping: Gemma 2; ALiBi: MPT, and Bloom's baddbmm) are rewritten too, and exact.
"""
from __future__ import annotations

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import attnopt  # noqa: E402
from attnopt.runtime.ops import CALL_COUNTS  # noqa: E402

VOCAB = 128
PROMPT_LEN = 20
NEW_TOKENS = 16
#: fp32 tolerance on logits: the rewritten attention is exact up to summation order.
ATOL = RTOL = 1e-4


# ------------------------------------------------------------------------------------------------ configs
def _common(attn: str) -> dict:
    return dict(vocab_size=VOCAB, num_hidden_layers=2, max_position_embeddings=256, attn_implementation=attn,
                pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _llama(attn):      # GQA, group 3
    return transformers.LlamaConfig(hidden_size=96, intermediate_size=128, num_attention_heads=6,
                                    num_key_value_heads=2, head_dim=16, **_common(attn))


def _mistral(attn):    # GQA, group 2; no sliding window (covered separately below)
    return transformers.MistralConfig(hidden_size=96, intermediate_size=128, num_attention_heads=6,
                                      num_key_value_heads=3, head_dim=16, sliding_window=None, **_common(attn))


def _qwen2(attn):      # GQA, group 3, q/k/v biases
    return transformers.Qwen2Config(hidden_size=96, intermediate_size=128, num_attention_heads=6,
                                    num_key_value_heads=2, **_common(attn))


def _phi3(attn):       # fused qkv projection, GQA group 2
    return transformers.Phi3Config(hidden_size=96, intermediate_size=128, num_attention_heads=6,
                                   num_key_value_heads=3, **_common(attn))


def _gpt2(attn):       # MHA, Conv1D fused qkv, learned positions, scale by division in eager
    return transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                                   attn_implementation=attn, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _gpt_neox(attn):   # MHA, partial rotary, interleaved fused qkv
    return transformers.GPTNeoXConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                      rotary_pct=0.5, **_common(attn))


def _gemma(attn):      # GQA group 3, head_dim (24) not hidden/heads
    return transformers.GemmaConfig(hidden_size=96, intermediate_size=128, num_attention_heads=6,
                                    num_key_value_heads=2, head_dim=24, **_common(attn))


def _gemma2(attn):     # logit softcapping (tanh) and alternating sliding-window layers; eager only in HF
    return transformers.Gemma2Config(hidden_size=96, intermediate_size=128, num_attention_heads=6,
                                     num_key_value_heads=2, head_dim=24, **_common(attn))


ARCHS = {"llama": _llama, "mistral": _mistral, "qwen2": _qwen2, "phi3": _phi3, "gpt2": _gpt2,
         "gpt_neox": _gpt_neox, "gemma": _gemma}
ATTNS = ("sdpa", "eager")
CACHES = ("dynamic", "static")

#: Cases whose decode sites are knowingly left alone, with the substring their reason must contain. Empty
#: means every architecture is fully covered; an entry here is a documented gap, not a silent skip.
EXPECTED_UNTOUCHED: dict[tuple[str, str, str], str] = {}


# ------------------------------------------------------------------------------------------------ helpers
@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def build(arch: str, attn: str, seed: int = 0):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(ARCHS[arch](attn)).eval()
    # Random weights can emit EOS at any step; never stop early so every case decodes NEW_TOKENS tokens.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def attention_layers(model) -> list[str]:
    """Module paths of the attention modules (``model.layers.0.self_attn``, ``transformer.h.0.attn``, …)."""
    return [name for name, mod in model.named_modules() if type(mod).__name__.endswith("Attention")]


def prompt(batch: int = 1, length: int = PROMPT_LEN, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=g)


def greedy(model, ids, cache: str, new_tokens: int = NEW_TOKENS, **kw):
    extra = {"cache_implementation": "static"} if cache == "static" else {}
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                              do_sample=False, output_logits=True,
                              return_dict_in_generate=True, **extra, **kw)


def is_decode(site_report, max_q: int = 16) -> bool:
    s = site_report.site
    return s.q_len is not None and s.q_len <= max_q and s.q_len != s.kv_len


def check_case(model, optimized, ids, cache: str, expect_untouched: str | None = None, new_tokens: int = NEW_TOKENS):
    """Generate with both, compare tokens and logits, and check the plan report against the model."""
    ref = greedy(model, ids, cache, new_tokens)
    before = CALL_COUNTS.copy()
    out = greedy(optimized, ids, cache, new_tokens)

    assert out.sequences.shape == (ids.shape[0], ids.shape[1] + new_tokens)
    assert torch.equal(out.sequences, ref.sequences), "greedy tokens differ from the original model"
    assert len(out.logits) == len(ref.logits) == new_tokens
    for step, (a, b) in enumerate(zip(out.logits, ref.logits)):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL, msg=lambda m: f"logits of step {step}: {m}")

    report = attnopt.last_plans(optimized)
    layers = attention_layers(model)
    assert layers, "the test could not find the model's attention modules"
    decode = [s for s in report.sites if is_decode(s)]
    prefill = [s for s in report.sites if not is_decode(s)]
    for s in prefill:
        why = s.reason_untouched or ""
        assert not s.rewritten and ("prefill" in why or (expect_untouched and expect_untouched in why)), (s.site, why)

    if expect_untouched is not None:
        assert decode, f"no decode site was even detected:\n{report.format_table()}"
        for s in decode:
            assert not s.rewritten and expect_untouched in (s.reason_untouched or ""), (s.site, s.reason_untouched)
        return report

    assert decode, f"no decode-time attention site was detected:\n{report.format_table()}"
    untouched = [(s.site.node, s.site.module_path, s.reason_untouched) for s in decode if not s.rewritten]
    assert not untouched, f"decode sites left alone: {untouched}\n{report.format_table()}"
    graphs = {s.key.split(":")[0] for s in decode}
    # One decode graph with a static cache; with a DynamicCache the second step recompiles with a symbolic length.
    assert len(graphs) >= 1
    assert len(decode) == len(graphs) * len(layers), (
        f"{len(decode)} decode sites in {len(graphs)} graph(s) for {len(layers)} attention layers\n"
        f"{report.format_table()}")
    for g in graphs:
        assert sorted(s.site.module_path for s in decode if s.key.startswith(g + ":")) == sorted(layers)

    # Executed during generate: each layer's op ran once per decode step (the first token comes from prefill).
    ran = {layer: 0 for layer in layers}
    for s in decode:
        ran[s.site.module_path] += CALL_COUNTS[s.key] - before.get(s.key, 0)
    assert ran == {layer: new_tokens - 1 for layer in layers}, ran
    assert all(s.calls == CALL_COUNTS[s.key] for s in decode)
    return report


# ------------------------------------------------------------------------------------------------ tests
CASES = [pytest.param(a, t, c, id=f"{a}-{t}-{c}") for a in ARCHS for t in ATTNS for c in CACHES]


@pytest.mark.slow
@pytest.mark.parametrize("arch, attn, cache", CASES)
def test_decode_sites_rewritten_and_exact(arch, attn, cache):
    model = build(arch, attn)
    optimized = attnopt.optimize(model, inner_backend="eager")
    check_case(model, optimized, prompt(), cache, EXPECTED_UNTOUCHED.get((arch, attn, cache)))


@pytest.mark.slow
@pytest.mark.parametrize("attn", ATTNS)
@pytest.mark.parametrize("cache", CACHES)
def test_dynamic_shapes(attn, cache):
    """``attnopt.optimize(model, dynamic=True)``: dynamo passes the float ``self.scaling`` in as a graph input read
    with ``.item()`` (a symbolic float; SDPA specialises it, the eager chain keeps it symbolic and lower folds it
    into q) and marks every size dynamic. One decode graph serves every step, all its sites are rewritten, and
    generation is exact."""
    model = build("llama", attn)
    optimized = attnopt.optimize(model, dynamic=True, inner_backend="eager")
    report = check_case(model, optimized, prompt(), cache)
    decode = [s for s in report.sites if is_decode(s)]
    assert len({s.key.split(":")[0] for s in decode}) == 1, report.format_table()
    assert all(s.rewritten and s.calls > 0 and s.site.kv_len is None for s in decode), report.format_table()


@pytest.mark.parametrize("arch, attn, cache", [
    pytest.param("llama", "sdpa", "dynamic", id="llama-sdpa-dynamic"),
    pytest.param("gemma", "eager", "static", id="gemma-eager-static"),
])
@pytest.mark.slow
def test_inductor(arch, attn, cache):
    """The default inner backend: inductor compiles the graph around the attnopt op (slow on 2 cores)."""
    model = build(arch, attn)
    optimized = attnopt.optimize(model, inner_backend="inductor")
    check_case(model, optimized, prompt(), cache)


@pytest.mark.slow
@pytest.mark.parametrize("attn", ATTNS)
def test_batched_aot_eager(attn):
    """Batch 2 through aot_eager: the aten-level graph (``bmm``/``_softmax`` or the SDPA aten variants)."""
    model = build("qwen2", attn)
    optimized = attnopt.optimize(model, inner_backend="aot_eager")
    check_case(model, optimized, prompt(batch=2), "dynamic")


@pytest.mark.slow
def test_short_prompt_static_cache():
    """A 5-token prompt over a StaticCache: the prefill is a q_len=5 query over the whole preallocated cache
    (decode-shaped by the q_len rule). Whatever attnopt decides for it, the result must be exact, and the
    q_len=1 decode sites must still all be rewritten."""
    model = build("llama", "sdpa")
    optimized = attnopt.optimize(model, inner_backend="eager")
    ids = prompt(length=5)
    ref = greedy(model, ids, "static")
    out = greedy(optimized, ids, "static")
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.logits, ref.logits):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL)
    report = attnopt.last_plans(optimized)
    one_token = [s for s in report.sites if s.site.q_len == 1]
    assert len(one_token) == len(attention_layers(model)) and all(s.rewritten and s.calls > 0 for s in one_token)
    multi = [s for s in report.sites if s.site.q_len == 5]
    assert len(multi) == len(attention_layers(model))
    for s in multi:
        # Either rewritten and executed (once, at prefill), or left alone with a stated reason.
        assert (s.rewritten and s.calls == 1) or (not s.rewritten and s.reason_untouched), s


# ------------------------------------------------------------------------------------------------ variants
#: Window of the variant models: shorter than the prompt plus the new tokens, so that it matters.
WINDOW = 8
VARIANT_TOKENS = 6


#: Head dim 64 (the kernels' smallest), 2 query heads over 1 KV head: hidden 128 keeps the models tiny.
_VARIANT_SHAPE = dict(hidden_size=128, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1)


def _mistral_window(attn):
    return transformers.MistralConfig(head_dim=64, sliding_window=WINDOW, **_VARIANT_SHAPE, **_common(attn))


def _gemma2_capped(attn):  # softcap 50 on the scores, alternating sliding (8) and full layers
    return transformers.Gemma2Config(head_dim=64, sliding_window=WINDOW, attn_logit_softcapping=50.0,
                                     **_VARIANT_SHAPE, **_common(attn))


def _gemma3(attn):  # sliding (8) and full layers, q/k norms, no softcap
    return transformers.Gemma3TextConfig(head_dim=64, sliding_window=WINDOW,
                                         layer_types=["sliding_attention", "full_attention"], **_VARIANT_SHAPE,
                                         **_common(attn))


def _starcoder2(attn):  # every layer windowed (8), biases
    return transformers.Starcoder2Config(sliding_window=WINDOW, **_VARIANT_SHAPE, **_common(attn))


def _qwen2_window(attn):  # use_sliding_window with max_window_layers=1: layer 0 full, layer 1 windowed
    return transformers.Qwen2Config(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
                                    **_VARIANT_SHAPE, **_common(attn))


def _mpt(attn):  # ALiBi (slopes times arange, sliced to the keys) and masked_fill(finfo.min); eager only
    return transformers.MptConfig(d_model=128, n_heads=2, n_layers=2, expansion_ratio=1, max_seq_len=64,
                                  vocab_size=VOCAB, attn_config={"alibi": True}, use_cache=True, pad_token_id=0,
                                  bos_token_id=1, eos_token_id=2)


def _bloom(attn):  # ALiBi folded into baddbmm(alibi, q, k^T, alpha=1/sqrt(d)), built from the 2-D mask's cumsum
    return transformers.BloomConfig(vocab_size=VOCAB, hidden_size=128, n_layer=2, n_head=2, attn_implementation=attn,
                                    pad_token_id=0, bos_token_id=1, eos_token_id=2)


#: (config, what each decode site of a layer must carry: {layer index: (window, softcap, alibi)}).
VARIANTS = {
    "mistral": (_mistral_window, {0: (WINDOW, None, False), 1: (WINDOW, None, False)}),
    "gemma2": (_gemma2_capped, {0: (WINDOW, 50.0, False), 1: (None, 50.0, False)}),
    "gemma3": (_gemma3, {0: (WINDOW, None, False), 1: (None, None, False)}),
    "starcoder2": (_starcoder2, {0: (WINDOW, None, False), 1: (WINDOW, None, False)}),
    "qwen2": (_qwen2_window, {0: (None, None, False), 1: (WINDOW, None, False)}),
    "mpt": (_mpt, {0: (None, None, True), 1: (None, None, True)}),
    # Bloom's positions are the mask's cumsum, not an arange (not provably slope * j): its bias joins the mask
    "bloom": (_bloom, {0: (None, None, False), 1: (None, None, False)}),
}
#: Gemma 2 has an eager attention only where softcapping is on (HF's sdpa drops the cap); MPT and Bloom are eager
#: only. MPT over a StaticCache breaks the graph on a ``Tensor.item()`` between its score product and its softmax
#: (``max(0, position_bias.size(1) - query_length)`` with the cache's tensor length, transformers 5.23), so no graph
#: holds a whole attention to rewrite (the model runs as it is); MPT is covered over the DynamicCache.
VARIANT_CASES = [pytest.param(a, t, c, id=f"{a}-{t}-{c}") for a in VARIANTS for t in ATTNS for c in CACHES
                 if not (a in ("gemma2", "mpt", "bloom") and t == "sdpa") and (a, c) != ("mpt", "static")]


def _layer(path: str) -> int:
    """The layer index in ``model.layers.1.self_attn`` or ``transformer.blocks.1.attn``."""
    return int(next(p for p in path.split(".") if p.isdigit()))


@pytest.mark.parametrize("arch, attn, cache", VARIANT_CASES)
def test_variant_models_rewritten_and_exact(arch, attn, cache):
    """Sliding windows, logit softcapping and ALiBi: every decode site is rewritten (as a window site where the layer
    has a window and a mask, with the cap where the model caps, with the slopes where it adds ALiBi), the logits of every step are the original's, the
    greedy tokens identical. The window (8) is shorter than the sequence (20 + 6 tokens), so it matters: with the
    kernels started at the wrong key the logits would differ. Plans: split-KV (CPU: the reference's
    partition-and-merge with the same key start and cap)."""
    make, expect = VARIANTS[arch]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(make(attn)).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    optimized = attnopt.optimize(model, inner_backend="eager", force_plan="split_kv")
    report = check_case(model, optimized, prompt(), cache, new_tokens=VARIANT_TOKENS)
    decode = [s for s in report.sites if is_decode(s)]
    for s in decode:
        window, softcap, alibi = expect[_layer(s.site.module_path)]
        assert s.site.softcap == softcap and s.site.alibi == alibi, (s.site, report.format_table())
        # A DynamicCache's sdpa path may drop a window mask that hides nothing yet: then no window is needed.
        assert s.site.window in ((window,) if cache == "static" or attn == "eager" else (window, None)), s.site
    assert any(s.site.window == WINDOW for s in decode) == any(e[0] for e in expect.values()), report.format_table()
    if arch == "bloom":  # the baddbmm chain, its bias added to the mask (so the mask is "arbitrary")
        assert all(s.site.pattern == "eager_baddbmm" and s.site.mask_kind == "arbitrary" for s in decode), \
            report.format_table()


def test_window_site_starts_at_the_band():
    """The op of a window site reads keys from the band's first one: the key start it computes on a StaticCache
    decode step of Mistral (window 8) is the position of the query minus 7."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_mistral_window("sdpa")).eval()
    from attnopt.runtime.reference import key_start_from_mask

    mask = torch.zeros(1, 1, 1, 32, dtype=torch.bool)
    mask[..., 13:21] = True  # query at position 20 sees keys 13..20
    assert key_start_from_mask(mask, 1).tolist() == [20 - WINDOW + 1]
    assert dict(attnopt.api.sliding_windows(model)) == {f"model.layers.{i}.self_attn": WINDOW for i in range(2)}
