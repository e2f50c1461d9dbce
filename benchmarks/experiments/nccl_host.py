"""Experiment (torchrun, 2 GPUs): host cost of eager NCCL collectives and of each step of tree_decode."""
import cProfile, io, os, pstats, statistics, time
import torch
import torch.distributed as dist

dist.init_process_group("nccl")
rank = dist.get_rank()
torch.cuda.set_device(rank)
from attnopt.runtime import distributed as D

g = D.register_group(dist.group.WORLD, name="x")
if rank == 0:
    print({k: v for k, v in os.environ.items() if "NCCL" in k or "TORCH_" in k})


def host_us(fn, iters=300):
    for _ in range(10):
        fn()
    torch.cuda.synchronize(); dist.barrier()
    ts = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        ts.append((time.perf_counter() - t0) / iters * 1e6)
        torch.cuda.synchronize(); dist.barrier()
    return statistics.median(ts)


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
res["tree_decode"] = host_us(lambda: D.tree_decode(q, k, v, g))
o, lse = D.local_states(q, k, v, fp32=False)
res["combine_tree"] = host_us(lambda: D.combine_tree(o, lse, g, out_dtype=torch.bfloat16, with_lse=False))
parts = torch.randn(2, 1, 32, 1, 129, device="cuda")
res["merge_parts"] = host_us(lambda: D._merge_parts(parts, torch.bfloat16, False))
pk = torch.empty(1, 32, 1, 129, device="cuda")
res["pack"] = host_us(lambda: D._pack(o, lse, pk))
if rank == 0:
    print({kk: round(vv, 1) for kk, vv in res.items()})
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
dist.barrier()
dist.destroy_process_group()
