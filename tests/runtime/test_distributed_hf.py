"""Hugging Face integration over gloo: a tiny random Llama (attention made sharp, so that it matters) decodes with
its KV cache sharded over 2 ranks (``ShardedDynamicCache``) and gives the same logits and greedy tokens as on one
device, both through ``hf_sharded_attention`` (every tree/ring plan) and through
``attnopt.optimize(model, process_group=pg)`` (the planner's choice, lowered into the compiled graph). A negative
control checks that plain SDPA over the local shards would have been wrong."""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_distributed import ok_payloads, run_ranks  # noqa: E402  (the gloo harness)

pytest.importorskip("transformers")

PLANS = ("tree:all_gather", "tree:all_reduce", "tree:all_reduce3", "ring:pass_kv", "ring:pass_q")


def _tiny_sharp_llama(seed: int, sharpen: float = 6.0, **config):
    """A random 2-layer GQA Llama (6/2 heads, D=8 unless ``config`` says otherwise) whose attention is sharpened
    (q and k projections times ``sharpen``), so that it matters: with tiny random weights it is nearly uniform."""
    import transformers

    cfg = transformers.LlamaConfig(**{**dict(vocab_size=97, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                                             num_attention_heads=6, num_key_value_heads=2, head_dim=8,
                                             max_position_embeddings=256), **config})
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(sharpen)
            layer.self_attn.k_proj.weight.mul_(sharpen)
    model.generation_config.pad_token_id = 0
    return model


def _plan(text: str, world: int):
    """``tree:<collective>`` or ``ring:<variant>`` as a plan for ``world`` ranks."""
    from attnopt.plan import RingPlan, TreePlan

    kind, variant = text.split(":")
    return TreePlan(world=world, collective=variant) if kind == "tree" else RingPlan(world=world, variant=variant)


def _generate(rank, world, plans):
    import attnopt
    from attnopt.runtime import distributed as D

    group = D.register_group(timeout=20)
    model = _tiny_sharp_llama(seed=0)
    results = {}
    for prompt_len in (21, 5):
        ids = torch.randint(1, 97, (1, prompt_len), generator=torch.Generator().manual_seed(prompt_len))
        gen = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False, output_logits=True,
                   return_dict_in_generate=True)

        def run(m, **kw):
            with torch.no_grad():
                out = m.generate(ids, **gen, **kw)
            return out.sequences[0, prompt_len:].tolist(), torch.stack(out.logits)

        model.set_attn_implementation("sdpa")
        ref_tokens, ref_logits = run(model)

        def record(name, cache, tokens, logits):
            results[(prompt_len, name)] = (tokens == ref_tokens, (logits - ref_logits).abs().max().item(),
                                           cache.shards.shard_lens())
            group.cache = None

        cache = D.make_sharded_cache(model, group)  # negative control: plain SDPA over the local shard
        record("sdpa-local-only", cache, *run(model, past_key_values=cache))
        D.register_hf_attention()
        model.set_attn_implementation("attnopt_sharded")
        for text in plans:
            group.hf_plan = _plan(text, world)
            cache = D.make_sharded_cache(model, group)
            record(text, cache, *run(model, past_key_values=cache))
        model.set_attn_implementation("sdpa")
        opt = attnopt.optimize(model, process_group=group.pg, inner_backend="eager")
        cache = D.make_sharded_cache(model, group)
        record("optimize", cache, *run(opt, past_key_values=cache))
        report = attnopt.last_plans(opt)
        results[(prompt_len, "optimize-plans")] = sorted({s.chosen.kind for s in report.sites if s.rewritten})
        results[(prompt_len, "optimize-calls")] = sum(s.calls for s in report.sites if s.rewritten)
    return results


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_tiny_llama_matches_one_device_on_two_ranks():
    res = ok_payloads(run_ranks(_generate, 2, PLANS, deadline=130))
    for rank in (0, 1):
        r = res[rank]
        for prompt_len in (21, 5):
            for name in PLANS + ("optimize",):
                same, err, lens = r[(prompt_len, name)]
                assert same and err < 1e-4, (rank, prompt_len, name, err)
                assert sum(lens) == prompt_len + 9 and max(lens) - min(lens) <= 1, (name, lens)
            same, err, _ = r[(prompt_len, "sdpa-local-only")]
            assert err > 1e-2, "negative control: attention over the local shard alone should differ"
            assert r[(prompt_len, "optimize-plans")] and set(r[(prompt_len, "optimize-plans")]) <= {"tree", "ring"}
            assert r[(prompt_len, "optimize-calls")] >= 2 * 9  # 2 layers x 9 decode steps


def _generate_padded(rank, world, plans):
    """A left-padded batch of two prompts (21 and 13 real tokens): the padding mask travels through the sharded
    attention (sliced to each rank's keys) and must give the one-device tokens and logits for both rows."""
    import attnopt
    from attnopt.runtime import distributed as D

    group = D.register_group(timeout=20)
    model = _tiny_sharp_llama(seed=1)
    ids = torch.randint(1, 97, (2, 21), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    ids[1, :8], mask[1, :8] = 0, 0  # row 1: 8 pad tokens on the left, 13 real ones
    gen = dict(attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False, output_logits=True,
               return_dict_in_generate=True)

    def run(m, **kw):
        with torch.no_grad():
            out = m.generate(ids, **gen, **kw)
        return out.sequences[:, 21:].tolist(), torch.stack(out.logits)

    model.set_attn_implementation("sdpa")
    ref_tokens, ref_logits = run(model)
    results = {}
    D.register_hf_attention()
    model.set_attn_implementation("attnopt_sharded")
    for text in plans:
        group.hf_plan = _plan(text, world)
        cache = D.make_sharded_cache(model, group)
        tokens, logits = run(model, past_key_values=cache)
        results[text] = (tokens == ref_tokens, (logits - ref_logits).abs().max().item())
        group.cache = None
    model.set_attn_implementation("sdpa")
    opt = attnopt.optimize(model, process_group=group.pg, inner_backend="eager")
    cache = D.make_sharded_cache(model, group)
    tokens, logits = run(opt, past_key_values=cache)
    results["optimize"] = (tokens == ref_tokens, (logits - ref_logits).abs().max().item())
    results["optimize-calls"] = sum(s.calls for s in attnopt.last_plans(opt).sites if s.rewritten)
    return results


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_left_padded_batch_matches_one_device_on_two_ranks():
    plans = ("tree:all_gather", "tree:all_reduce", "ring:pass_kv", "ring:pass_q")
    res = ok_payloads(run_ranks(_generate_padded, 2, plans, deadline=130))
    for rank in (0, 1):
        for name in plans + ("optimize",):
            same, err = res[rank][name]
            assert same and err < 1e-4, (rank, name, err)
        assert res[rank]["optimize-calls"] >= 2 * 7


def _compiled_graphs_by_depth(rank, world, depths):
    """Graphs dynamo compiles for one generation through ``optimize(process_group=...)``, per model depth."""
    import transformers
    from torch._dynamo.utils import counters

    import attnopt
    from attnopt.runtime import distributed as D

    group = D.register_group(timeout=20)
    out = {}
    for depth in depths:
        cfg = _tiny_sharp_llama(seed=0).config
        cfg.num_hidden_layers = depth
        model = transformers.LlamaForCausalLM(cfg).eval()
        model.generation_config.pad_token_id = 0
        torch._dynamo.reset()
        counters.clear()
        opt = attnopt.optimize(model, process_group=group.pg, inner_backend="eager")
        cache = D.make_sharded_cache(model, group)
        ids = torch.randint(1, 97, (1, 9), generator=torch.Generator().manual_seed(depth))
        with torch.no_grad():
            opt.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False, past_key_values=cache)
        group.cache = None
        out[depth] = (int(counters["stats"]["unique_graphs"]),
                      sum(s.calls for s in attnopt.last_plans(opt).sites if s.rewritten))
    return out


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_distributed_compile_does_not_grow_with_depth():
    """The sharded cache's graph break must not cost one compilation per layer (a 30-layer model compiled
    ~70 graphs, tens of seconds with Inductor): the graph count is the same at 2 and 6 layers, and every layer
    still runs the rewritten attention."""
    res = ok_payloads(run_ranks(_compiled_graphs_by_depth, 2, (2, 6), deadline=130))
    for rank in (0, 1):
        (g2, calls2), (g6, calls6) = res[rank][2], res[rank][6]
        assert g2 == g6, f"rank {rank}: {g2} graphs at 2 layers, {g6} at 6"
        assert calls2 == 2 * 3 and calls6 == 6 * 3, (calls2, calls6)  # every layer, 3 decode steps


def _generate_nccl(rank, world):
    """On NCCL (one GPU per rank): a tiny sharpened Llama with head_dim 64 (inside the split-KV kernel's range, so
    tree decode steps replay from whole-step graphs) through ``hf_sharded_attention`` and ``optimize`` with the
    tree forced, in fp32 and bf16, against one device."""
    import attnopt
    from attnopt.plan import TreePlan
    from attnopt.runtime import distributed as D

    group = D.register_group(timeout=60)
    base = _tiny_sharp_llama(3, sharpen=4.0, hidden_size=384, intermediate_size=256, head_dim=64,
                             max_position_embeddings=512)
    ids = torch.randint(1, 97, (1, 40), generator=torch.Generator().manual_seed(5)).cuda()
    gen = dict(max_new_tokens=24, min_new_tokens=24, do_sample=False, output_logits=True,
               return_dict_in_generate=True)
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = base.to("cuda", dtype)

        def run(m, **kw):
            with torch.no_grad():
                out = m.generate(ids, **gen, **kw)
            return out.sequences[0, 40:].tolist(), torch.stack(out.logits).float()

        model.set_attn_implementation("sdpa")
        ref_tokens, ref_logits = run(model)
        for route in ("attention-interface", "optimize"):
            group._steps.clear()
            if route == "attention-interface":
                D.register_hf_attention()
                model.set_attn_implementation("attnopt_sharded")
                group.hf_plan = TreePlan(world=world)
                m = model
            else:
                model.set_attn_implementation("sdpa")
                m = attnopt.optimize(model, process_group=group.pg, inner_backend="eager", force_plan="tree")
            cache = D.make_sharded_cache(model, group)
            tokens, logits = run(m, past_key_values=cache)
            group.cache = None
            first_diff = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), None)
            # after a token flips the two runs continue from different text: compare the steps up to the flip
            upto = len(tokens) if first_diff is None else first_diff + 1
            results[(str(dtype), route)] = (first_diff, (logits[:upto] - ref_logits[:upto]).abs().max().item(),
                                            sum(not isinstance(e, str) for e in group._steps.values()))
            model.set_attn_implementation("sdpa")
    return results


@pytest.mark.multigpu
@pytest.mark.timeout(300)
def test_tree_steps_replayed_from_graphs_match_one_device_on_nccl():
    """fp32: the greedy tokens equal one device's and the logits agree to 1e-3; bf16: each step's logits within 0.1
    up to the first token difference, if any (reported: after it the two runs decode different text). Both
    routes replay whole tree steps from captured graphs."""
    res = ok_payloads(run_ranks(_generate_nccl, 2, deadline=280, backend="nccl"))
    for rank in (0, 1):
        for route in ("attention-interface", "optimize"):
            first_diff, err, graphs = res[rank][("torch.float32", route)]
            assert first_diff is None and err < 1e-3, (rank, route, first_diff, err)
            assert graphs >= 2, (rank, route, graphs)  # one per layer at least
            first_diff, err, graphs = res[rank][("torch.bfloat16", route)]
            print(f"rank {rank} bf16 {route}: first token difference {first_diff}, max logit error {err:.3g}")
            assert err < 0.1 and graphs >= 2, (rank, route, first_diff, err, graphs)
