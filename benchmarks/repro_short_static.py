"""GPU repro of a crash in inductor's CUDA-graph trees that HF's own compiled path shares (torch 2.11, H100).

SmolLM2-shaped model (random weights, 30 layers), a static cache, decode steps after a prompt of PROMPT tokens:
    python -X faulthandler benchmarks/repro_short_static.py DTYPE PROMPT EXTRA_SLOTS [attnopt|hf]
"attnopt" goes through optimize(model, mode="reduce-overhead"); "hf" through torch.compile(model.forward,
mode="reduce-overhead") with no attnopt at all. Measured at 9a1cd08 (H100, torch 2.11, transformers 5.17): a 7-token
prompt segfaults in torch/_inductor/runtime/static_triton_launcher.py (run), from an inductor kernel of partition_0
while cudagraph_trees records the first decode graph, for attnopt (fp32 and bf16, with 32 or 200 spare slots, with
ATTNOPT_TUNE=0, ATTNOPT_LAUNCH_CACHE=0 or ATTNOPT_PDL=0) AND for HF's own compiled forward; with
TORCHINDUCTOR_USE_STATIC_CUDA_LAUNCHER=0 both fail instead with "TypeError: Pointer argument must be either uint64 or
have data_ptr method" from the same inductor kernel. A 100-token (and a 2000-token) prompt runs in both.
"""
import faulthandler
import sys

import torch

faulthandler.enable()
import attnopt  # noqa: E402
from attnopt.bench.e2e import build_model, make_cache  # noqa: E402

dtype = getattr(torch, sys.argv[1] if len(sys.argv) > 1 else "float32")
prompt = int(sys.argv[2]) if len(sys.argv) > 2 else 7
extra = int(sys.argv[3]) if len(sys.argv) > 3 else 32  # cache slots past the prompt
who = sys.argv[4] if len(sys.argv) > 4 else "attnopt"  # or "hf": HF's own torch.compile(forward, reduce-overhead)
model, _ = build_model("smollm2-135m", layers=None, dtype=dtype, device="cuda", max_positions=8192)
ids = torch.randint(0, 1000, (1, prompt), device="cuda")
if who == "hf":
    model.forward = torch.compile(model.forward, mode="reduce-overhead")
    opt = model
else:
    opt = attnopt.optimize(model, mode="reduce-overhead")
with torch.no_grad():
    for rep in range(2):
        cache = make_cache(model, "static", prompt + extra)
        out = opt(input_ids=ids, past_key_values=cache, use_cache=True)
        tok = out.logits[:, -1].argmax(-1)
        for i in range(31):
            out = opt(input_ids=tok.view(1, 1), past_key_values=cache, use_cache=True)
            tok = out.logits[:, -1].argmax(-1).clone()
        torch.cuda.synchronize()
        print("forced steps ok", rep, flush=True)
    if who == "hf":
        sys.exit(0)
    g = opt.generate(ids, max_new_tokens=32, do_sample=False, cache_implementation="static")
    torch.cuda.synchronize()
    print("generate ok", g.shape, flush=True)
print("plans:", sorted({s.chosen.describe() for s in attnopt.last_plans(opt).sites if s.chosen}), flush=True)
