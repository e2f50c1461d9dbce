"""``attnopt bench multigpu``: sequence-parallel decode (tree and ring) against one device, under torchrun.

Launch one process per GPU::

    torchrun --standalone --nproc-per-node 2 -m attnopt.cli bench multigpu --out results.json

For each shape (``llama3-8b``: 32/8 heads, D=128; ``mha16``: 16/16 heads, D=128; bf16, B=1, one query token)
and each total length N, the full K/V are made identically on every rank and each rank keeps its contiguous
balanced shard. Rows (``method``):

* ``single:flash`` — one device over all N keys (no collective): the baseline tree and ring must beat;
* ``local:flash`` (and ``local:split_kv`` when attnopt's Triton kernel exists) — the shard's local attention
  alone (the part of a tree step that is not communication);
* ``tree:<collective>`` — local attention + the collective + the merge, as ``runtime.distributed`` runs it;
  timed ``eager`` (host-driven, as the op runs without a graph) and ``graph`` (the step captured in a CUDA
  graph, as under ``torch.compile(mode="reduce-overhead")``);
* ``tree:symm_mem`` — the all-gather done as ``torch.ops.symm_mem.one_shot_all_reduce`` of a zero-padded
  [o | lse] slot buffer (P2P loads, no NVLink multicast), eager and graph;
* ``ring:pass_kv`` / ``ring:pass_q`` — eager and graph.

Each row has ``us`` (median per step), ``rel_err`` against an fp32 single-device reference over all N keys,
``est_us`` from the cost model (``attnopt.cost.collective``; ``graph=True`` for graph rows) and, per case and
timing mode, ``model_pick`` / ``measured_best`` among the planner's candidates (tree x 3, ring x 2). The
summary gives ring over tree in each mode and the model's predicted / measured ratios. Results are written after every case, so a run cut short still leaves its rows.

The step timers are in ``multigpu_timing``, the summary of the rows in ``multigpu_summary``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from datetime import timedelta
from typing import Any

from attnopt.checks import float_at_least

from .multigpu_summary import RING, TREE, summarize
from .multigpu_timing import eager_us, graph_us, local_eager_us

#: name -> (B, Hq, Hkv, D)
SHAPES = {"llama3-8b": (1, 32, 8, 128), "mha16": (1, 16, 16, 128)}
LENGTHS = {"32k": 32768, "128k": 131072, "512k": 524288, "1M": 1048576, "2M": 2097152}
REL_ERR_OK = 2e-2


def register(sub) -> None:
    p = sub.add_parser("multigpu", help="tree / ring sequence-parallel decode vs one device (run under torchrun)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run_cli)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=None, help="results JSON (default benchmarks/results/multigpu-<P>x<device>.json)")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated; known: {', '.join(SHAPES)}")
    p.add_argument("--lengths", default=",".join(LENGTHS),
                   help=f"comma-separated total KV lengths: names ({', '.join(LENGTHS)}) or integers")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--iters", type=int, default=30, help="timed eager steps per method")
    p.add_argument("--graph-steps", type=int, default=20, help="steps captured per CUDA graph")
    p.add_argument("--no-graph", action="store_true", help="skip CUDA-graph timing")
    p.add_argument("--no-symm-mem", action="store_true", help="skip the symmetric-memory tree")
    p.add_argument("--timeout", type=float_at_least(0, strict=True), default=120.0, help="collective timeout, s")
    p.add_argument("--time-budget", type=float_at_least(0), default=0.0, help="stop starting new cases after this many s (0: none)")
    p.add_argument("--topology", default="local", help="topology for the cost model (default: detected)")
    p.add_argument("--hardware", default=None, help="hardware profile for the cost model (default: detected)")
    p.add_argument("--commit", default=None, help="commit sha to record")
    p.add_argument("--allow-cpu", action="store_true",
                   help="run on gloo without GPUs (GPU-sized work: many minutes; for testing the suite itself)")


def parse_length(text: str) -> int:
    return LENGTHS[text] if text in LENGTHS else int(text)


# --------------------------------------------------------------------------------------------- symm-mem tree
class SymmMemTree:
    """Tree all-gather as a one-shot all-reduce over symmetric memory: each rank writes its packed state into
    its own slot of a zeroed (P, ...) buffer, the sum of the buffers is the gather (x + 0 is exact), then the
    usual merge. Two buffers alternate, so a rank never zeroes a slot a peer may still be reading."""

    def __init__(self, g, shape: tuple[int, ...], device):
        import torch
        import torch.distributed._symmetric_memory as symm_mem

        self.g = g
        self.name = g.pg.group_name
        try:
            symm_mem.enable_symm_mem_for_group(self.name)
        except Exception:  # newer torch: enabled by default
            pass
        self.bufs = [symm_mem.empty(g.world, *shape, dtype=torch.float32, device=device) for _ in range(2)]
        self.handles = [symm_mem.rendezvous(b, self.name) for b in self.bufs]
        self.i = 0

    def __call__(self, o, m, log_l):
        import torch

        from attnopt.runtime.distributed import _pack, merge_packed

        buf = self.bufs[self.i]
        self.i ^= 1
        buf.zero_()
        _pack(o, m, log_l, buf[self.g.rank])
        total = torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", self.name)
        return merge_packed(total)


# --------------------------------------------------------------------------------------------- one case
def run_case(args, g, shape_name: str, n_total: int, hw, topo, cuda: bool, log,
             phase: str = "main") -> list[dict[str, Any]]:
    """Rows of one (shape, N) case. ``phase="symm"`` runs only the symmetric-memory tree (run last: a failure
    inside its device-side barrier could stall a peer, so it must not cost the other rows)."""
    import torch

    from attnopt.runtime import distributed as D
    from attnopt.runtime.reference import attention_states
    from attnopt.site import AttentionSite

    B, Hq, Hkv, Dh = SHAPES[shape_name]
    dtype = getattr(torch, args.dtype)
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    P, r = g.world, g.rank
    gen = torch.Generator(device=dev).manual_seed(1234 + n_total)
    k_full = torch.randn(B, Hkv, n_total, Dh, device=dev, dtype=dtype, generator=gen)
    v_full = torch.randn(B, Hkv, n_total, Dh, device=dev, dtype=dtype, generator=gen)
    q = torch.randn(B, Hq, 1, Dh, device=dev, dtype=dtype, generator=gen)
    a, b = D.balanced_bounds(n_total, P)[r]
    k = k_full[:, :, a:b].contiguous()
    v = v_full[:, :, a:b].contiguous()
    scale = 1.0 / math.sqrt(Dh)
    ref, _ = attention_states(q, k_full, v_full, scale=scale)  # fp32 single-device reference

    site = AttentionSite.canonical(batch=B, q_heads=Hq, kv_heads=Hkv, head_dim=Dh, kv_len=n_total,
                                   dtype=args.dtype, gqa_source="enable_gqa" if Hq != Hkv else "mha")
    if n_total % (1 << 20) == 0:
        case = f"{shape_name}-{n_total >> 20}M"
    elif n_total % 1024 == 0:
        case = f"{shape_name}-{n_total >> 10}k"
    else:
        case = f"{shape_name}-{n_total}"
    rows: list[dict[str, Any]] = []

    def row(method, mode, us, out, est=None, note=None):
        err = None
        if out is not None:
            o = out.double()
            err = float("inf") if not torch.isfinite(o).all() else float((o - ref.double()).norm() / ref.double().norm())
        rows.append({"case": case, "shape": shape_name, "B": B, "Hq": Hq, "Hkv": Hkv, "D": Dh, "N": n_total,
                     "N_local": b - a, "dtype": args.dtype, "method": method, "mode": mode,
                     "us": None if us is None else round(us, 2), "rel_err": err,
                     "est_us": None if est is None else round(est, 2), **({"note": note} if note else {})})
        log(f"  {case:18s} {method:22s} {mode:6s} {('%.1f' % us) if us is not None else '-':>9s} us  "
            f"err {err if err is None else '%.1e' % err}  est {est if est is None else '%.1f' % est}"
            + (f"  [{note}]" if note else ""))

    def est(fn):
        try:
            return float(fn())
        except Exception as exc:  # the cost model is helper code: record, do not stop the benchmark
            log(f"  cost model error: {type(exc).__name__}: {exc}")
            return None

    from attnopt.cost import collective as C
    from attnopt.cost import kernel as K

    if phase == "symm":
        del k_full, v_full
        try:
            sm = SymmMemTree(g, (B, Hq, 1, Dh + D.PACKED_EXTRA), dev)
            res = [None]

            def tree_sm():
                res[0] = sm(*D.local_states(q, k, v, scale=scale, split_lse=True))[0]

            row("tree:symm_mem", "eager", eager_us(tree_sm, g, args.iters, cuda), res[0])
            if not args.no_graph:
                row("tree:symm_mem", "graph", graph_us(tree_sm, args.graph_steps, g), res[0])
        except Exception as exc:
            row("tree:symm_mem", "eager", None, None, note=f"failed: {type(exc).__name__}: {exc}")
        return rows

    # -- single device over all N, and the local shard alone ------------------------------------------
    out_single: list = [None]

    def single():
        out_single[0] = D.local_states(q, k_full, v_full, scale=scale)[0]

    row("single:flash", "eager", local_eager_us(single, args.iters, cuda), out_single[0],
        est(lambda: K.best_single_device_us(site, hw)[1]))
    if cuda and not args.no_graph:
        try:
            row("single:flash", "graph", graph_us(single, args.graph_steps, g), out_single[0])
        except Exception as exc:
            row("single:flash", "graph", None, None, note=f"failed: {type(exc).__name__}: {exc}")
    del k_full, v_full
    if cuda:
        torch.cuda.empty_cache()

    local_kinds = ["flash"]
    if cuda:
        try:
            from attnopt.runtime.strategies import STRATEGIES

            if "split_kv" in STRATEGIES:
                local_kinds.append("split_kv")
        except Exception:
            pass
    for kind in local_kinds:
        holder: list = [None]

        def local(kind=kind, holder=holder):
            # the baseline is the local kernel alone, o in q's dtype where it produces that (flash)
            holder[0] = D.local_states(q, k, v, scale=scale, local=kind, fp32=False)

        try:
            us = local_eager_us(local, args.iters, cuda)
            row(f"local:{kind}", "eager", us, None, est(lambda: C.local_attention_us(site, hw, P)))
            if cuda and not args.no_graph:
                row(f"local:{kind}", "graph", graph_us(local, args.graph_steps, g), None)
        except Exception as exc:
            row(f"local:{kind}", "eager", None, None, note=f"failed: {type(exc).__name__}: {exc}")

    # -- tree -----------------------------------------------------------------------------------------
    for coll in TREE:
        res: list = [None]

        def tree(coll=coll, res=res):
            # what a decode site runs: local attention, the collective, the merge, o in q's dtype
            res[0] = D.tree_decode(q, k, v, g, collective=coll, scale=scale)

        row(f"tree:{coll}", "eager", eager_us(tree, g, args.iters, cuda), res[0],
            est(lambda: C.tree_decode_us(site, hw, topo, P, coll, False)))
        if cuda and not args.no_graph:
            try:
                us = graph_us(tree, args.graph_steps, g)
                row(f"tree:{coll}", "graph", us, res[0], est(lambda: C.tree_decode_us(site, hw, topo, P, coll, False,
                                                                                       graph=True)))
            except Exception as exc:
                row(f"tree:{coll}", "graph", None, None, note=f"failed: {type(exc).__name__}: {exc}")
    if "split_kv" in local_kinds:  # the tree with attnopt's Triton split-KV as its local attention
        res = [None]

        def tree_skv():
            res[0] = D.tree_decode(q, k, v, g, collective="all_gather", scale=scale, local="split_kv")

        try:
            row("tree:all_gather@split_kv", "eager", eager_us(tree_skv, g, args.iters, cuda), res[0])
            if not args.no_graph:
                row("tree:all_gather@split_kv", "graph", graph_us(tree_skv, args.graph_steps, g), res[0])
        except Exception as exc:
            row("tree:all_gather@split_kv", "eager", None, None, note=f"failed: {type(exc).__name__}: {exc}")

    # -- ring -----------------------------------------------------------------------------------------
    lens = [bb - aa for aa, bb in D.balanced_bounds(n_total, P)]
    for variant in RING:
        res = [None]

        def ring(variant=variant, res=res):
            if variant == "pass_kv":
                res[0] = D.ring_pass_kv(q, k, v, g, scale=scale, shard_lens=lens)[0]
            else:
                res[0] = D.ring_pass_q(q, k, v, g, scale=scale)[0]

        iters = max(3, args.iters // 5) if variant == "pass_kv" else args.iters
        row(f"ring:{variant}", "eager", eager_us(ring, g, iters, cuda), res[0],
            est(lambda: C.ring_decode_us(site, hw, topo, P, variant)))
        if cuda and not args.no_graph:  # same mode as the graph tree rows, so ring/tree compares like with like
            try:
                steps = max(2, args.graph_steps // 10) if variant == "pass_kv" else args.graph_steps
                row(f"ring:{variant}", "graph", graph_us(ring, steps, g), res[0],
                    est(lambda: C.ring_decode_us(site, hw, topo, P, variant, graph=True)))
            except Exception as exc:
                row(f"ring:{variant}", "graph", None, None, note=f"failed: {type(exc).__name__}: {exc}")
    g._buffers.clear()

    # -- model pick vs measured best ------------------------------------------------------------------
    planner_methods = [f"tree:{c}" for c in TREE] + [f"ring:{v}" for v in RING]
    for mode, methods in (("eager", planner_methods), ("graph", planner_methods)):
        cand = [x for x in rows if x["mode"] == mode and x["method"] in methods and x["us"] is not None]
        if len(cand) < 2:
            continue
        best = min(cand, key=lambda x: x["us"])
        with_est = [x for x in cand if x["est_us"] is not None]
        pick = min(with_est, key=lambda x: x["est_us"]) if with_est else None
        for x in cand:
            x["measured_best"] = best["method"]
            x["model_pick"] = pick["method"] if pick else None
            x["model_pick_ok"] = bool(pick and (pick is best or pick["us"] <= 1.05 * best["us"]))
    del k, v
    if cuda:
        torch.cuda.empty_cache()
    return rows


# --------------------------------------------------------------------------------------------- driver
def run_cli(args) -> int:
    import torch
    import torch.distributed as dist

    from attnopt.bench.common import results_header, write_results
    from attnopt.hardware import resolve_profile
    from attnopt.runtime import distributed as D
    from attnopt.topology import resolve_topology

    if "RANK" not in os.environ:
        raise ValueError("attnopt bench multigpu runs under torchrun: "
                         "torchrun --standalone --nproc-per-node 2 -m attnopt.cli bench multigpu")
    cuda = torch.cuda.is_available()
    if not cuda and not args.allow_cpu:
        raise ValueError("no CUDA GPU here: the multigpu suite times GPU-sized decode (up to 2M keys), which on gloo "
                         "and CPUs runs for many minutes; pass --allow-cpu to run it anyway")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=args.timeout))
    g = D.register_group(timeout=args.timeout)
    rank0 = g.rank == 0

    def log(msg):
        if rank0:
            print(msg, flush=True)

    hw = resolve_profile(args.hardware)
    topo = resolve_topology(args.topology, g.world)
    shapes = [s for s in args.shapes.split(",") if s]
    for s in shapes:
        if s not in SHAPES:
            raise ValueError(f"unknown shape {s!r}; known: {', '.join(SHAPES)}")
    lengths = [parse_length(x) for x in args.lengths.split(",") if x]
    results = results_header("multigpu", commit=args.commit, world_size=g.world, backend=g.backend,
                             hardware_profile=hw.name, topology=topo.to_dict() if hasattr(topo, "to_dict") else str(topo),
                             env={k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                                                 "NVSHMEM_DISABLE_NVLS")})
    out = args.out or f"benchmarks/results/multigpu-{g.world}x{str(results['device']).replace(' ', '_')}.json"
    log(f"attnopt bench multigpu: {g.describe()}, device {results['device']}, hw {hw.name}, topology {topo.name}")
    t_start = time.monotonic()
    phases = [("main", shape, n) for shape in shapes for n in lengths]
    if cuda and not args.no_symm_mem:
        phases += [("symm", shape, n) for shape in shapes for n in lengths]
    for phase, shape, n in phases:
        stop = torch.tensor([1.0 if (args.time_budget and time.monotonic() - t_start > args.time_budget) else 0.0],
                            device="cuda" if cuda else "cpu")
        g.all_reduce(stop, dist.ReduceOp.MAX, what="bench budget")
        if stop.item():
            log(f"time budget reached: skipping {shape} N={n}")
            results.setdefault("skipped", []).append(f"{phase}:{shape}-{n}")
            continue
        try:
            results["rows"].extend(run_case(args, g, shape, n, hw, topo, cuda, log, phase))
        except torch.cuda.OutOfMemoryError as exc:  # pragma: no cover - GPU only
            log(f"  {shape} N={n}: out of memory ({exc}); skipped")
            results.setdefault("skipped", []).append(f"{shape}-{n}: OOM")
            torch.cuda.empty_cache()
        results["summary"] = summarize(results["rows"])
        results["elapsed_s"] = round(time.monotonic() - t_start, 1)
        if rank0:
            write_results(out, results)
    if rank0:
        print(json.dumps(results["summary"], indent=1))
        print(f"wrote {out}")
    dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="attnopt bench multigpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run_cli(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
