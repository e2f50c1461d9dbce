"""Manual GPU check (not collected by pytest): the fused CUDA aten SDPA variants and HF decode on CUDA, through
aot_autograd, with the passes, in fp16/bf16. Run: ``python tests/passes/gpu_check_passes.py``."""
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from passgraphs import aot, dynamo, eager_hf, float_mask, op_nodes, rand_bool_mask  # noqa: E402

from attnopt.config import OptimizeConfig  # noqa: E402

dev = "cuda"
results = []


def check(name, fn, *args, config=None, tol=2e-2, level=aot):
    cfg = config or OptimizeConfig(force_plan="dense")
    try:
        r = level(fn, *args, config=cfg)
        ref = fn(*args)
        err = (r.out.float() - ref.float()).abs().max().item()
        sites = [(s.pattern, s.gqa_source, s.mask_kind, s.unsupported) for s in r.sites]
        chosen = [rep.chosen.kind if rep.chosen else None for rep in r.reports]
        ok = err <= tol and r.count() == len(r.sites)
        results.append(ok)
        print(f"{'OK  ' if ok else 'FAIL'} {name}: rewrites={r.count()} ops={len(op_nodes(r.gm))} err={err:.2e} plans={chosen} sites={sites}")
    except Exception as e:  # noqa: BLE001
        results.append(False)
        print(f"FAIL {name}: {type(e).__name__}: {str(e)[:400]}")


for dtype in (torch.float16, torch.bfloat16):
    for G, L, N in ((4, 1, 1000), (3, 2, 333)):
        q = torch.randn(2, 2 * G, L, 128, device=dev, dtype=dtype)
        k = torch.randn(2, 2, N, 128, device=dev, dtype=dtype)
        v = torch.randn(2, 2, N, 128, device=dev, dtype=dtype)
        mb = rand_bool_mask(2, L, N).to(dev)
        kr, vr = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
        tag = f"{str(dtype)[6:]} G={G} L={L} N={N}"
        check(f"flash (no mask, MHA-expanded) {tag}", lambda q, k, v: F.scaled_dot_product_attention(q, k, v), q, kr, vr)
        check(f"sdpa enable_gqa {tag}", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), q, k, v)
        check(f"efficient (float mask) {tag}", lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
              q, kr, vr, float_mask(mb.cpu(), dtype).to(dev))
        check(f"causal {tag}", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), q, kr, vr)
        with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.CUDNN_ATTENTION]):
            check(f"cudnn {tag}", lambda q, k, v: F.scaled_dot_product_attention(q, k, v), q, kr, vr)
        check(f"eager_bmm {tag}", eager_hf, q, k, v, float_mask(mb.cpu(), dtype).to(dev))
        check(f"planner's choice, dynamo {tag}", lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True),
              q, k, v, mb, config=OptimizeConfig(), level=dynamo)



def hf_decode(impl, cache, steps=4):
    """Tiny Llama on CUDA (bf16): the passes with the planner's choice, then inductor; greedy tokens must match."""
    import copy

    from torch._inductor.compile_fx import compile_fx
    from transformers.cache_utils import DynamicCache, StaticCache

    import test_hf_graphs as t
    from attnopt.passes import make_context, run_passes

    cfg, model = t._model(impl)
    model = model.to(dev, torch.bfloat16)
    plans = []

    def backend(gm, ex):
        ctx = make_context(OptimizeConfig(), ex)
        gm, rep = run_passes(gm, ex, ctx=ctx)
        plans.extend((s.chosen.kind if s.chosen else None, s.rewritten) for s in rep.sites)
        return compile_fx(gm, ex)

    torch._dynamo.reset()
    ids = torch.randint(0, 128, (1, 300), device=dev)
    with torch.no_grad():
        pkv = StaticCache(config=cfg, max_cache_len=512) if cache == "static" else DynamicCache(config=cfg)
        nxt = model(ids, past_key_values=pkv, use_cache=True).logits[:, -1:].argmax(-1)
        ref_pkv, ref_nxt = copy.deepcopy(pkv), nxt.clone()
        step = torch.compile(model, backend=backend)
        got, want, err = [], [], 0.0
        for _ in range(steps):
            a = step(nxt, past_key_values=pkv, use_cache=True).logits
            b = model(ref_nxt, past_key_values=ref_pkv, use_cache=True).logits
            err = max(err, (a.float() - b.float()).abs().max().item())
            nxt, ref_nxt = a[:, -1:].argmax(-1), b[:, -1:].argmax(-1)
            got.append(int(nxt)), want.append(int(ref_nxt))
    ok = got == want and all(r for _, r in plans) and err < 0.1
    results.append(ok)
    print(f"{'OK  ' if ok else 'FAIL'} HF llama {impl}/{cache} bf16 cuda + inductor: tokens {got} vs {want}, "
          f"max|dlogit|={err:.3e}, plans={sorted(set(plans))}")


for impl, cache in (("sdpa", "static"), ("sdpa", "dynamic"), ("eager", "dynamic")):
    try:
        hf_decode(impl, cache)
    except Exception as e:  # noqa: BLE001
        results.append(False)
        print(f"FAIL HF llama {impl}/{cache}: {type(e).__name__}: {str(e)[:600]}")

print(f"{sum(results)}/{len(results)} ok")
