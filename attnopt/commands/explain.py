"""``attnopt explain``: rank every plan for one attention shape with the real planner and the cost model.

Single GPU::

    attnopt explain --batch 1 --heads 32/8 --head-dim 128 --context 131072 [--plot FILE.png] [--measure]

Multi-GPU (tree vs ring over a sequence-sharded KV cache, simulated on a topology)::

    attnopt explain --heads 16 --head-dim 128 --context 5120000 --gpus 128 --topology dgx-h100x16 --plot FILE.png

The GPU strategies are ranked as if the site ran on CUDA with Triton (``device_type="cuda"``), whatever this
machine has; the output says so. ``--measure`` (CUDA only) adds measured times.

The multi-GPU ranking, simulation and paper check are in ``explain_multi``.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Any

from attnopt.site import MASK_KINDS

from .explain_multi import PAPER_FIRST_CALL_S, _print_multi, explain_multi, simulation  # noqa: F401  (re-exported)

DTYPES = ("bfloat16", "float16", "float32")


def register(sub) -> None:
    p = sub.add_parser("explain", help="rank every plan for an attention shape (cost model + planner)",
                       description=__doc__, formatter_class=__import__("argparse").RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=1, help="batch size B (default 1)")
    p.add_argument("--heads", default="32/8", help="query/KV heads, e.g. 32/8 (GQA) or 16 (MHA); default 32/8")
    p.add_argument("--head-dim", type=int, default=128, help="head dim D (default 128)")
    p.add_argument("--context", default="131072",
                   help="KV length: an integer, or with a suffix k (x1024) or M (x1024^2); default 131072")
    p.add_argument("--q-len", type=int, default=1, help="query tokens per step (default 1)")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="dtype of Q/K/V (default bfloat16)")
    p.add_argument("--mask", default="none", choices=MASK_KINDS, help="mask kind of the site (default none)")
    p.add_argument("--symbolic", action="store_true",
                   help="plan for a symbolic KV length, with --context as the trace-time hint")
    p.add_argument("--profile", default=None,
                   help="hardware profile name or .json path (default: this machine's, calibrated first; "
                        "h100-sxm on a machine without a GPU)")
    p.add_argument("--gpus", type=int, default=1, help="ranks the KV cache is sharded over (default 1)")
    p.add_argument("--topology", default=None, help="topology for --gpus > 1 (default: this machine's)")
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="plot predicted latency vs context (one GPU), or tree's speed-up over ring vs context "
                        "for several GPU counts (--gpus > 1)")
    p.add_argument("--measure", action="store_true", help="also run every candidate on this GPU (CUDA only)")
    p.add_argument("--out", default=None, metavar="FILE.json",
                   help="with --gpus > 1: write the tree-vs-ring simulation as a results JSON (suite cost_model)")
    p.add_argument("--json", action="store_true", help="print the explanation as JSON instead of tables")
    p.set_defaults(func=run)


# --------------------------------------------------------------------------------------------- parsing
def parse_heads(text: str) -> tuple[int, int]:
    """``"32/8"`` -> (32, 8); ``"16"`` -> (16, 16). ``ValueError`` when Hq is not a multiple of Hkv."""
    m = re.fullmatch(r"\s*(\d+)\s*(?:/\s*(\d+)\s*)?", text)
    if not m:
        raise ValueError(f"--heads {text!r}: expected Hq/Hkv such as 32/8, or one number for MHA")
    hq = int(m.group(1))
    hkv = int(m.group(2)) if m.group(2) else hq
    if hq < 1 or hkv < 1:
        raise ValueError(f"--heads {text!r}: head counts must be >= 1")
    if hq % hkv:
        raise ValueError(f"--heads {text!r}: query heads ({hq}) must be a multiple of KV heads ({hkv}) "
                         "for grouped-query attention")
    return hq, hkv


#: The longest KV length a what-if may name: the kernels keep a row's valid length and key positions in int32
#: (``runtime/kernels/valid_len.py``), so a longer cache is not one any plan here could run.
MAX_CONTEXT = 2 ** 31 - 1
#: The largest batch a what-if may name (one int32 grid axis of programs per batch row and KV head at least).
MAX_BATCH = 2 ** 31 - 1


def parse_context(text: str) -> int:
    """``"131072"``, ``"128k"`` (x1024), ``"1M"`` (x1024^2), ``"5120000"``; from 1 to ``MAX_CONTEXT``."""
    valid = f"1 to {MAX_CONTEXT} keys (2^31 - 1)"
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*", str(text))
    if not m:
        raise ValueError(f"--context {text!r}: expected a length such as 131072, 128k or 1M, from {valid}")
    value = float(m.group(1)) * {"": 1, "k": 1024, "m": 1024 ** 2}[m.group(2).lower()]
    if not 1 <= value <= MAX_CONTEXT:
        raise ValueError(f"--context {text!r}: the KV length must be from {valid}")
    return int(round(value))


def build_site(args):
    from attnopt.site import AttentionSite

    hq, hkv = parse_heads(args.heads)
    n = parse_context(args.context)
    if args.batch < 1 or args.q_len < 1 or args.head_dim < 1:
        raise ValueError("--batch, --q-len and --head-dim must be >= 1")
    if args.batch > MAX_BATCH:
        raise ValueError(f"--batch {args.batch}: valid from 1 to {MAX_BATCH} (2^31 - 1)")
    if args.q_len > 16:
        raise ValueError(f"--q-len {args.q_len}: decode-time attention has at most 16 query tokens")
    if not args.symbolic and n <= args.q_len:  # detect's rule: the optimizer leaves such a site alone
        raise ValueError(f"--context {args.context} with --q-len {args.q_len}: a KV length that is not longer than the "
                         "query is prefill, which attnopt leaves alone; give a --context > --q-len")
    return AttentionSite(node="explain", module_path="explain", pattern="sdpa", batch=args.batch, q_heads=hq,
                         kv_heads=hkv, head_dim=args.head_dim, q_len=args.q_len,
                         kv_len=None if args.symbolic else n, kv_len_hint=n if args.symbolic else None,
                         dtype=args.dtype, mask_kind=args.mask, is_causal=args.mask == "causal",
                         gqa_source="enable_gqa" if hq != hkv else "mha")


def pick_profile(name: str | None, topology=None):
    """(profile, note): the named profile, else the topology's device, else this machine's (h100-sxm without a GPU)."""
    import torch

    from attnopt.hardware import builtin_profile, resolve_profile

    if name:
        return resolve_profile(name), ""
    if topology is not None and topology.device != "cpu":
        return builtin_profile(topology.device), f"profile of topology {topology.name}'s devices"
    if torch.cuda.is_available():
        return resolve_profile(None), "this machine's GPU"
    return builtin_profile("h100-sxm"), "no GPU here: using the h100-sxm datasheet profile (pass --profile to change)"


# --------------------------------------------------------------------------------------------- single GPU
def explain_single(site, hw) -> dict[str, Any]:
    from attnopt.config import OptimizeConfig
    from attnopt.cost import kernel as K
    from attnopt.passes.plan import plan_site
    from attnopt.runtime.strategies import PlanContext

    ctx = PlanContext(world_size=1, device_type="cuda", triton_available=True)
    report = plan_site(site, hw, ctx, OptimizeConfig())
    roof = K.roofline_us(site if site.kv_len is not None else dataclasses.replace(site, kv_len=site.kv_len_hint), hw)
    cands = [{"plan": c.describe(), "kind": c.kind, "est_us": c.est_us,
              "frac_of_roofline": roof / c.est_us if c.est_us > 0 else None, "chosen": c is report.chosen,
              "json": c.to_dict()} for c in report.candidates]
    notes = []
    kernel_rejects = [r for r in report.rejected if r.kind in ("split_kv", "stream_k")]
    if kernel_rejects and report.chosen is not None and report.chosen.kind == "dense":
        notes.append("the attnopt kernels do not apply here, so the site falls back to dense (SDPA): "
                     + "; ".join(f"{r.kind}: {r.reason}" for r in kernel_rejects))
    if site.kv_len is None:
        for choice in (K.best_split_kv(site, hw), K.best_stream_k(site, hw)):
            notes.append(f"symbolic length: {choice.kind} is chosen over lengths {list(choice.lengths)}; runtime rule: "
                         f"{choice.rule}")
    return {"mode": "single", "site": site.to_dict(), "profile": hw.describe(), "roofline_us": roof,
            "candidates": cands, "rejected": [dataclasses.asdict(r) for r in report.rejected],
            "chosen": report.chosen.to_dict() if report.chosen else None, "notes": notes, "_report": report}


def latency_curves(site, hw, lengths) -> dict[str, list[float]]:
    """Per plan kind, the best predicted µs at each length (the planner's candidates), plus the roofline."""
    from attnopt.config import OptimizeConfig
    from attnopt.cost import kernel as K
    from attnopt.passes.plan import plan_site
    from attnopt.runtime.strategies import PlanContext

    ctx = PlanContext(world_size=1, device_type="cuda", triton_available=True)
    curves: dict[str, list[float]] = {"roofline": []}
    for i, n in enumerate(lengths):
        s = dataclasses.replace(site, kv_len=int(n), kv_len_hint=None)
        rep = plan_site(s, hw, ctx, OptimizeConfig())
        curves["roofline"].append(K.roofline_us(s, hw))
        for c in rep.candidates:
            ys = curves.setdefault(c.kind, [math.nan] * len(lengths))
            ys[i] = c.est_us if math.isnan(ys[i]) else min(ys[i], c.est_us)
    return curves


def plot_single(path: str, site, hw, measured_curves: dict[str, dict[int, float]] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n0 = site.effective_kv_len
    lengths = sorted({2 ** i for i in range(10, 22)} | {int(n0)})
    curves = latency_curves(site, hw, lengths)
    fig, ax = plt.subplots(figsize=(7.5, 5))
    for kind, ys in curves.items():
        style = dict(ls="--", color="gray") if kind == "roofline" else dict(marker=".")
        ax.plot(lengths, ys, label=kind if kind != "roofline" else "roofline (bytes / read BW)", **style)
    for kind, pts in (measured_curves or {}).items():
        xs = sorted(pts)
        ax.plot(xs, [pts[x] for x in xs], "x", ms=8, label=f"{kind} measured")
    ax.axvline(n0, color="k", lw=0.8, alpha=0.4)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("KV length (tokens)")
    ax.set_ylabel("predicted latency (µs)")
    ax.set_title(f"B={site.batch} H={site.q_heads}/{site.kv_heads} D={site.head_dim} q={site.q_len} {site.dtype} "
                 f"on {hw.describe()}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


# --------------------------------------------------------------------------------------------- measure
def measure(site, info: dict[str, Any]) -> dict[str, float]:
    """Measured µs per candidate (CUDA only)."""
    from attnopt import calibrate as cal
    from attnopt.plan import plan_from_dict

    try:
        cal.require_cuda()
    except ValueError:
        raise ValueError("--measure needs a CUDA GPU and none is visible here; drop --measure to see predictions only") from None
    if site.kv_len is None:
        site = dataclasses.replace(site, kv_len=site.kv_len_hint)
    plans = [plan_from_dict(c["json"]) for c in info["candidates"]]
    return cal.measure_site(site, plans)


#: Lengths at which ``--plot --measure`` measures the best-predicted plan of each kind.
MEASURE_LENGTHS = (4096, 16384, 65536, 262144)


def measure_curves(site, hw, info: dict[str, Any], measured: dict[str, float]) -> dict[str, dict[int, float]]:
    """Measured µs per plan kind along the plot: at the site's length the best measured candidate of each kind,
    at ``MEASURE_LENGTHS`` the kind's best-predicted candidate (CUDA only; lengths whose K/V would not fit in
    a quarter of the GPU memory are skipped)."""
    from attnopt import calibrate as cal
    from attnopt.cost import kernel as K

    n0 = int(site.effective_kv_len)
    curves: dict[str, dict[int, float]] = {}
    for c in info["candidates"]:
        if c["plan"] in measured:
            cur = curves.setdefault(c["kind"], {})
            cur[n0] = min(cur.get(n0, math.inf), measured[c["plan"]])
    for n in MEASURE_LENGTHS:
        s = dataclasses.replace(site, kv_len=n, kv_len_hint=None)
        if n == n0 or (hw.memory_bytes and K.kv_bytes(s) > hw.memory_bytes / 4):
            continue
        per_kind = {}
        for c in explain_single(s, hw)["candidates"]:
            per_kind.setdefault(c["kind"], c)
        from attnopt.plan import plan_from_dict

        got = cal.measure_site(s, [plan_from_dict(c["json"]) for c in per_kind.values()])
        for kind, c in per_kind.items():
            if c["plan"] in got:
                curves.setdefault(kind, {})[n] = got[c["plan"]]
    return curves


# --------------------------------------------------------------------------------------------- output
def _print_single(info: dict[str, Any], measured: dict[str, float] | None, assumed: str) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(120, Console().width))
    site = info["site"]
    console.print(f"[bold]attnopt explain[/bold]: B={site['batch']} H={site['q_heads']}/{site['kv_heads']} "
                  f"D={site['head_dim']} q_len={site['q_len']} N={site['kv_len'] or 'sym(' + str(site['kv_len_hint']) + ')'} "
                  f"{site['dtype']} mask={site['mask_kind']}")
    console.print(f"profile: {info['profile']}" + (f" — {assumed}" if assumed else ""))
    console.print("strategies ranked as on a CUDA device with Triton (device_type='cuda'), whatever this machine has")
    console.print(f"roofline (bytes / read bandwidth): {info['roofline_us']:.2f} µs")
    table = Table(title="candidates, fastest first", show_lines=False)
    for col in ("#", "plan", "predicted µs", "% of roofline") + (("measured µs",) if measured else ()):
        table.add_column(col, justify="right" if col != "plan" else "left")
    for i, c in enumerate(info["candidates"], 1):
        mark = " [green](chosen)[/green]" if c["chosen"] else ""
        row = [str(i), c["plan"] + mark, f"{c['est_us']:.2f}",
               f"{100 * c['frac_of_roofline']:.0f} %" if c["frac_of_roofline"] else "-"]
        if measured:
            row.append(f"{measured[c['plan']]:.2f}" if c["plan"] in measured else "-")
        table.add_row(*row)
    console.print(table)
    if info["rejected"]:
        console.print("[bold]rejected[/bold]:")
        for r in info["rejected"]:
            console.print(f"  {r['kind']}: {r['reason']}")
    for note in info["notes"]:
        console.print(f"note: {note}")


def _jsonable(info: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in info.items() if not k.startswith("_")}


def check_outputs(args) -> None:
    """``--plot`` and ``--out`` name files that can be written, the plot's with a format matplotlib writes (matplotlib
    adds ``.png`` to a name without one, and fails only after the ranking on one it does not know)."""
    from attnopt.checks import writable_file

    for flag, path in (("--plot", args.plot), ("--out", args.out)):
        if path is not None:
            writable_file(flag, path)
    if args.plot is not None:
        from matplotlib.backend_bases import FigureCanvasBase

        formats = sorted(FigureCanvasBase.get_supported_filetypes())
        if os.path.splitext(args.plot)[1][1:].lower() not in formats:
            raise ValueError(f"--plot {args.plot!r}: the file name must end in one of .{', .'.join(formats)}")


def run(args) -> int:
    from attnopt.topology import resolve_topology

    check_outputs(args)
    site = build_site(args)
    if args.gpus < 1:
        raise ValueError(f"--gpus must be >= 1, got {args.gpus}")
    if args.gpus > 1:
        if args.measure:
            raise ValueError("--measure runs one GPU's kernels; it does not apply with --gpus > 1 "
                             "(use `attnopt bench multigpu` on the machines)")
        topo = resolve_topology(args.topology, args.gpus)
        topo.check_world(args.gpus)
        hw, assumed = pick_profile(args.profile, topo)
        if site.kv_len is None:
            site = dataclasses.replace(site, kv_len=site.kv_len_hint, kv_len_hint=None)
        info = explain_multi(site, hw, topo, args.gpus)
        sim = simulation(site, hw, topo, args.gpus) if (args.plot or args.out) else None
        if args.plot:
            from .explain_plot import plot_multi

            plot_multi(args.plot, site, hw, topo, sim)
        if args.out:
            from attnopt.bench.common import git_commit, write_results

            import torch

            results = {"suite": "cost_model", "device": "simulation", "world_size": args.gpus,
                       "torch": torch.__version__, "triton": _triton_version(), "commit": git_commit(),
                       "profile": hw.to_dict(), "topology": topo.to_dict(), "site": site.to_dict(),
                       "explain": _jsonable(info), **{k: v for k, v in sim.items() if k != "rows"},
                       "rows": [{"case": f"{r['gpus']}gpu-{r['N']}", "B": site.batch, "Hq": site.q_heads,
                                 "Hkv": site.kv_heads, "D": site.head_dim, "N": r["N"], "dtype": site.dtype,
                                 "method": "cost_model:tree_vs_ring", **r} for r in sim["rows"]]}
            write_results(args.out, results)
        if args.json:
            out = _jsonable(info)
            if sim:
                out["simulation"] = sim
            print(json.dumps(out, indent=1))
        else:
            _print_multi(info, sim, assumed)
            if args.plot:
                print(f"wrote {args.plot}")
            if args.out:
                print(f"wrote {args.out}")
        return 0
    if args.topology:
        raise ValueError("--topology only applies with --gpus > 1")
    if args.out:
        raise ValueError("--out writes the multi-GPU simulation; it needs --gpus > 1")
    hw, assumed = pick_profile(args.profile)
    info = explain_single(site, hw)
    measured = measure(site, info) if args.measure else None
    if args.plot:
        mcurves = measure_curves(site, hw, info, measured) if measured is not None else None
        plot_single(args.plot, site, hw, mcurves)
    if args.json:
        out = _jsonable(info)
        out["assumed"] = assumed
        if measured is not None:
            out["measured_us"] = measured
        print(json.dumps(out, indent=1))
    else:
        _print_single(info, measured, assumed)
        if args.plot:
            print(f"wrote {args.plot}")
    return 0


def _triton_version() -> str | None:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return None
