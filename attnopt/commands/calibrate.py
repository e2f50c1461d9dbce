"""``attnopt calibrate``: measure the local GPU, fit the cost model, cache the profile; ``--validate`` scores
the planner's choices against measurements and writes a results JSON (suite ``cost_model``)."""
from __future__ import annotations

import json
import re
import sys


def register(sub) -> None:
    p = sub.add_parser("calibrate", help="measure this GPU, fit the cost model and cache the profile",
                       description=__doc__)
    p.add_argument("--profile", default=None,
                   help="datasheet profile to start the fit from (default: the one matching this GPU)")
    p.add_argument("--no-save", action="store_true", help="fit and print, but do not write the profile cache")
    p.add_argument("--show", action="store_true",
                   help="print the profile the planner uses on this machine (calibrated cache first) and exit")
    p.add_argument("--validate", action="store_true",
                   help="after calibrating, measure every candidate over the kernel bench grid plus random shapes "
                        "and report how good the chosen plans are (writes --out)")
    p.add_argument("--use-cached", action="store_true",
                   help="with --validate: reuse the cached calibrated profile instead of calibrating again")
    p.add_argument("--out", default=None,
                   help="validation results JSON (default: benchmarks/results/cost_model-<device>.json)")
    p.add_argument("--calibrate-budget", type=float, default=None,
                   help="seconds of calibration measurement before it stops starting new shapes (default: all)")
    p.add_argument("--from-samples", default=None, metavar="FILE",
                   help="refit and cache the profile from measurements saved by --samples-out, measuring nothing "
                        "(after a cost-model change, or on another machine)")
    p.add_argument("--samples-out", default=None,
                   help="also write every calibration measurement (site, plan, µs) to this JSON file")
    p.add_argument("--random", type=int, default=20, help="random shapes added to the kernel grid (default 20)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random shapes")
    p.add_argument("--budget", type=float, default=110.0, help="seconds of validation measurement before it stops")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def check_args(args) -> None:
    """Raise ``ValueError`` for a malformed argument before anything is measured (or the GPU is even looked for):
    the starting profile, the budgets, the random shape count, and the folders the results go to."""
    import math

    from attnopt.checks import writable_file
    from attnopt.hardware import builtin_names

    if args.profile is not None and args.profile not in builtin_names():
        raise ValueError(f"--profile {args.profile!r}: the datasheet profile to start the fit from; valid names: "
                         f"{', '.join(builtin_names())}")
    for flag, value in (("--calibrate-budget", args.calibrate_budget), ("--budget", args.budget)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ValueError(f"{flag} {value}: must be a positive number of seconds")
    if args.random < 0:
        raise ValueError(f"--random {args.random}: must be >= 0")
    for flag, path in (("--out", args.out), ("--samples-out", args.samples_out)):
        if path is not None:
            writable_file(flag, path)


def run(args) -> int:
    from rich.console import Console

    check_args(args)

    from attnopt import calibrate as cal
    from attnopt.hardware import builtin_profile, cached_profile_path, detect_profile, load_cached_profile, \
        resolve_profile, save_profile

    console = Console()
    if args.show:
        hw = resolve_profile(None)
        console.print(f"profile used on this machine: {hw.describe()} ({hw.source})")
        print(hw.to_json())
        return 0
    if args.from_samples:
        try:
            data = json.loads(open(args.from_samples).read())
        except (OSError, json.JSONDecodeError) as exc:
            raise SystemExit(f"attnopt calibrate: cannot read {args.from_samples}: {exc}") from exc
        try:
            fitted = cal.refit_from_samples(data, builtin_profile(args.profile) if args.profile else None)
        except ValueError as exc:
            raise SystemExit(f"attnopt calibrate: {args.from_samples}: {exc}") from exc
        f = fitted.fitted
        console.print(f"refit {int(f['samples'])} measurements: RMS log error {f['rmse_log_before']:.3f} -> "
                      f"{f['rmse_log_after']:.3f}; memory latency {fitted.mem_latency_us} µs")
        if not args.no_save:
            console.print(f"saved the calibrated profile to {save_profile(fitted, fitted.device_name)}")
        print(fitted.to_json())
        if not args.validate:
            return 0
    cal.require_cuda()
    import torch

    device = torch.cuda.get_device_name(0)
    base = builtin_profile(args.profile) if args.profile else detect_profile()
    if args.from_samples:
        console.print(f"validating the profile refit from {args.from_samples}")
    elif args.validate and args.use_cached and load_cached_profile(device) is not None:
        fitted = load_cached_profile(device)
        console.print(f"using the cached calibrated profile {cached_profile_path(device)}")
    else:
        fitted, info = cal.calibrate(base, progress=not args.quiet, budget_s=args.calibrate_budget)
        console.print(f"fitted {int(info['samples'])} measurements of {len(info['shape_seconds'])} shapes in "
                      f"{info['seconds']:.0f} s: RMS log error {info['rmse_log_before']:.3f} -> "
                      f"{info['rmse_log_after']:.3f}; memory latency {fitted.mem_latency_us} µs")
        if info["skipped"]:
            console.print(f"[yellow]not measured (calibration budget): {len(info['skipped'])} shapes[/yellow]")
        if not args.no_save:
            path = save_profile(fitted, device)
            console.print(f"saved the calibrated profile to {path}")
        if args.samples_out:
            from attnopt.bench.common import results_header, write_results

            path = write_results(args.samples_out, {**results_header("calibration_samples"),
                                                    "profile": fitted.to_dict(), "samples": info["samples_list"],
                                                    "shape_seconds": info["shape_seconds"],
                                                    "skipped": info["skipped"]})
            console.print(f"wrote {len(info['samples_list'])} calibration measurements to {path}")
        print(fitted.to_json())
    if not args.validate:
        return 0
    from attnopt.bench.common import results_header, write_results

    uncal = detect_profile()
    body = cal.validate(fitted, uncal, random_count=args.random, seed=args.seed, budget_s=args.budget,
                        progress=not args.quiet)
    results = results_header("cost_model", copy_bw_TBps=fitted.copy_gbps / 1e3, read_bw_TBps=fitted.hbm_read_gbps / 1e3,
                             profile_calibrated=fitted.to_dict(), profile_uncalibrated=uncal.to_dict())
    results.update(_finite(body))
    slug = re.sub(r"[^A-Za-z0-9]+", "-", device).strip("-").lower()
    path = write_results(args.out or f"benchmarks/results/cost_model-{slug}.json", results)
    s = body["summary"]
    for label in ("calibrated", "uncalibrated"):
        if label in s:
            r = s[label]
            console.print(f"{label:>12}: within 5 % on {100 * r['within_5_frac']:.0f} % of {s['shapes']} shapes, "
                          f"within 15 % on {100 * r['within_15_frac']:.0f} %, worst {r['worst_slowdown']:.2f}x, "
                          f"Spearman mean {r['spearman_mean']:.2f}")
    s = _finite(s)
    if body["skipped"]:
        console.print(f"[yellow]not measured (budget or failures): {', '.join(body['skipped'])}[/yellow]")
    console.print(f"wrote {path}")
    json.dump(s, sys.stdout, indent=1)
    print()
    return 0


def _finite(obj):
    """``obj`` with NaN/inf floats replaced by None, so the results file is strict JSON."""
    import math

    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj
