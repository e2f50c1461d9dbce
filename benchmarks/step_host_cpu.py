"""CPU measurement: attnopt's host time per replayed decode step (``attnopt.step_graphs``), with the replay stood in.

    python benchmarks/step_host_cpu.py [--layers N] [--calls N] [--profile]

SmolLM2-135M's module structure (30 layers by default; the signature checks scale with modules, parameters and cache
tensors, not with their sizes: the hidden sizes are shrunk so the warm calls are quick) in fp32 on the CPU, through
``attnopt.optimize(model, mode="reduce-overhead")``. The forward that records is the model's own (no compile: this
measures the Python around a replay), the "graph" records by running it once and replays by doing nothing, so a call
costs exactly what attnopt's Python costs per token on top of the real ``cudaGraphLaunch``: the optimized forward's
wrapper (``api._hf_forward``), the signature, the checks that the model and the cache did not move, the input copies
and the output's construction. The arguments are the ones ``generate()`` passes (transformers 5.23: input_ids, the
cache, a 4D bool mask, use_cache, return_dict). Prints µs per call (median and min of ``--repeats`` rounds) and, with
``--profile``, the cProfile of the calls.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import time
import warnings

import torch


class NoOpGraphs:
    """Records by running ``fn`` once (its output's tensors stand for the graph's buffers), replays by doing nothing."""

    device_type = "cpu"

    def record(self, fn):
        return object(), fn()

    def replay(self, graph):
        pass


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--profile", action="store_true")
    a = p.parse_args()
    import attnopt
    from attnopt.bench.e2e import SHAPES, make_cache
    from transformers import LlamaConfig, LlamaForCausalLM

    fields = dict(SHAPES["smollm2-135m"], hidden_size=48, intermediate_size=96, num_attention_heads=3,
                  num_key_value_heads=1, head_dim=16, vocab_size=1024, num_hidden_layers=a.layers)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**fields, max_position_embeddings=2048, attn_implementation="sdpa")).eval()
    warnings.simplefilter("ignore")
    opt = attnopt.optimize(model, inner_backend="eager", mode="reduce-overhead")
    steps = opt._attnopt_step_graphs
    steps.graphs = NoOpGraphs()
    steps.compiled = steps.fallback = model.forward  # no dynamo: the Python around a replay is what is measured
    n = 1024
    cache = make_cache(model, "static", n)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 100, (1, 16)), past_key_values=cache, use_cache=True)
        kw = dict(input_ids=torch.ones(1, 1, dtype=torch.long), past_key_values=cache,
                  attention_mask=torch.ones(1, 1, 1, n, dtype=torch.bool), use_cache=True, return_dict=True)
        for _ in range(4):  # warm, warm, record (and first replay), replay
            opt(**kw)
        assert steps.replays >= 2, steps.fallbacks
        replays = steps.replays
        rounds = []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            for _ in range(a.calls):
                opt(**kw)
            rounds.append((time.perf_counter() - t0) / a.calls * 1e6)
        assert steps.replays == replays + a.repeats * a.calls, steps.fallbacks
        out = {"layers": a.layers, "us_per_call_median": round(statistics.median(rounds), 1),
               "us_per_call_min": round(min(rounds), 1), "rounds": [round(r, 1) for r in rounds]}
        print(json.dumps(out))
        if a.profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(a.calls):
                opt(**kw)
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
