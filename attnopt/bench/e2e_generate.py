"""``attnopt bench e2e``'s ``generate()`` rows, and the two phases every row runs in (compiles under the shared turn,
timing under the exclusive one: ``turns``)."""
from __future__ import annotations

import gc
import statistics
import time
from typing import Any

import torch

from .e2e_profile import host_profile
from .turns import DecodeCallTimer, compile_turn, gpu_turn, spread

#: ``attnopt.optimize`` options of the attnopt methods.
OPTIMIZE_OPTIONS: dict[str, dict[str, Any]] = {"attnopt": {}, "attnopt-ro": {"mode": "reduce-overhead"},
                                               "attnopt-cg": {"inner_backend": "cudagraphs"}}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def two_phases(phases) -> dict[str, Any]:
    """Run a ``*_phases`` generator: its preparation (compiles: the shared turn) then its timing (the exclusive turn);
    returns its row."""
    with compile_turn():
        next(phases)
    with gpu_turn():
        return finish(phases)


def finish(phases) -> dict[str, Any]:
    """The second phase of a prepared ``*_phases`` generator (timing, profiles): its row."""
    try:
        next(phases)
    except StopIteration as done:
        return done.value
    raise RuntimeError("a phases generator yielded twice")


def generate_row(args, model, method: str, context: int) -> dict[str, Any]:
    """ms per token of ``generate()`` from the difference of two lengths (the prefill cancels out)."""
    return two_phases(generate_phases(args, model, method, context))


@torch.no_grad()
def generate_phases(args, model, method: str, context: int):
    """``generate_row`` in two phases (a generator, as ``decode_phases``): the compiling first calls, then the timed
    calls and the host profile."""
    import attnopt

    kw: dict[str, Any] = {"do_sample": False, "cache_implementation": args.cache}
    owner = model
    if method == "hf-compiled":
        from transformers import CompileConfig

        kw["compile_config"] = CompileConfig(fullgraph=True, mode="reduce-overhead")
        if args.device == "cpu":  # HF skips compiling on the CPU otherwise
            kw["compile_config"]._compile_all_devices = True
    elif method == "hf-eager":
        kw["disable_compile"] = True
    else:
        owner = attnopt.optimize(model, **OPTIMIZE_OPTIONS[method])
    torch.manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (1, context), device=args.device)
    short, long = 8, 8 + args.generate_tokens
    repeats = getattr(args, "generate_repeats", 6)
    # the long call first: generate() keeps its static cache while a later call fits in it, so every timed call
    # runs over the same cache (same shapes and addresses: no recompilation, no new CUDA-graph recording)
    with compile_turn():
        t0 = time.perf_counter()
        owner.generate(ids, max_new_tokens=long, min_new_tokens=long, **kw)
        first = time.perf_counter() - t0
        owner.generate(ids, max_new_tokens=short, min_new_tokens=short, **kw)  # warm: every shape seen
    yield
    timer = DecodeCallTimer(owner, hf_compiles=method == "hf-compiled")
    times: dict[int, list[float]] = {}
    with gpu_turn():
        gc.collect()
        for n in (short, long) * repeats:  # interleaved repeats
            _sync(args.device)
            t0 = time.perf_counter()
            with timer.record():
                owner.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
            _sync(args.device)
            times.setdefault(n, []).append(time.perf_counter() - t0)
    timer.remove()
    # per token: the median period from one decode forward call to the next inside the timed calls (every token of
    # every call: hundreds of periods, each spanning a token's whole work, so none can be shorter than it); beside
    # it each repeat's long call minus its short call (the prefill cancels out), which two noisy calls could bring
    # below a token's own GPU time (H100, 4bab739: 0.57 ms for HF at 1k, whose step is 2.1 ms)
    periods = [1e3 * t for t in timer.token_seconds()]
    per_token = [1e3 * (b - a) / (long - short) for a, b in zip(times[short], times[long])]
    ms, pairs = spread(periods), spread(per_token)
    row = {"method": method, "context": context, "cache": args.cache, "generate_ms_per_token": ms["median"],
           "generate_ms_per_token_min": ms["min"], "generate_ms_per_token_max": ms["max"],
           "generate_ms_per_token_p10_p90": _deciles(periods), "generate_token_periods": len(periods),
           "generate_ms_per_token_pairs": per_token, "generate_ms_per_token_pairs_median": pairs["median"],
           "generate_ms_per_token_of_minima": 1e3 * (min(times[long]) - min(times[short])) / (long - short),
           "generate_first_call_s": first, "generate_forward_host_ms": timer.median_ms(),
           "generate_forward_host_ms_min": 1e3 * min(timer.seconds) if timer.seconds else None,
           "generate_forward_calls": len(timer.seconds)}
    from attnopt.api import _STEP_GRAPHS_ATTR

    steps = getattr(owner, _STEP_GRAPHS_ATTR, None)
    if steps is not None:  # how the timed calls' decode steps ran: replays, and what fell back and why
        row["generate_step_graphs"] = {"replays": steps.replays, "recorded": len(steps.recorded),
                                       "fallbacks": dict(steps.fallbacks)}
    if getattr(args, "profile", False):
        with gpu_turn():
            row["generate_host_profile"] = host_profile(lambda: owner.generate(ids, max_new_tokens=long,
                                                                              min_new_tokens=long, **kw), long)
    return row


def _deciles(values: list[float]) -> list[float] | None:
    """The 10th and 90th percentiles of ``values``."""
    if len(values) < 2:
        return None
    cuts = statistics.quantiles(values, n=10)
    return [cuts[0], cuts[-1]]
