"""``attnopt tune``: measure the plan choice for shapes ahead of time, so a model's first call finds it cached.

Examples::

    attnopt tune llama3-8b --context 8k,32k,128k            # one shape per context length
    attnopt tune 32/8x128 9/3x64 --batch 1,8 --context 32k
    attnopt tune smollm2 --symbolic                          # every KV-length bucket (a growing cache)
    attnopt tune HuggingFaceTB/SmolLM2-135M --context 8k     # heads read from a Hugging Face config

Each shape is timed as the planner would before first use (``attnopt.tuning``: the cost model's best kernel
plans and every SDPA backend that applies, CUDA-graph replay over rotating inputs) and the winner is stored in
the tuning cache. Tuning needs a CUDA GPU; without one the command says so and exits 2.
"""
from __future__ import annotations

import argparse
import math
import re
import sys
from typing import Any

#: Model presets: (query heads, KV heads, head dim).
PRESETS: dict[str, tuple[int, int, int]] = {
    "llama3-8b": (32, 8, 128),
    "llama3-70b": (64, 8, 128),
    "smollm2": (9, 3, 64),
    "mistral-7b": (32, 8, 128),
    "qwen2.5-7b": (28, 4, 128),
}
#: A bare shape, ``HQ/HKVxD`` or ``HxD``.
SHAPE_RE = re.compile(r"\s*(\d+(?:/\d+)?)\s*x\s*(\d+)\s*")
#: Their layer counts: the sites of one decode step that share one valid-length computation (``--mask``).
PRESET_LAYERS: dict[str, int] = {"llama3-8b": 32, "llama3-70b": 80, "smollm2": 30, "mistral-7b": 32,
                                 "qwen2.5-7b": 28}


def register(sub) -> None:
    p = sub.add_parser("tune", help="measure and cache the plan choice for shapes (needs a CUDA GPU)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("shapes", nargs="+", metavar="MODEL-OR-SHAPE",
                   help=f"a preset ({', '.join(PRESETS)}), HQ/HKVxD such as 32/8x128, or a Hugging Face config "
                        "name or folder")
    p.add_argument("--context", default="8k,32k,128k",
                   help="comma-separated KV lengths (suffix k or M allowed); default 8k,32k,128k")
    p.add_argument("--batch", default="1", help="comma-separated batch sizes (default 1)")
    p.add_argument("--q-len", default="1", help="comma-separated query lengths (default 1)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--mask", default="none", choices=("none", "valid_length"),
                   help="valid_length: a static cache with a mask (timed at half fill)")
    p.add_argument("--layers", type=int, default=None,
                   help="with --mask valid_length: attention sites per step sharing the mask, whose one valid-length "
                        "computation each site is charged a share of (default: the preset's or config's layer "
                        "count; 1 for a bare shape)")
    p.add_argument("--no-graphs", action="store_true",
                   help="tune for a model compiled without CUDA graphs (any mode but reduce-overhead): a call then "
                        "costs the longer of its device and host time (default: device time, as CUDA graphs replay)")
    p.add_argument("--symbolic", action="store_true",
                   help="tune every KV-length bucket of a growing cache instead of --context's lengths, each at "
                        "its middle (a model's run reuses them; untuned, it times its trace-time length's bucket "
                        "at that length)")
    p.add_argument("--budget", type=float, default=None, help="seconds of timing per shape (default: the planner's)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.set_defaults(func=run)


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--{what} {text!r}: expected comma-separated integers") from None
    if not values or min(values) < 1:
        raise ValueError(f"--{what} {text!r}: values must be >= 1")
    return values


def resolve_heads(spec: str) -> tuple[int, int, int]:
    """(Hq, Hkv, D) of a preset, a ``32/8x128`` shape, or a Hugging Face config (name or folder)."""
    from .explain import parse_heads

    if spec in PRESETS:
        return PRESETS[spec]
    m = SHAPE_RE.fullmatch(spec)
    if m:
        hq, hkv = parse_heads(m.group(1))
        if int(m.group(2)) < 1:
            raise ValueError(f"{spec!r}: the head dim must be >= 1")
        return hq, hkv, int(m.group(2))
    try:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(spec)
    except Exception as exc:  # noqa: BLE001 - any failure means the spec is not a model we can read
        raise ValueError(f"{spec!r} is neither a preset ({', '.join(PRESETS)}), a shape such as 32/8x128, nor a "
                         f"readable Hugging Face config ({type(exc).__name__})") from None
    hq = cfg.num_attention_heads
    hkv = getattr(cfg, "num_key_value_heads", None) or hq
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // hq
    return int(hq), int(hkv), int(d)


def build_sites(args) -> list:
    from attnopt.site import AttentionSite

    from .explain import parse_context

    contexts = [None] if args.symbolic else [parse_context(c) for c in args.context.split(",") if c.strip()]
    sites = []
    for spec in args.shapes:
        hq, hkv, d = resolve_heads(spec)
        for b in _ints(args.batch, "batch"):
            for q_len in _ints(args.q_len, "q-len"):
                if q_len > 16:
                    raise ValueError(f"--q-len {q_len}: decode-time attention has at most 16 query tokens")
                for n in contexts:
                    sites.append(AttentionSite(
                        node="tune", module_path=spec, pattern="sdpa", batch=b, q_heads=hq, kv_heads=hkv,
                        head_dim=d, q_len=q_len, kv_len=n, kv_len_hint=None,
                        dtype=args.dtype, mask_kind=args.mask, gqa_source="enable_gqa" if hq != hkv else "mha"))
    return sites


def layers_of(spec: str, explicit: int | None) -> int:
    """Sites per decode step that share one mask: ``explicit``, else the preset's or Hugging Face config's layer
    count, else 1."""
    if explicit is not None:
        if explicit < 1:
            raise ValueError(f"--layers {explicit}: must be >= 1")
        return explicit
    if spec in PRESET_LAYERS:
        return PRESET_LAYERS[spec]
    if SHAPE_RE.fullmatch(spec):
        return 1
    try:
        from transformers import AutoConfig

        return int(getattr(AutoConfig.from_pretrained(spec), "num_hidden_layers", 1) or 1)
    except Exception:  # noqa: BLE001 - resolve_heads already reported an unreadable spec
        return 1


def tune_sites(sites, tuner, hw, ctx, layers: dict[str, int] | None = None) -> list[dict[str, Any]]:
    """Plan every site with ``tuner``; one result row per site. ``layers``: per ``site.module_path`` (the spec),
    the sites sharing one valid-length computation (default 1)."""
    from attnopt.config import OptimizeConfig
    from attnopt.passes.plan import plan_site

    rows = []
    for site in sites:
        report = plan_site(site, hw, ctx, OptimizeConfig(), tuner, (layers or {}).get(site.module_path, 1))
        chosen = report.chosen
        rows.append({"model": site.module_path, "shape": site.shape_str(), "mask": site.mask_kind,
                     "plan": chosen.describe() if chosen else None, "choice": report.choice,
                     "predicted_us": None if chosen is None or math.isnan(chosen.est_us) else chosen.est_us,
                     "measured_us": None if math.isnan(report.measured_us) else report.measured_us})
    return rows


def check_args(args) -> None:
    """Raise ``ValueError`` for a malformed argument, before anything else (the GPU check included): the lengths,
    batch sizes, query lengths, budget and layer count, and every preset or bare shape. A Hugging Face config name
    is read when the shapes are built (reading one may wait on the network)."""
    from .explain import parse_context

    if args.layers is not None and args.layers < 1:
        raise ValueError(f"--layers {args.layers}: must be >= 1")
    if args.budget is not None and not (math.isfinite(args.budget) and args.budget > 0):
        raise ValueError(f"--budget {args.budget}: must be a positive number of seconds")
    if not args.symbolic:
        if not [parse_context(c) for c in args.context.split(",") if c.strip()]:
            raise ValueError(f"--context {args.context!r}: expected comma-separated lengths such as 8k,32k")
    _ints(args.batch, "batch")
    for q_len in _ints(args.q_len, "q-len"):
        if q_len > 16:
            raise ValueError(f"--q-len {q_len}: decode-time attention has at most 16 query tokens")
    for spec in args.shapes:
        if spec in PRESETS or SHAPE_RE.fullmatch(spec):
            resolve_heads(spec)


def run(args) -> int:
    import torch

    check_args(args)
    if not torch.cuda.is_available():
        print("attnopt tune: tuning times plans on a CUDA GPU, and this machine has none. Without a GPU the "
              "planner uses the cost model alone (see `attnopt explain`); run `attnopt tune` on the machine "
              "that will run the model.", file=sys.stderr)
        return 2
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from attnopt.hardware import resolve_profile
    from attnopt.runtime.kernels import triton_usable
    from attnopt.runtime.strategies import PlanContext
    from attnopt.tuning import Tuner, TuningCache, gpu_timer

    sites = build_sites(args)
    hw = resolve_profile(None)
    ctx = PlanContext(device_type="cuda", triton_available=triton_usable("cuda"),
                      extras={"graphed": not getattr(args, "no_graphs", False)})
    console = Console(stderr=True)
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("tuning", total=len(sites))

        def timer(plan, site):
            bar.update(task, description=f"{site.shape_str()}: {plan.kind}")
            return gpu_timer(plan, site)
        timer.release = gpu_timer.release  # the tuner frees the timer's input sets after each shape
        # a masked site's valid length; host time without graphs; the candidates' compiles at once; a growing
        # cache's cuDNN call at a new length
        for extra in ("valid_len_us", "host_us", "warm_up", "fresh_length_us"):
            if hasattr(gpu_timer, extra):
                setattr(timer, extra, getattr(gpu_timer, extra))

        tuner = Tuner(timer, TuningCache(), budget_s=args.budget)
        layers = {spec: layers_of(spec, args.layers) for spec in args.shapes}
        rows = []
        for site in sites:
            rows += tune_sites([site], tuner, hw, ctx, layers)
            bar.advance(task)
    if args.json:
        import json

        print(json.dumps({"cache": str(tuner.cache.path), "rows": rows}, indent=1))
        return 0
    table = Table(title=f"tuned on {torch.cuda.get_device_name()} (cache {tuner.cache.path})", title_justify="left")
    for col in ("model", "shape", "mask", "plan", "choice", "predicted µs", "measured µs"):
        table.add_column(col, overflow="fold")
    for r in rows:
        table.add_row(r["model"], r["shape"], r["mask"], r["plan"] or "-", r["choice"],
                      "-" if r["predicted_us"] is None else f"{r['predicted_us']:.1f}",
                      "-" if r["measured_us"] is None else f"{r['measured_us']:.1f}")
    Console().print(table)
    return 0


__all__ = ["register", "run", "check_args", "build_sites", "tune_sites", "resolve_heads", "layers_of", "PRESETS", "PRESET_LAYERS"]
