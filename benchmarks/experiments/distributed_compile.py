"""Experiment (torchrun, 2 ranks; NCCL on GPUs, gloo on CPU): compile time of ``attnopt.optimize(model,
process_group=...)`` on a SmolLM2-shaped Llama (30 layers, 9/3 heads, D=64, random weights, fp32).

Per rank: seconds of the first and second 8-token (``--new``) greedy generation with the KV cache sharded over the group,
dynamo's graph count, the whole tree steps replayed from graphs (``--force-plan tree``: the planner picks ring
for a context this short), and whether the tokens equal one device's. ``--layers`` and ``--new`` shrink it for CPU.
JSON to $OUT/distributed_compile.json (rank 0)."""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--layers", type=int, default=30)
p.add_argument("--new", type=int, default=8)
p.add_argument("--force-plan", default=None, help="force this plan kind at the decode sites (e.g. tree)")
args = p.parse_args()
cuda = torch.cuda.is_available()
if cuda:
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
dist.init_process_group("nccl" if cuda else "gloo")
import transformers
from torch._dynamo.utils import counters

import attnopt
from attnopt.bench.common import git_commit
from attnopt.runtime import distributed as D

group = D.register_group(timeout=60)
step_reasons = {}  # why decode calls did or did not replay as whole-step graphs (None: they could)
_reason = D.step_graph_reason


def _counted_reason(*a, **kw):
    r = _reason(*a, **kw)
    step_reasons[str(r)] = step_reasons.get(str(r), 0) + 1
    return r


D.step_graph_reason = _counted_reason
device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                               num_hidden_layers=args.layers, num_attention_heads=9, num_key_value_heads=3,
                               head_dim=64, max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True)
torch.manual_seed(0)
model = transformers.LlamaForCausalLM(cfg).eval().to(device)
model.generation_config.pad_token_id = 0
model.set_attn_implementation("sdpa")
ids = torch.randint(1, 49152, (1, 20), generator=torch.Generator().manual_seed(1)).to(device)
gen = dict(max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False)
with torch.no_grad():
    ref = model.generate(ids, **gen)[0, 20:].tolist()
opt = attnopt.optimize(model, process_group=group.pg, inner_backend="eager", force_plan=args.force_plan)
res = {"layers": args.layers, "new_tokens": args.new, "force_plan": args.force_plan}
for attempt in ("first", "second"):
    cache = D.make_sharded_cache(model, group)
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = opt.generate(ids, past_key_values=cache, **gen)[0, 20:].tolist()
    if cuda:
        torch.cuda.synchronize()
    res[f"{attempt}_generate_s"] = time.perf_counter() - t0
    res[f"{attempt}_tokens_equal"] = out == ref
    group.cache = None
res["unique_graphs"] = int(counters["stats"]["unique_graphs"])
# whole tree steps captured (runtime/distributed.py::_StepGraph): the decode sites read the sharded storage
res["step_graphs"] = sum(not isinstance(e, str) for e in group._steps.values())
res["step_keys_seen_once"] = sum(e == "seen" for e in group._steps.values())
res["step_reasons"] = step_reasons
res["rewritten_calls"] = sum(s.calls for s in attnopt.last_plans(opt).sites if s.rewritten)
gathered = [None] * dist.get_world_size()
dist.all_gather_object(gathered, res)
if group.rank == 0:
    for r, d in enumerate(gathered):
        print(f"rank {r}: " + ", ".join(f"{k}={round(v, 2) if isinstance(v, float) else v}" for k, v in d.items()))
    body = {"suite": "distributed_compile", "device": torch.cuda.get_device_name() if cuda else "cpu",
            "world_size": dist.get_world_size(), "torch": torch.__version__, "commit": git_commit(), "ranks": gathered}
    with open(os.path.join(os.environ.get("OUT", "."), "distributed_compile.json"), "w") as f:
        json.dump(body, f, indent=1)
dist.barrier()
dist.destroy_process_group()
