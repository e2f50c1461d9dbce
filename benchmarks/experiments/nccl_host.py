"""Experiment (torchrun, 2 GPUs): host cost of eager NCCL collectives and of each step of tree_decode
(the replayed combine's and the replayed whole step's pieces included); per rank, host time and synced lock-step wall time of the local kernels
and of the tree over them, with the combine replayed and eager; a cProfile of tree_decode; JSON to $OUT."""
import cProfile, io, json, os, pstats
import torch
import torch.distributed as dist

dist.init_process_group("nccl")
rank = dist.get_rank()
torch.cuda.set_device(rank)
from attnopt.bench.common import git_commit, host_us as common_host_us
from attnopt.bench.multigpu import local_eager_us
from attnopt.runtime import distributed as D

g = D.register_group(dist.group.WORLD, name="x")
if rank == 0:
    print({k: v for k, v in os.environ.items() if "NCCL" in k or "TORCH_" in k})


def host_us(fn, iters=300):
    return common_host_us(fn, iters, repeats=3, warmup=10, sync=lambda: (torch.cuda.synchronize(), dist.barrier()))


x = torch.randn(1, 32, 1, 129, device="cuda")
out = torch.empty(2, 1, 32, 1, 129, device="cuda")
res = {}
res["all_gather_into_tensor"] = host_us(lambda: dist.all_gather_into_tensor(out.view(-1, 32, 1, 129), x))
res["all_reduce"] = host_us(lambda: dist.all_reduce(x))
res["g.all_gather"] = host_us(lambda: g.all_gather(out, x))
B, Hq, Hkv, Dh, n = 1, 32, 8, 128, 16384
q = torch.randn(B, Hq, 1, Dh, device="cuda", dtype=torch.bfloat16)
k = torch.randn(B, Hkv, n, Dh, device="cuda", dtype=torch.bfloat16)
v = torch.randn(B, Hkv, n, Dh, device="cuda", dtype=torch.bfloat16)
res["local_flash"] = host_us(lambda: D.local_states(q, k, v, fp32=False))
res["tree_decode"] = host_us(lambda: D.tree_decode(q, k, v, g))  # the whole step replayed (split-KV local)
res["tree_decode_flash"] = host_us(lambda: D.tree_decode(q, k, v, g, local="flash"))  # flash, replayed combine
step = next((e for e in g._steps.values() if not isinstance(e, str)), None)
if step is not None:  # the replayed step, piece by piece
    res["step_graph_call"] = host_us(lambda: step(q))
    res["step_q_copy"] = host_us(lambda: step.q.copy_(q))
    res["step_graph_replay"] = host_us(step.graph.replay)
o, lse = D.local_states(q, k, v, fp32=False)
res["combine_tree"] = host_us(lambda: D.combine_tree(o, lse, g, out_dtype=torch.bfloat16, with_lse=False))
parts = torch.randn(2, 1, 32, 1, 129, device="cuda")
res["merge_parts"] = host_us(lambda: D._merge_parts(parts, torch.bfloat16, False))
pk = torch.empty(1, 32, 1, 129, device="cuda")
res["pack"] = host_us(lambda: D._pack(o, lse, pk))
res["local_split_kv"] = host_us(lambda: D.local_states(q, k, v, fp32=False, local="split_kv"))
res["tree_decode_split_kv"] = host_us(lambda: D.tree_decode(q, k, v, g, local="split_kv"))
entry = next((e for e in g._graphs.values() if not isinstance(e, str)), None)
if entry is not None:  # the replayed combine, piece by piece
    res["combine_graph_call"] = host_us(lambda: entry(o, lse))
    res["graph_replay"] = host_us(entry.graph.replay)
    res["watchdog_watch"] = host_us(lambda: g._watch.watch("x"))
    res["out_clone"] = host_us(entry.out.clone)
    res["pack_copies"] = host_us(lambda: (entry.packed_o.copy_(o), entry.packed_lse.copy_(lse)))


def graph_off(fn):
    def run():
        os.environ["ATTNOPT_TREE_GRAPH"] = "0"
        try:
            return fn()
        finally:
            os.environ.pop("ATTNOPT_TREE_GRAPH", None)
    return run


# Per rank: host time (no sync) and synced lock-step wall time, for the local kernels and the tree over them,
# with the combine replayed from a graph and eager (ATTNOPT_TREE_GRAPH=0).
per_rank = {}
for name, fn in (("local_flash", lambda: D.local_states(q, k, v, fp32=False)),
                 ("tree_step_graph", lambda: D.tree_decode(q, k, v, g)),
                 ("tree_flash", lambda: D.tree_decode(q, k, v, g, local="flash")),
                 ("tree_flash_eager_combine", graph_off(lambda: D.tree_decode(q, k, v, g, local="flash"))),
                 ("local_split_kv", lambda: D.local_states(q, k, v, fp32=False, local="split_kv")),
                 ("tree_split_kv", lambda: D.tree_decode(q, k, v, g, local="split_kv")),
                 ("tree_split_kv_eager_combine", graph_off(lambda: D.tree_decode(q, k, v, g, local="split_kv")))):
    # the bench's own eager timer (synced wall time per call, lock-step after a barrier): the same measurement
    per_rank[name] = {"host_us": host_us(fn), "wall_us": local_eager_us(fn, 100, True, after_warmup=dist.barrier)}
gathered = [None] * dist.get_world_size()
dist.all_gather_object(gathered, per_rank)
res["per_rank"] = gathered
if rank == 0:
    print({kk: round(vv, 1) for kk, vv in res.items() if isinstance(vv, float)})
    for name in per_rank:
        print(name, " | ".join(f"rank {r}: host {d[name]['host_us']:.1f} wall {d[name]['wall_us']:.1f}"
                                for r, d in enumerate(gathered)))
pr = cProfile.Profile()
torch.cuda.synchronize(); dist.barrier()
pr.enable()
for _ in range(300):
    D.tree_decode(q, k, v, g)
pr.disable()
torch.cuda.synchronize()
if rank == 0:
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
    print(s.getvalue())
    res.update(device=torch.cuda.get_device_name(), commit=git_commit(), world=dist.get_world_size(),
               profile_tree_decode=s.getvalue())
    with open(os.path.join(os.environ.get("OUT", "."), "nccl_host.json"), "w") as f:
        json.dump(res, f, indent=1)
dist.barrier()
dist.destroy_process_group()
