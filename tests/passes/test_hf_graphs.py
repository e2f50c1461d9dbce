"""The passes on real Hugging Face decode graphs (a tiny random Llama: 2 layers, 6 query / 2 KV heads, D=64):
sdpa and eager attention, DynamicCache and StaticCache, dynamo (torch level) and aot_autograd (aten level).
Every layer's attention is rewritten, reads the un-expanded cache, and the logits match the uncompiled model."""
from __future__ import annotations

import copy
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from attnopt.config import OptimizeConfig  # noqa: E402
from attnopt.passes import make_context, run_passes  # noqa: E402

from passgraphs import op_nodes  # noqa: E402

LAYERS = 2

# (attn_implementation, cache) -> allowed (gqa_source, mask_kind). transformers 5.23 passes no mask and
# enable_gqa=True for sdpa + DynamicCache; 5.17 passes a bool valid-length mask and expands K/V with repeat_kv.
EXPECTED = {
    ("sdpa", "dynamic"): {("enable_gqa", "none"), ("repeat_kv", "valid_length")},
    ("sdpa", "static"): {("repeat_kv", "valid_length")},
    ("eager", "dynamic"): {("repeat_kv", "valid_length")},
    ("eager", "static"): {("repeat_kv", "valid_length")},
}


def _model(impl: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=384, intermediate_size=128, num_hidden_layers=LAYERS,
                      num_attention_heads=6, num_key_value_heads=2, head_dim=64, max_position_embeddings=256)
    cfg._attn_implementation = impl
    torch.manual_seed(0)
    return cfg, LlamaForCausalLM(cfg).eval()


def _decode(impl: str, cache: str, level: str, steps: int = 2):
    from transformers.cache_utils import DynamicCache, StaticCache

    cfg, model = _model(impl)
    ctxs, gms = [], []

    def passes(gm, ex):
        ctx = make_context(OptimizeConfig(force_plan="dense"), ex)
        gm, _ = run_passes(gm, ex, ctx=ctx)
        ctxs.append(ctx)
        gms.append(gm)
        return gm.forward

    torch._dynamo.reset()
    if level == "aot":
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        backend = aot_autograd(fw_compiler=lambda gm, ex: make_boxed_func(passes(gm, ex)))
    else:
        backend = passes
    ids = torch.randint(0, 128, (1, 9))
    with torch.no_grad():
        pkv = StaticCache(config=cfg, max_cache_len=48) if cache == "static" else DynamicCache(config=cfg)
        nxt = model(ids, past_key_values=pkv, use_cache=True).logits[:, -1:].argmax(-1)
        ref_pkv = copy.deepcopy(pkv)
        step = torch.compile(model, backend=backend)
        for _ in range(steps):
            got = step(nxt, past_key_values=pkv, use_cache=True).logits
            want = model(nxt, past_key_values=ref_pkv, use_cache=True).logits
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            nxt = want[:, -1:].argmax(-1)
    return ctxs, gms


@pytest.mark.parametrize("impl,cache", list(EXPECTED))
def test_hf_llama_decode_dynamo(impl, cache):
    ctxs, gms = _decode(impl, cache, "dynamo")
    allowed = EXPECTED[(impl, cache)]
    pattern = "sdpa" if impl == "sdpa" else "eager_matmul"
    for ctx, gm in zip(ctxs, gms):
        sites = [m.site for m in ctx.matches]
        assert len(sites) == LAYERS and all(s.unsupported is None for s in sites), sites
        assert [s.module_path for s in sites] == [f"model.layers.{i}.self_attn" for i in range(LAYERS)]
        assert all((s.gqa_source, s.mask_kind) in allowed and (s.q_len, s.q_heads, s.kv_heads) == (1, 6, 2) for s in sites)
        assert ctx.rewrite_counts == {pattern: LAYERS}
        ops = op_nodes(gm)
        assert len(ops) == LAYERS
        for op in ops:  # the op reads the cache itself: no expand/reshape copy in front of it
            assert not (op.args[1].op == "call_method" and op.args[1].target in ("reshape", "expand", "view"))
        assert not [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "expand" and n.users
                    and any(u.op == "call_method" and u.target == "reshape" for u in n.users)]
    if cache == "dynamic":  # the second step recompiles with a symbolic KV length
        assert any(m.site.kv_len is None and m.site.kv_len_hint for c in ctxs for m in c.matches)


@pytest.mark.parametrize("impl,cache", [("sdpa", "static"), ("eager", "dynamic")])
def test_hf_llama_decode_aot(impl, cache):
    ctxs, gms = _decode(impl, cache, "aot", steps=1)
    pattern = "sdpa_flash_cpu" if impl == "sdpa" else "eager_bmm"
    for ctx, gm in zip(ctxs, gms):
        assert ctx.rewrite_counts == {pattern: LAYERS}, [m.site for m in ctx.matches]
        # (RoPE keeps one bmm of its own; the attention's softmax and fused SDPA are gone)
        assert not any(str(n.target) in ("aten._softmax.default", "aten._scaled_dot_product_flash_attention_for_cpu.default")
                       for n in gm.graph.nodes)
        for op in op_nodes(gm):
            assert str(op.args[1].target) not in ("aten.view.default", "aten._unsafe_view.default", "aten.clone.default")


@pytest.mark.parametrize("level", ["dynamo", "aot"])
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_hf_llama_static_cache_padded_mask_is_valid_length(impl, level):
    """A batch of two over a StaticCache, the second row left-padded: transformers builds ``ones & (kv <= q) &
    padding[batch, kv]`` in the graph (a bool mask for sdpa, ``where(mask, 0, finfo.min)`` for eager). It is
    classified "valid_length" at torch and aten level, and the rewritten step equals the model's."""
    from transformers.cache_utils import StaticCache

    cfg, model = _model(impl)
    ctxs = []

    def passes(gm, ex):
        ctx = make_context(OptimizeConfig(force_plan="dense"), ex)
        gm, _ = run_passes(gm, ex, ctx=ctx)
        ctxs.append(ctx)
        return gm.forward

    backend = passes
    if level == "aot":
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        backend = aot_autograd(fw_compiler=lambda gm, ex: make_boxed_func(passes(gm, ex)))
    torch._dynamo.reset()
    ids = torch.randint(3, 128, (2, 9))
    padding = torch.ones(2, 9, dtype=torch.long)
    padding[1, :4] = 0
    with torch.no_grad():
        pkv = StaticCache(config=cfg, max_cache_len=32)
        nxt = model(ids, attention_mask=padding, past_key_values=pkv, use_cache=True).logits[:, -1:].argmax(-1)
        ref = copy.deepcopy(pkv)
        padding = torch.cat([padding, torch.ones(2, 1, dtype=torch.long)], 1)
        got = torch.compile(model, backend=backend)(nxt, attention_mask=padding, past_key_values=pkv, use_cache=True)
        want = model(nxt, attention_mask=padding, past_key_values=ref, use_cache=True)
    torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=1e-5)
    sites = [m.site for c in ctxs for m in c.matches]
    assert len(sites) == LAYERS and all(s.mask_kind == "valid_length" and s.unsupported is None for s in sites), sites
    assert sum(sum(c.rewrite_counts.values()) for c in ctxs) == LAYERS


def _run_other(cls_name: str, cfg_name: str, impl: str, cache: str, config: OptimizeConfig | None = None, **extra):
    """One compiled decode step of a tiny random ``cls_name`` model under ``config`` (the dense plan by default);
    returns (ctxs, max |logit diff|)."""
    from transformers.cache_utils import DynamicCache, StaticCache

    cfg = getattr(transformers, cfg_name)(vocab_size=128, hidden_size=256, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                          max_position_embeddings=256, **extra)
    cfg._attn_implementation = impl
    torch.manual_seed(0)
    model = getattr(transformers, cls_name)(cfg).eval()
    ctxs = []

    def passes(gm, ex):
        ctx = make_context(config or OptimizeConfig(force_plan="dense"), ex)
        gm, _ = run_passes(gm, ex, ctx=ctx)
        ctxs.append(ctx)
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        pkv = StaticCache(config=cfg, max_cache_len=32) if cache == "static" else DynamicCache(config=cfg)
        nxt = model(torch.randint(0, 128, (1, 9)), past_key_values=pkv, use_cache=True).logits[:, -1:].argmax(-1)
        ref = copy.deepcopy(pkv)
        got = torch.compile(model, backend=passes)(nxt, past_key_values=pkv, use_cache=True).logits
        want = model(nxt, past_key_values=ref, use_cache=True).logits
    return ctxs, (got - want).abs().max().item()


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_hf_mistral_sliding_window_is_a_window_site(impl):
    """A Mistral static-cache decode step builds its mask in the graph, with ``kv > q - sliding_window``: without
    any model object, the graph alone shows the window; the sites are rewritten as window sites (the kernels start
    at ``key_start_from_mask``) and stay exact."""
    ctxs, err = _run_other("MistralForCausalLM", "MistralConfig", impl, "static", sliding_window=4,
                           config=OptimizeConfig(force_plan="split_kv"))
    sites = [m.site for c in ctxs for m in c.matches]
    assert len(sites) == LAYERS, sites
    for s in sites:
        assert s.mask_kind != "valid_length" and s.window == 4 and s.unsupported is None, s
    assert sum(sum(c.rewrite_counts.values()) for c in ctxs) == LAYERS and err < 1e-5


def test_hf_gemma2_softcapping_is_rewritten():
    """Gemma 2's eager chain ``tanh(scores * scaling / cap) * cap + mask``: the cap (50) is read off the chain, the
    sites are rewritten with it (split-KV's softcap path) and the logits stay the original's."""
    ctxs, err = _run_other("Gemma2ForCausalLM", "Gemma2Config", "eager", "static", sliding_window=4,
                           attn_logit_softcapping=50.0, config=OptimizeConfig(force_plan="split_kv"))
    sites = [m.site for c in ctxs for m in c.matches]
    assert len(sites) == LAYERS and all(s.softcap == 50.0 and s.unsupported is None for s in sites), sites
    assert sum(sum(c.rewrite_counts.values()) for c in ctxs) == LAYERS and err < 1e-5


def test_hf_llama_torch_export_static_cache():
    """``torch.export`` of transformers' exportable static-cache decoder: aten SDPA over repeat_kv copies."""
    try:
        from transformers import GenerationConfig
        from transformers.integrations.executorch import TorchExportableModuleWithStaticCache
    except ImportError as e:  # pragma: no cover - depends on the transformers version
        pytest.skip(f"transformers lacks the exportable static-cache module: {e}")
    cfg, model = _model("sdpa")
    model.generation_config = GenerationConfig(use_cache=True, cache_implementation="static", max_length=48,
                                               cache_config={"batch_size": 1, "max_cache_len": 48})
    ep = torch.export.export(TorchExportableModuleWithStaticCache(model, batch_size=1, max_cache_len=48), (),
                             {"input_ids": torch.tensor([[5]]), "cache_position": torch.tensor([3])}, strict=False)
    gm, ref = ep.module(), ep.module()
    ctx = make_context(OptimizeConfig(force_plan="dense"), ())
    gm, _ = run_passes(gm, (), ctx=ctx)
    sites = [m.site for m in ctx.matches]
    assert ctx.rewrite_counts == {"sdpa": LAYERS}
    assert all(s.gqa_source == "repeat_kv" and s.mask_kind == "valid_length" and s.kv_len == 48 for s in sites), sites
    for op in op_nodes(gm):
        assert str(op.args[1].target) not in ("aten.reshape.default", "aten.view.default", "aten.expand.default")
    for p in range(3, 6):
        kw = {"input_ids": torch.tensor([[p + 7]]), "cache_position": torch.tensor([p])}
        torch.testing.assert_close(gm(**kw), ref(**kw), atol=1e-5, rtol=1e-5)
