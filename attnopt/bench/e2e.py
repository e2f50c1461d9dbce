"""``attnopt bench e2e``: whole-model decoding through ``attnopt.optimize`` beside Hugging Face's own paths.

For each context and method, it
1. builds the model: a named shape with random weights (fixed seed) or a GGUF file / HF folder, on the GPU;
2. prefills ``context`` random tokens with the eager model into a cache (a ``StaticCache`` of context + margin
   slots by default, as HF's compiled path needs), in chunks so no prefill mask is quadratic in the context;
3. decodes ``steps`` greedy tokens one forward at a time, each synced; the first ``warmup`` calls (compile,
   CUDA-graph recording) are timed apart as the first-call cost, the median of the rest is the step time;
4. compares its greedy tokens with HF eager's from the same prefill;
5. with ``--generate``, times ``generate()`` at two lengths, in ``--generate-repeats`` interleaved pairs, and reports
   ms per token as the median period from one decode forward call to the next inside them (with its min, max and
   deciles; the pairs' differences beside it), and the host time of one decode forward call inside it (``generate_forward_host_ms``: guards, wrappers, the
   CUDA-graph replay's launch; ``turns.DecodeCallTimer``), where HF's path and attnopt's differ on the host.

Methods:

* ``hf-eager``: ``model.forward``;
* ``hf-compiled``: ``torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)``, HF's documented
  static-cache path (and ``generate()`` compiling by itself over a static cache);
* ``attnopt``: ``attnopt.optimize(model)`` (inductor);
* ``attnopt-ro``: ``attnopt.optimize(model, mode="reduce-overhead")`` (each decode step one CUDA graph that attnopt
  records, ``attnopt.step_graphs``);
* ``attnopt-cg``: ``attnopt.optimize(model, inner_backend="cudagraphs")``.

``--isolate`` runs every (context, method) in a subprocess, so a crash becomes a row with its exit signal instead of
ending the suite; ``--parallel N`` runs N of them at a time, which take turns so that no timed section runs beside
anything another run does (its imports, model build, compile, prefill, profile or exit: ``turns``). ``--profile`` adds, per attnopt method, a torch.profiler breakdown of a few
steps: graphs run per step, host time of the attnopt ops, GPU time of the attention kernels.
"""
from __future__ import annotations

import gc
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from attnopt.checks import device_kind, float_at_least, int_at_least

from .common import format_table, results_header, write_results
from .e2e_generate import OPTIMIZE_OPTIONS, _sync, finish, generate_phases, generate_row, two_phases  # noqa: F401
from .e2e_parallel import isolated, print_row, run_parallel
from .e2e_profile import attention_in_step, profile_steps, standalone_attention_us, tuning_records
from .turns import compile_turn, end_helper_processes, gpu_turn

#: Named model shapes: transformers ``LlamaConfig`` fields (random weights).
SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, vocab_size=49152, rope_theta=100000.0,
                         tie_word_embeddings=True),
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, vocab_size=128256, rope_theta=500000.0),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=256, rope_theta=10000.0),
}
METHODS = ("hf-eager", "hf-compiled", "attnopt", "attnopt-ro", "attnopt-cg")
_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
           "float32": torch.float32, "fp32": torch.float32}


def parse_context(text: str) -> int:
    """``"8k"`` -> 8192, ``"1000"`` -> 1000; a length below 1 is an error (it reached the model as a negative
    dimension or an empty prompt)."""
    t = text.strip().lower()
    try:
        n = int(t[:-1]) * 1024 if t.endswith("k") else int(t)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"--contexts: bad context {text!r}: expected a length >= 1, an integer or a number of k "
                         "tokens such as 8k")
    return n


def build_model(name: str, *, layers: int | None, dtype: torch.dtype, device: str, max_positions: int):
    """(model, description): a named shape with random weights, or a ``.gguf`` file / HF folder."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    path = Path(name)
    if name not in SHAPES and path.exists():
        kw = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
        folder = path.parent if path.suffix == ".gguf" else path
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, attn_implementation="sdpa", **kw)
        return model.to(device).eval(), f"{path.name} (weights from file)"
    if name not in SHAPES:
        raise ValueError(f"unknown model {name!r}: a path to a .gguf file or HF folder, or one of {', '.join(SHAPES)}")
    fields = dict(SHAPES[name])
    if layers:
        fields["num_hidden_layers"] = layers
    config = LlamaConfig(**fields, max_position_embeddings=max(max_positions, 8192), attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype).eval()
    return model, f"{name} ({fields['num_hidden_layers']} layers, random weights)"


def make_cache(model, kind: str, max_len: int):
    from transformers import DynamicCache, StaticCache

    if kind == "dynamic":
        return DynamicCache(config=model.config)
    if kind == "static":
        return StaticCache(config=model.config, max_cache_len=max_len)
    raise ValueError(f"unknown cache {kind!r}; valid: static, dynamic")


@torch.no_grad()
def prefill(model, cache, ids: torch.Tensor, chunk: int) -> torch.Tensor:
    """Feed ``ids`` (1, T) through the eager model in chunks; returns the first greedy token, (1, 1)."""
    logits = None
    for start in range(0, ids.shape[1], chunk):
        logits = model(input_ids=ids[:, start:start + chunk], past_key_values=cache, use_cache=True,
                       logits_to_keep=1).logits
    return logits[:, -1:].argmax(-1)


def make_step(method: str, model):
    """(step(tok, cache) -> logits, optimized object or None) for ``method``."""
    import attnopt

    if method == "hf-eager":
        fn, opt = model.forward, None
    elif method == "hf-compiled":
        fn, opt = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True), None
    elif method in OPTIMIZE_OPTIONS:
        opt = attnopt.optimize(model, **OPTIMIZE_OPTIONS[method])
        fn = opt.forward
    else:
        raise ValueError(f"unknown method {method!r}; valid: {', '.join(METHODS)}")
    graphs = method in ("hf-compiled", "attnopt-ro", "attnopt-cg")

    def step(tok, cache):
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        return fn(input_ids=tok, past_key_values=cache, use_cache=True).logits

    return step, opt


def decode_row(args, model, method: str, context: int) -> dict[str, Any]:
    """Time ``args.steps`` decode steps of ``method`` after a prefill of ``context`` tokens."""
    return two_phases(decode_phases(args, model, method, context))


@torch.no_grad()  # (on a generator: at each resume)
def decode_phases(args, model, method: str, context: int):
    """``decode_row`` in two phases (a generator): the prefill and the warm-up steps (compiles), then, resumed, the
    timed steps and the profile; its return value is the row. Workers of ``--parallel`` prepare every part of a row
    first and time all of it in one exclusive turn (``run_one``)."""
    device = args.device
    torch.manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (1, context), device=device)
    cache = make_cache(model, args.cache, context + args.steps + args.warmup + 16)
    with compile_turn():  # GPU work: never beside another run's timed sections
        tok = prefill(model, cache, ids, args.prefill_chunk)
    step, opt = make_step(method, model)
    times, tokens = [], [int(tok)]

    def one_step():
        nonlocal tok
        _sync(device)
        t0 = time.perf_counter()
        logits = step(tok, cache)
        tok = logits[:, -1:].argmax(-1)
        tokens.append(int(tok))  # syncs
        times.append(time.perf_counter() - t0)

    with compile_turn():
        for _ in range(args.warmup):
            one_step()
    yield
    with gpu_turn():
        gc.collect()  # (no collection of the warm-up's garbage inside the timed steps)
        for _ in range(args.steps):
            one_step()
    steady = times[args.warmup:]
    row: dict[str, Any] = {"method": method, "context": context, "cache": args.cache,
                           "step_ms": 1e3 * statistics.median(steady), "step_ms_min": 1e3 * min(steady),
                           "first_call_s": times[0], "warmup_s": sum(times[:args.warmup]),
                           "tokens": tokens}
    if opt is not None:
        import attnopt

        report = attnopt.last_plans(opt)
        row.update(sites=len(report.sites), rewritten=len(report.rewritten),
                   kinds=sorted({s.chosen.kind for s in report.rewritten if s.chosen}),
                   attnopt_calls=sum(s.calls for s in report.sites),
                   calls_without_attnopt=report.calls_without_attnopt)
        from attnopt.api import _BACKEND_ATTR

        backend = getattr(opt, _BACKEND_ATTR, None)
        if backend is not None:  # the first call's parts that attnopt owns (the rest: dynamo, the first run)
            row.update(attnopt_pass_s=round(backend.pass_seconds, 3),
                       inner_compile_s=round(backend.inner_compile_seconds, 3), **overlap_row(backend))
        if args.profile and device == "cuda":
            try:
                with gpu_turn():
                    row["profile"] = profile_steps(step, cache, tok)
                    row["standalone_attention"] = standalone_attention_us(report, cache, context + len(tokens))
                row.update(attention_in_step(row["profile"], len(report.rewritten), row["standalone_attention"]))
            except Exception as e:  # noqa: BLE001 - a profiler failure must not lose the timed row
                row["profile"] = {"error": repr(e)[:500], "ops": {}, "kernels_per_step": None, "gpu_us_per_step": None}
    return row


def overlap_row(backend) -> dict[str, Any]:
    """How much of the measured choice the inner compile hid (``attnopt.tuning_defer``): the background tunings'
    wall seconds, the seconds first calls waited for them (what the compile did not hide) and the difference."""
    jobs = list(getattr(backend, "background_tunings", ()))
    wall = sum(job.wall_s for job in jobs)
    waited = float(getattr(backend, "tune_wait_seconds", 0.0))
    return {"background_tunings": len(jobs), "tuning_wall_s": round(wall, 3),
            "first_call_waited_s": round(waited, 3), "tuning_hidden_s": round(max(0.0, wall - waited), 3),
            "tuning_failed": [job.error for job in jobs if job.error]}


def run_one(args, context: int, method: str) -> list[dict[str, Any]]:
    """The rows of one (context, method) in this process: everything that compiles or builds first (the shared turn),
    then everything timed in one exclusive turn. Under ``--parallel`` every worker compiles beside the others, and
    each one's timed sections follow in turn, once no worker compiles any more (``turns``)."""
    with compile_turn():
        model, _ = build_model(args.model, layers=args.layers, dtype=_DTYPES[args.dtype], device=args.device,
                               max_positions=context + 1024)
        decode = decode_phases(args, model, method, context)
        next(decode)
        generate = None
        if args.generate and method != "attnopt-cg":
            generate = generate_phases(args, model, method, context)
            next(generate)
        # nothing of this run's but the timed work beside its timed sections (H100, bf50495: two of the three attnopt
        # rows ran every host function 1.6-2x slower than at 4bab739, their idle workers and other rows' alive; the
        # cause is not proven, and idle processes are not needed there)
        ended = end_helper_processes()
    with gpu_turn():
        load = _load_average()  # (the machine's run queue as the timed turn starts: others' work beside it)
        row = finish(decode)
        if generate is not None:
            row.update(finish(generate))
    row.update(helpers_ended=ended, load_average_at_timing=load)
    if method in OPTIMIZE_OPTIONS:
        row["tuning"] = tuning_records()
    return [row]


def _load_average() -> list[float] | None:
    import os

    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def run(args) -> int:
    contexts = [parse_context(c) for c in args.contexts.split(",")]
    methods = args.methods.split(",")
    for m in methods:
        if m not in METHODS:
            raise ValueError(f"--methods: unknown method {m!r}; valid: {', '.join(METHODS)}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("attnopt bench e2e: no CUDA device here; pass --device cpu to check the script on the CPU")
    rows: list[dict[str, Any]] = []
    if args.rows_out:  # a worker of --isolate: one context, one method
        Path(args.rows_out).write_text(json.dumps(run_one(args, contexts[0], methods[0])))
        return 0
    if args.parallel > 1:
        rows = run_parallel(args, contexts, methods)
    for context in contexts if args.parallel <= 1 else ():
        for method in methods:
            got = isolated(args, context, method) if args.isolate else run_one(args, context, method)
            for r in got:
                print_row(r)
            rows += got
    _compare_tokens(rows)
    _add_ratios(rows)
    result = results_header("e2e", model=args.model, layers=args.layers, dtype=args.dtype, cache=args.cache,
                            steps=args.steps, warmup=args.warmup)
    result["rows"] = rows
    if args.out:
        write_results(args.out, result)
    print(format_table(rows, [("context", "ctx", ""), ("method", "method", ""), ("step_ms", "step ms", ".3f"),
                              ("vs_hf_compiled", "HF compiled / this", ".2f"), ("first_call_s", "first call s", ".1f"),
                              ("warmup_s", "warm-up s", ".1f"), ("tuning_wall_s", "tuning s", ".1f"),
                              ("first_call_waited_s", "waited s", ".1f"),
                              ("generate_ms_per_token", "generate ms/tok", ".3f"),
                              ("generate_ms_per_token_min", "min", ".3f"),
                              ("generate_forward_host_ms", "fwd host ms", ".3f"),
                              ("tokens_identical", "tokens ==", ""), ("rewritten", "rewritten", ""),
                              ("calls_without_attnopt", "eager calls", ""), ("error", "error", "")]))
    return 0


def _compare_tokens(rows: list[dict[str, Any]]) -> None:
    """Each row's greedy tokens against HF eager's at the same context (same prefill, same weights)."""
    ref = {r["context"]: r["tokens"] for r in rows if r.get("method") == "hf-eager" and "tokens" in r}
    for r in rows:
        if "tokens" in r and r["context"] in ref and r.get("method") != "hf-eager":
            same = [a == b for a, b in zip(r["tokens"], ref[r["context"]])]
            r["tokens_identical"] = all(same)
            r["first_token_difference"] = None if all(same) else same.index(False)


def _add_ratios(rows: list[dict[str, Any]]) -> None:
    """``vs_hf_compiled``: HF compiled step time over this row's (above 1: faster than HF's compiled path)."""
    base = {r["context"]: r["step_ms"] for r in rows if r.get("method") == "hf-compiled" and "step_ms" in r}
    for r in rows:
        if "step_ms" in r and r["context"] in base:
            r["vs_hf_compiled"] = base[r["context"]] / r["step_ms"]


def register(suites) -> None:
    p = suites.add_parser("e2e", help="whole-model decode step and generate() through optimize(), beside HF's paths")
    p.add_argument("--model", default="smollm2-135m",
                   help=f"a named shape with random weights ({', '.join(SHAPES)}) or a .gguf file / HF folder")
    p.add_argument("--layers", type=int_at_least(1), default=None, help="override the named shape's layer count")
    p.add_argument("--contexts", default="1k,8k,32k", help="comma-separated prompt lengths (8k = 8192)")
    p.add_argument("--methods", default="hf-eager,hf-compiled,attnopt-ro", help=f"comma-separated: {', '.join(METHODS)}")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(_DTYPES))
    p.add_argument("--cache", default="static", choices=("static", "dynamic"))
    p.add_argument("--steps", type=int_at_least(1), default=30, help="timed decode steps")
    p.add_argument("--warmup", type=int_at_least(0), default=4, help="untimed first calls (compile, CUDA-graph recording)")
    p.add_argument("--prefill-chunk", type=int_at_least(1), default=4096)
    p.add_argument("--generate", action="store_true", help="also time generate() ms per token")
    p.add_argument("--generate-tokens", type=int_at_least(1), default=32)
    p.add_argument("--generate-repeats", type=int_at_least(1), default=6,
                   help="generate() pairs (short, long) timed; ms per token is the median of the pairs' differences")
    p.add_argument("--profile", action="store_true", help="profile a few steps of the attnopt methods")
    p.add_argument("--isolate", action="store_true", help="one subprocess per (context, method): a crash is a row")
    p.add_argument("--timeout", type=float_at_least(0, strict=True), default=900, help="seconds per isolated run")
    p.add_argument("--parallel", type=int_at_least(1), default=1,
                   help="isolated runs at a time, a context's methods together (they compile together and take "
                        "turns to time, with no compile beside a timed section)")
    p.add_argument("--device", type=device_kind, default="cuda", help="cuda; cpu checks the script itself")
    p.add_argument("--rows-out", default=None, help=argparse_suppress())
    p.add_argument("--out", help="write the results JSON here")
    p.set_defaults(func=run)


def argparse_suppress() -> str:
    import argparse

    return argparse.SUPPRESS
