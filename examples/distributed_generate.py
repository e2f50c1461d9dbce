"""Greedy generation of SmolLM2-135M-Instruct with its KV cache sharded along the sequence over N ranks.

Run (CPU, gloo)::

    torchrun --standalone --nproc-per-node 2 examples/distributed_generate.py --max-new-tokens 24

Every rank keeps only its shard of every layer's K/V (``ShardedDynamicCache``). The prompt is prefilled with
plain attention over the whole prompt, then each decode step runs Tree Attention (local attention over the
shard, one collective of the packed (o, lse), a merge) or Ring Attention, chosen with ``--plan``; with
``--plan auto`` the model goes through ``attnopt.optimize(model, process_group=...)``, whose planner picks tree or
ring per site from the topology model and lowers it into the compiled graph. Rank 0 also generates on one device
with the ordinary cache and checks that the greedy tokens are identical.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", default="What is the capital of France? Answer in one sentence.")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--plan", default="tree:all_gather",
                   help="auto (attnopt.optimize with the process group) | tree:all_gather | tree:all_reduce | "
                        "tree:all_reduce3 | ring:pass_kv | ring:pass_q")
    p.add_argument("--timeout", type=float, default=60.0, help="collective timeout, s")
    p.add_argument("--no-reference", action="store_true", help="skip the single-device comparison on rank 0")
    p.add_argument("--logit-atol", type=float, default=None,
                   help="max |logit difference| allowed vs one device (default: 1e-3 in fp32; in bf16/fp16 "
                        "3%% of the largest |logit|, since one device's bf16 SDPA rounds differently)")
    args = p.parse_args(argv)

    from attnopt.hf import chat_prompt, load_smollm2
    from attnopt.plan import RingPlan, TreePlan
    from attnopt.runtime import distributed as D

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=args.timeout))
    group = D.register_group(timeout=args.timeout)
    kind, _, variant = args.plan.partition(":")
    if kind == "auto":
        pass
    elif kind == "tree":
        group.hf_plan = TreePlan(world=group.world, collective=variant or "all_gather")
    elif kind == "ring":
        group.hf_plan = RingPlan(world=group.world, variant=variant or "pass_kv")
    else:
        raise SystemExit(f"unknown --plan {args.plan!r}")

    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    model, tok = load_smollm2(dtype=args.dtype, attn_implementation="sdpa", device=device)
    inputs = tok(chat_prompt(tok, args.prompt), return_tensors="pt").to(device)
    gen = dict(max_new_tokens=args.max_new_tokens, do_sample=False, output_logits=True, return_dict_in_generate=True)
    n_prompt = inputs["input_ids"].shape[1]

    ref = ref_logits = None
    if group.rank == 0 and not args.no_reference:
        with torch.no_grad():
            r = model.generate(**inputs, **gen)
        ref, ref_logits = r.sequences[0, n_prompt:].tolist(), torch.stack(r.logits)[:, 0].float()

    runner = model
    if kind == "auto":
        import attnopt

        runner = attnopt.optimize(model, process_group=group.pg, inner_backend="eager")
    else:
        D.register_hf_attention()
        model.set_attn_implementation("attnopt_sharded")
    cache = D.make_sharded_cache(model, group)
    t0 = time.perf_counter()
    with torch.no_grad():
        r = runner.generate(**inputs, past_key_values=cache, **gen)
    elapsed = time.perf_counter() - t0
    plan_text = group.hf_plan.describe() if kind != "auto" else None
    if kind == "auto":
        report = attnopt.last_plans(runner)
        rewritten = [s for s in report.sites if s.rewritten]
        plan_text = "auto: " + ", ".join(sorted({s.chosen.describe() for s in rewritten})) + \
            f" on {len(rewritten)} sites, {sum(s.calls for s in rewritten)} calls"
        if not rewritten or not any(s.calls for s in rewritten):
            print(f"rank {group.rank}: attnopt.optimize rewrote no decode site: {report.summary()}")
            plan_text += " (NOTHING REWRITTEN)"
    out, logits = r.sequences[0, n_prompt:].tolist(), torch.stack(r.logits)[:, 0].float()

    # Every rank must have produced the same tokens.
    mine = torch.tensor(out + [-1] * (args.max_new_tokens - len(out)), device=device)
    every = [torch.empty_like(mine) for _ in range(group.world)]
    dist.all_gather(every, mine)
    same_on_ranks = all(torch.equal(every[0], e) for e in every)
    lens = cache.shards.shard_lens()
    rc = 0
    if group.rank == 0:
        print(f"plan {plan_text} on {group.describe()}")
        print(f"shard lengths (tokens per rank): {lens}; {elapsed:.2f}s for {len(out)} tokens")
        print("distributed:", repr(tok.decode(out, skip_special_tokens=True)))
        if ref is not None:
            print("one device: ", repr(tok.decode(ref, skip_special_tokens=True)))
            identical = ref == out
            print(f"greedy tokens identical to one device: {identical}")
            # logits compared while the two token streams agree (after a divergence they see other prefixes)
            same_prefix = next((i for i, (a, b) in enumerate(zip(ref, out)) if a != b), min(len(ref), len(out)))
            steps = min(same_prefix + 1, len(ref_logits), len(logits))
            diff = (logits[:steps] - ref_logits[:steps]).abs().max().item()
            scale = ref_logits[:steps].abs().max().item()
            atol = args.logit_atol if args.logit_atol is not None else (1e-3 if args.dtype == "float32" else 0.03 * scale)
            print(f"max |logit difference| over {steps} step(s): {diff:.3e} (tolerance {atol:.3g}; "
                  f"largest |logit| {scale:.3g})")
            if args.dtype == "float32":
                rc = 0 if (identical and diff <= atol) else 1
            else:
                rc = 0 if diff <= atol else 1
        print(f"identical on every rank: {same_on_ranks}")
        rc = rc or (0 if same_on_ranks else 1)
    if plan_text.endswith("(NOTHING REWRITTEN)"):
        rc = 1
    flag = torch.tensor([rc], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    dist.destroy_process_group()
    return int(flag.item())


if __name__ == "__main__":
    sys.exit(main())
