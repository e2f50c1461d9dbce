"""The pure half of calibration (no GPU): the kernel cost model's prediction per plan, the fits of its constants
and per-configuration factors to measured samples, and the validation math (rank correlation, choice scores).

``attnopt.calibrate`` measures on the GPU and calls these; tests run them on the CPU.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from attnopt.cost import kernel as kernel_cost
from attnopt.hardware import HardwareProfile
from attnopt.plan import DensePlan, Plan, SplitKVPlan, StreamKPlan
from attnopt.site import AttentionSite


# --------------------------------------------------------------------------------------------- prediction
def predict_us(site: AttentionSite, plan: Plan, hw: HardwareProfile, valid_len: int | None = None) -> float:
    """The kernel cost model's time for ``plan`` at ``site`` (dense, split-KV or stream-K).

    ``valid_len``: the keys actually valid in a static cache of ``site.kv_len`` slots. SDPA (dense) reads every
    slot and masks; the attnopt kernels read only the valid prefix, so they are predicted at ``valid_len``."""
    if isinstance(plan, DensePlan):
        return kernel_cost.dense_us(site, hw)
    # the grid of a split-KV plan that follows the cache's length is sized by its slots, not by the valid keys
    splits = plan.splits_at(site.effective_kv_len or 1) if isinstance(plan, SplitKVPlan) else 0
    if valid_len is not None:
        site = dataclasses.replace(site, kv_len=int(valid_len))
    if isinstance(plan, SplitKVPlan):
        return kernel_cost.split_kv_us(site, hw, splits, plan.block_n, plan.num_warps, plan.num_stages)
    if isinstance(plan, StreamKPlan):
        return kernel_cost.stream_k_us(site, hw, plan.grid, plan.block_n, plan.num_warps, plan.num_stages)
    raise ValueError(f"the kernel cost model has no formula for plan kind {plan.kind!r}; "
                     "valid: dense, split_kv, stream_k")


@dataclass(frozen=True)
class Sample:
    """One measured (site, plan) pair: ``us`` is the measured median time per call."""

    site: AttentionSite
    plan: Plan
    us: float

    def to_dict(self) -> dict[str, Any]:
        return {"site": self.site.to_dict(), "plan": self.plan.to_dict(), "us": self.us}


# --------------------------------------------------------------------------------------------- fitting
@dataclass(frozen=True)
class FitParam:
    """A fitted constant: where it lives and its bounds (searched in log space)."""

    name: str
    lo: float
    hi: float
    #: ``field`` = a HardwareProfile field; ``fitted`` = a key of ``HardwareProfile.fitted``.
    where: str = "field"


FIT_PARAMS: tuple[FitParam, ...] = (
    FitParam("kernel_efficiency", 0.15, 1.0),
    FitParam("dense_efficiency", 0.1, 1.2),
    FitParam("mem_latency_us", 0.1, 8.0),
    FitParam("per_tile_us", 1e-4, 1.0),
    # Bounds relative to the fair share hbm_read_gbps / sm_count (set per profile in ``fit_profile``).
    FitParam("sm_read_gbps", 0.5, 16.0),
    FitParam("launch_us", 0.5, 20.0),
    FitParam("stream_k_fixup_us", 0.05, 30.0, where="fitted"),
)


def _get(hw: HardwareProfile, p: FitParam) -> float:
    if p.where == "fitted":
        return float(hw.fitted.get(p.name, kernel_cost.STREAM_K_FIXUP_US))
    if p.name == "sm_read_gbps":
        return hw.sm_gbps()
    return float(getattr(hw, p.name))


def _apply(hw: HardwareProfile, params: Sequence[FitParam], values: Sequence[float]) -> HardwareProfile:
    fields: dict[str, Any] = {}
    fitted = dict(hw.fitted)
    for p, v in zip(params, values):
        v = min(p.hi, max(p.lo, float(v)))
        if p.where == "fitted":
            fitted[p.name] = v
        else:
            fields[p.name] = v
    return dataclasses.replace(hw, fitted=fitted, **fields)


def log_error(samples: Sequence[Sample], hw: HardwareProfile) -> float:
    """Mean squared log error of the model's predictions against the measurements."""
    if not samples:
        raise ValueError("no samples to score")
    return sum(math.log(predict_us(s.site, s.plan, hw) / s.us) ** 2 for s in samples) / len(samples)


def nelder_mead(f: Callable[[list[float]], float], x0: Sequence[float], step: float = 0.3, iters: int = 1500,
                tol: float = 1e-10) -> tuple[list[float], float]:
    """Minimise ``f`` from ``x0`` (a small, dependency-free Nelder-Mead). Returns (x, f(x))."""
    n = len(x0)
    simplex = [list(x0)] + [[x + (step if i == j else 0.0) for j, x in enumerate(x0)] for i in range(n)]
    values = [f(x) for x in simplex]
    for _ in range(iters):
        order = sorted(range(n + 1), key=values.__getitem__)
        simplex = [simplex[i] for i in order]
        values = [values[i] for i in order]
        if abs(values[-1] - values[0]) < tol:
            break
        centroid = [sum(x[j] for x in simplex[:-1]) / n for j in range(n)]
        worst = simplex[-1]
        refl = [c + (c - w) for c, w in zip(centroid, worst)]
        fr = f(refl)
        if fr < values[0]:
            exp = [c + 2 * (c - w) for c, w in zip(centroid, worst)]
            fe = f(exp)
            simplex[-1], values[-1] = (exp, fe) if fe < fr else (refl, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = refl, fr
        else:
            con = [c + 0.5 * (w - c) for c, w in zip(centroid, worst)]
            fc = f(con)
            if fc < values[-1]:
                simplex[-1], values[-1] = con, fc
            else:
                best = simplex[0]
                simplex = [best] + [[b + 0.5 * (x - b) for b, x in zip(best, xs)] for xs in simplex[1:]]
                values = [values[0]] + [f(x) for x in simplex[1:]]
    i = min(range(n + 1), key=values.__getitem__)
    return simplex[i], values[i]


def fit_profile(base: HardwareProfile, samples: Sequence[Sample], params: Sequence[FitParam] = FIT_PARAMS,
                restarts: int = 3) -> tuple[HardwareProfile, dict[str, float]]:
    """Fit ``params`` of ``base`` to ``samples``.

    Returns
    -------
    (profile, info)
        The fitted profile (``calibrated`` is left to the caller) and ``{"rmse_log_before", "rmse_log_after",
        "samples"}``.
    """
    if not samples:
        raise ValueError("fit_profile needs at least one measured sample")
    fair = base.hbm_read_gbps / base.sm_count
    params = [dataclasses.replace(p, lo=p.lo * fair, hi=p.hi * fair) if p.name == "sm_read_gbps" else p
              for p in params]

    def to_x(values):
        return [math.log(min(p.hi, max(p.lo, v))) for p, v in zip(params, values)]

    def objective(x):
        vals = [math.exp(v) for v in x]
        penalty = sum(max(0.0, math.log(p.lo) - xi) ** 2 + max(0.0, xi - math.log(p.hi)) ** 2
                      for p, xi in zip(params, x))
        return log_error(samples, _apply(base, params, vals)) + 10.0 * penalty

    before = log_error(samples, base)
    x = to_x([_get(base, p) for p in params])
    best_f = objective(x)
    for r in range(restarts):
        x, best_f = nelder_mead(objective, x, step=0.5 / (r + 1))
    fitted = _apply(base, params, [math.exp(v) for v in x])
    after = log_error(samples, fitted)
    if after > before:  # never hand back a profile that explains the measurements worse than the start
        fitted, after = base, before
    info = {"rmse_log_before": math.sqrt(before), "rmse_log_after": math.sqrt(after), "samples": float(len(samples))}
    return fitted, info


def _fit_affine(pairs: Sequence[tuple[float, float]], shrink: float) -> tuple[float, float]:
    """(factor a, offset b) minimising the squared relative error of ``a * predicted + b`` against measured, with
    ``shrink`` pseudo-samples at (mean predicted, the same) pulling towards (1, 0). Falls back to the geometric
    mean ratio (offset 0) with fewer than three samples, a degenerate system, or a non-positive factor."""
    def ratio_only() -> tuple[float, float]:
        logs = [math.log(m / p) for p, m in pairs]
        return math.exp(sum(logs) / (len(logs) + shrink)), 0.0

    if len(pairs) < 3:
        return ratio_only()
    pbar = sum(p for p, _ in pairs) / len(pairs)
    rows = [(p / m, 1.0 / m, 1.0) for p, m in pairs] + [(1.0, 1.0 / pbar, shrink ** 0.5)] * (1 if shrink else 0)
    sxx = sum(w * w * x * x for x, _, w in rows)
    sxy = sum(w * w * x * y for x, y, w in rows)
    syy = sum(w * w * y * y for _, y, w in rows)
    sx = sum(w * w * x for x, _, w in rows)
    sy = sum(w * w * y for _, y, w in rows)
    det = sxx * syy - sxy * sxy
    if abs(det) <= 1e-12 * max(sxx * syy, 1e-300):
        return ratio_only()
    a = (sx * syy - sy * sxy) / det
    b = (sxx * sy - sxy * sx) / det
    if not (a > 0 and math.isfinite(a) and math.isfinite(b)):
        return ratio_only()
    return a, b


#: Memory latencies (µs) ``fit_calibrated`` tries under the per-configuration factors.
MEM_LATENCY_GRID_US = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0)


def fit_calibrated(base: HardwareProfile, samples: Sequence[Sample],
                   latencies: Sequence[float] = MEM_LATENCY_GRID_US) -> HardwareProfile:
    """The profile ``attnopt calibrate`` saves: per-configuration factors and offsets (``fit_config_factors``) on
    top of the memory latency from ``latencies`` whose fit leaves the smallest log error.

    The latency decides how a small grid's time grows with the bytes each program streams (Little's law), which no
    per-configuration factor can express: a factor scales every grid of one configuration alike. On the H100
    calibration samples (benchmarks/results/calibration-samples-nvidia-h100-73d14e9.json) the fit picks 1.0 µs
    (1.25 µs before SDPA's multi-token bounds were modelled), while the uncalibrated model, without factors,
    ranks plans best at 2.0 µs (the default, see ``HardwareProfile.mem_latency_us``)."""
    if not latencies:
        raise ValueError("fit_calibrated needs at least one memory latency to try")
    fits = [fit_config_factors(dataclasses.replace(base, mem_latency_us=float(m)), samples) for m in latencies]
    return min(fits, key=lambda hw: log_error(samples, hw))


def fit_config_factors(base: HardwareProfile, samples: Sequence[Sample], shrink: float = 1.0) -> HardwareProfile:
    """``base`` with a factor and an offset per kernel configuration in ``fitted`` (``cfg:...``, ``cfgoff:...``):
    the configuration's time is ``factor * model + offset`` (``kernel.config_adjust``).

    Per configuration, the pair minimises the relative error over its samples (``_fit_affine``; ``shrink``
    pseudo-samples pull it towards the model). An offset is what a pure ratio cannot fit: cross-validated on
    the H100 validation set (30 shapes, 5 folds), factor and offset chose within 5 % of the fastest on 90 % of
    the shapes against 77 % for the ratio alone. Each kind also gets its mean ratio (``cfg:<kind>``, no offset)
    for configurations not measured. Dense samples are keyed by the SDPA backend their site reaches (flash
    without a mask tensor, efficient with one).
    """
    if not samples:
        raise ValueError("fit_config_factors needs at least one measured sample")
    plain = dataclasses.replace(base, fitted={k: v for k, v in base.fitted.items()
                                              if not k.startswith((kernel_cost.CONFIG_FACTOR_PREFIX,
                                                                   kernel_cost.CONFIG_OFFSET_PREFIX))})
    pairs: dict[str, list[tuple[float, float]]] = {}
    for smp in samples:
        if isinstance(smp.plan, DensePlan):
            key = kernel_cost.dense_config(smp.site)
        else:
            key = f"{smp.plan.kind}/{smp.plan.block_n}/{smp.plan.num_warps}/{smp.plan.num_stages}"
        pred = predict_us(smp.site, smp.plan, plain)
        if pred > 0 and smp.us > 0:
            pairs.setdefault(key, []).append((pred, smp.us))
    fitted = dict(plain.fitted)
    by_kind: dict[str, list[float]] = {}
    for key, prs in pairs.items():
        a, b = _fit_affine(prs, shrink)
        fitted[kernel_cost.CONFIG_FACTOR_PREFIX + key] = a
        if b:
            fitted[kernel_cost.CONFIG_OFFSET_PREFIX + key] = b
        by_kind.setdefault(key.split("/")[0], []).extend(math.log(m / p) for p, m in prs)
    for kind, vals in by_kind.items():
        fitted[kernel_cost.CONFIG_FACTOR_PREFIX + kind] = math.exp(sum(vals) / (len(vals) + shrink))
    return dataclasses.replace(plain, fitted=fitted)


# --------------------------------------------------------------------------------------------- validation math
def ranks(xs: Sequence[float]) -> list[float]:
    """Average ranks (1-based), ties sharing their mean rank."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    out = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Spearman rank correlation of ``xs`` and ``ys`` (NaN with fewer than 2 points or a constant series)."""
    if len(xs) != len(ys):
        raise ValueError(f"spearman needs equal lengths, got {len(xs)} and {len(ys)}")
    if len(xs) < 2:
        return math.nan
    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    vx = sum((a - mx) ** 2 for a in rx)
    vy = sum((b - my) ** 2 for b in ry)
    if vx == 0 or vy == 0:
        return math.nan
    return cov / math.sqrt(vx * vy)


def score_shape(measured: dict[str, float], predicted: dict[str, dict[str, float]]) -> dict[str, Any]:
    """Score one shape.

    Parameters
    ----------
    measured
        Method (plan description) -> measured µs, for every candidate that ran.
    predicted
        Profile label (``calibrated``, ``uncalibrated``) -> method -> predicted µs.

    Returns
    -------
    dict
        ``fastest`` and ``fastest_us``; per profile label: ``chosen``, ``chosen_us``, ``slowdown`` (chosen
        measured / fastest measured), ``within_5``, ``within_15`` and ``spearman``.
    """
    if not measured:
        raise ValueError("score_shape needs at least one measured method")
    fastest = min(measured, key=measured.get)
    out: dict[str, Any] = {"fastest": fastest, "fastest_us": measured[fastest], "methods": len(measured)}
    for label, pred in predicted.items():
        common = [m for m in measured if m in pred]
        if not common:
            raise ValueError(f"profile {label!r} predicts none of the measured methods")
        chosen = min(common, key=pred.get)
        slow = measured[chosen] / measured[fastest]
        out[label] = {"chosen": chosen, "chosen_us": measured[chosen], "slowdown": slow,
                      "within_5": slow <= 1.05, "within_15": slow <= 1.15,
                      "spearman": spearman([pred[m] for m in common], [measured[m] for m in common])}
    return out


def summarize_validation(scores: Sequence[dict[str, Any]], labels: Iterable[str] = ("calibrated", "uncalibrated")) -> dict[str, Any]:
    """Aggregate ``score_shape`` results: per profile, the fraction of shapes within 5 % and 15 %, the worst
    slowdown, and the mean and median Spearman correlation; plus the issue's pass/fail verdicts."""
    out: dict[str, Any] = {"shapes": len(scores)}
    for label in labels:
        rows = [s[label] for s in scores if label in s]
        if not rows:
            continue
        rhos = sorted(r["spearman"] for r in rows if not math.isnan(r["spearman"]))
        out[label] = {
            "within_5_frac": sum(r["within_5"] for r in rows) / len(rows),
            "within_15_frac": sum(r["within_15"] for r in rows) / len(rows),
            "worst_slowdown": max(r["slowdown"] for r in rows),
            "spearman_mean": sum(rhos) / len(rhos) if rhos else math.nan,
            "spearman_median": rhos[len(rhos) // 2] if rhos else math.nan,
        }
    if "calibrated" in out:
        c = out["calibrated"]
        out["pass_calibrated"] = c["within_5_frac"] >= 0.9 and c["worst_slowdown"] <= 1.15
    if "uncalibrated" in out:
        out["pass_uncalibrated"] = out["uncalibrated"]["within_15_frac"] >= 0.8
    return out
