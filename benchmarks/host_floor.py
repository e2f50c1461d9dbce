"""GPU experiment: how much of a SmolLM2-shaped decode step is host time, and what a whole-step CUDA graph leaves.

    python benchmarks/host_floor.py MODE CONTEXT OUT.json      (one mode per process; run several beside each other
                                                                with ATTNOPT_BENCH_GPU_LOCK set so timings take turns)
MODE:
  hf         torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)  (HF's documented path)
  ro         attnopt.optimize(model, mode="reduce-overhead")  (attnopt's whole-step graphs since 2026-11-24)
  trees      attnopt.optimize(model, mode="reduce-overhead", step_graphs=False)  (inductor's CUDA-graph trees)
  hf-freeze  hf with torch._inductor.config.freezing = True
  ro-freeze  ro with freezing
  graph      attnopt.optimize(model) (inductor, no CUDA graphs) captured by hand in one torch.cuda.CUDAGraph per step
             together with the greedy argmax and the position update (the floor: one replay per token)
  hf-graph   torch.compile(model.forward) (inductor, no CUDA graphs) captured the same way
Per mode: the synced step median (ms), the host time of one call (unsynced, ms) and a cProfile of 20 calls.
"""
import cProfile
import io
import json
import pstats
import statistics
import sys
import time

import torch

from attnopt.bench.e2e import build_model, make_cache, prefill
from attnopt.bench.turns import compile_turn, gpu_turn

mode, context, out_path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
if mode.endswith("freeze"):
    import torch._inductor.config as inductor_config

    inductor_config.freezing = True
model, _ = build_model("smollm2-135m", layers=None, dtype=torch.bfloat16, device="cuda", max_positions=context + 256)
torch.manual_seed(1)
ids = torch.randint(0, model.config.vocab_size, (1, context), device="cuda")
cache = make_cache(model, "static", context + 200)
row = {"mode": mode, "context": context}
with torch.no_grad():
    with gpu_turn():
        tok = prefill(model, cache, ids, 2048)
    pos = torch.tensor([context], device="cuda")
    if mode in ("graph", "hf-graph"):
        import attnopt

        fwd = attnopt.optimize(model).forward if mode == "graph" else torch.compile(model.forward)
        tok_buf, pos_buf = tok.clone(), pos.clone()

        def body():
            logits = fwd(input_ids=tok_buf, past_key_values=cache, cache_position=pos_buf, use_cache=True).logits
            tok_buf.copy_(logits[:, -1:].argmax(-1))
            pos_buf.add_(1)

        t0 = time.perf_counter()
        with compile_turn():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    body()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                body()
            torch.cuda.synchronize()
        row["first_call_s"] = time.perf_counter() - t0

        def call():
            graph.replay()
    else:
        import attnopt

        if mode.startswith("hf"):
            fn = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
        else:
            fn = attnopt.optimize(model, mode="reduce-overhead", step_graphs=mode != "trees").forward
        state = {"tok": tok, "pos": pos}

        def call():
            torch.compiler.cudagraph_mark_step_begin()
            logits = fn(input_ids=state["tok"], past_key_values=cache, cache_position=state["pos"],
                        use_cache=True).logits
            state["tok"] = logits[:, -1:].argmax(-1)
            state["pos"] = state["pos"] + 1

        t0 = time.perf_counter()
        with compile_turn():
            for _ in range(4):
                call()
            torch.cuda.synchronize()
        row["first_call_s"] = time.perf_counter() - t0
    with gpu_turn():
        steps, hosts = [], []
        for _ in range(40):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            call()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            steps.append(time.perf_counter() - t0)
            hosts.append(t1 - t0)
        t0 = time.perf_counter()
        for _ in range(40):
            call()
        torch.cuda.synchronize()
        row["pipelined_ms"] = (time.perf_counter() - t0) / 40 * 1e3
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(20):
            call()
        torch.cuda.synchronize()
        prof.disable()
    row["step_ms"] = 1e3 * statistics.median(steps)
    row["host_ms"] = 1e3 * statistics.median(hosts)
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
    row["cprofile_tottime_top25"] = text.getvalue()[-6000:]
print(json.dumps({k: v for k, v in row.items() if k != "cprofile_tottime_top25"}), flush=True)
json.dump(row, open(out_path, "w"), indent=1)
