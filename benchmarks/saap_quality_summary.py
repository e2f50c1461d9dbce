"""The SAAP quality curve's results (``saap_quality_gpu``): per curve (method, index configuration, dense layers) the
best setting under each total selectivity of ``CURVE_TARGETS`` with its passkey results and the done-when verdict,
the passkey operating points, the join of several runs of one evaluation (``--merge``) and the printed report.
"""
from __future__ import annotations

import copy
import math
from pathlib import Path

#: The curve: total selectivities (every attended key of every layer over all keys) that the summary and the passkey
#: report the best setting under. With layer 0 dense (the paper's rule) 2 % is out of reach: one dense layer of
#: SmolLM2's 30 alone reads 3.3 % of the keys; an index over every layer ("a" in the spec) reaches it.
CURVE_TARGETS = (0.02, 0.05, 0.10, 0.20)
#: What the decode kernel runs (the rest are bounds and baselines): the query MLP, or centroid scoring.
DEPLOYABLE = ("mlp", "centroids")


def nearest(rows: list[dict], method: str, target: float) -> dict | None:
    """The row of ``method`` with the best agreement among those at measured total selectivity (every layer,
    the dense layer 0 included) <= target; None when none is (the target is out of reach)."""
    under = [r for r in rows if r["method"] == method and r["selectivity_all_layers"] <= target]
    return max(under, key=lambda r: (r["next_token_agreement"], -r["perplexity"])) if under else None


def _total(passkey_row: dict) -> float:
    """A passkey row's selectivity over every layer (its own field, else from the sparse layers' with SmolLM2's
    one dense layer of 30)."""
    if "selectivity_all_layers" in passkey_row:
        return passkey_row["selectivity_all_layers"]
    return (29 * passkey_row.get("selectivity", 0.0) + 1) / 30


def _group(row: dict) -> tuple:
    """What a curve is drawn for: method, index configuration (None: partition-free) and dense layers."""
    return row["method"], row.get("clusters"), row.get("dense_layers", 1)


def summarize(results: dict) -> list[dict]:
    """Per curve (method, index configuration, dense layers; in the order the rows came): the best agreement at
    measured total selectivity <= each of ``CURVE_TARGETS`` that any setting reached, with the passkey results of
    that operating point and the done-when verdict (the deployable methods' rows, ``DEPLOYABLE``, at <= 10 %)."""
    summary = []
    dense = [r for r in results["rows"] if r["method"] == "dense"]
    dense_ppl = dense[0]["perplexity"] if dense else math.nan
    dense_rate = {r["length"]: r["found"] / r["trials"] for r in results["passkey"] if r["method"] == "dense"}
    groups = list(dict.fromkeys(_group(r) for r in results["rows"] if r["method"] != "dense"))
    for group in groups:
        m = group[0]
        rows = [r for r in results["rows"] if _group(r) == group]
        for target in CURVE_TARGETS:
            r = nearest(rows, m, target)
            if r is None:
                continue
            pk = sorted((p for p in results["passkey"] if _group(p) == group
                         and (p.get("point_window"), p.get("point_probes")) == (r["window"], r["probes"])),
                        key=lambda p: p["length"])
            row = {"method": m, "clusters": group[1], "dense_layers": group[2], "at_most": target,
                   "window": r["window"], "probes": r["probes"], "selectivity": r["selectivity_all_layers"],
                   "selectivity_sparse_layers": r["selectivity"], "recall": r["recall"],
                   "agree": r["next_token_agreement"], "ppl_vs_dense": r["perplexity"] / dense_ppl - 1,
                   "passkey": " ".join(f"{p['found']}/{p['trials']}" for p in pk) or "-",
                   "passkey_selectivity": " ".join(f"{_total(p):.3f}" for p in pk) or "-"}
            row["done"] = bool(m in DEPLOYABLE and target == 0.10 and r["selectivity_all_layers"] <= 0.10
                               and row["agree"] >= 0.95 and row["ppl_vs_dense"] <= 0.03 and pk
                               and all(p["found"] / p["trials"] >= dense_rate.get(p["length"], 0)
                                       and _total(p) <= target + 0.005 for p in pk))
            summary.append(row)
    return summary


def passkey_points(rows: list[dict], methods: list[str]) -> list[tuple[str, int, int, float]]:
    """(method, window, probes, target): each method's operating point under each curve target it reaches, once
    per point (a point that is the best under two targets runs once, under the lower)."""
    points: list[tuple[str, int, int, float]] = []
    for m in methods:
        for t in CURVE_TARGETS:
            r = nearest(rows, m, t)
            if r is not None and (m, r["window"], r["probes"]) not in {p[:3] for p in points}:
                points.append((m, r["window"], r["probes"], t))
    return points


#: Fields the runs merged into one curve must share (same model, text, decode tail and sink).
MERGE_KEYS = ("model", "context", "tail", "sink", "eval_sequences", "train_sequences")


def merge(parts: list[dict]) -> dict:
    """One results dict from runs of the same evaluation (``MERGE_KEYS``) over different index configurations:
    their rows, passkeys and indexes together, one dense row and one dense passkey per length (the first run's; the
    others' dense perplexity must be within 1e-3 of it, and where theirs differ at all ``dense_differences`` says
    so), the summary redone.
    ``ValueError`` naming the field when they are not the same evaluation or both ran one configuration."""
    if not parts:
        raise ValueError("nothing to merge")
    first = parts[0]
    for i, part in enumerate(parts[1:], 1):
        for key in MERGE_KEYS:
            if part.get(key) != first.get(key):
                raise ValueError(f"run {i} differs from run 0 in {key!r}: {part.get(key)!r} vs {first.get(key)!r}")
        twice = set(part["indexes"]) & set(first["indexes"])
        if twice:
            raise ValueError(f"run {i} repeats index configuration(s) {', '.join(sorted(twice))} of an earlier run")
    out = copy.deepcopy(first)
    dense = next(r for r in out["rows"] if r["method"] == "dense")
    dense_pk = {r["length"]: r for r in out["passkey"] if r["method"] == "dense"}
    for i, part in enumerate(parts[1:], 1):
        other = next(r for r in part["rows"] if r["method"] == "dense")
        if not math.isclose(other["perplexity"], dense["perplexity"], rel_tol=1e-3):
            raise ValueError(f"run {i}'s dense perplexity {other['perplexity']} differs from run 0's "
                             f"{dense['perplexity']}: not the same evaluation")
        differ = [f"run {i}: dense perplexity {other['perplexity']}"] * (other["perplexity"] != dense["perplexity"])
        differ += [f"run {i}: dense passkey at {r['length']} found {r['found']}/{r['trials']}" for r in part["passkey"]
                   if r["method"] == "dense" and r["length"] in dense_pk
                   and (r["found"], r["trials"]) != (dense_pk[r["length"]]["found"], dense_pk[r["length"]]["trials"])]
        if differ:  # the same evaluation on the same GPU: the runs' own dense results, kept beside the first's
            out.setdefault("dense_differences", []).extend(differ)
        out["rows"] += [r for r in part["rows"] if r["method"] != "dense"]
        out["passkey"] += [r for r in part["passkey"] if r["method"] != "dense" or r["length"] not in dense_pk]
        out["indexes"].update(part["indexes"])
        out["passkey_points"].update(part.get("passkey_points", {}))
        out["skipped"] += [f"run {i}: {s}" for s in part.get("skipped", [])]
        out["seconds"] = max(out.get("seconds", 0), part.get("seconds", 0))
    out["args"] = [p["args"] for p in parts]
    if len(parts) > 1:  # timed beside another evaluation on the same GPU: not the build's cost alone
        out["timing_beside_other_runs"] = {k: out.pop(k) for k in ("prefill_s", "index_build_s",
                                                                     "index_build_first_s") if k in out}
    out["summary"] = summarize(out)
    return out


def report(results: dict, out_path: Path) -> None:
    """Print the dense baseline, the build timing, what was skipped and the summary table (last)."""
    dense = [r for r in results["rows"] if r["method"] == "dense"]
    dense_pk = {r["length"]: f"{r['found']}/{r['trials']}" for r in results["passkey"] if r["method"] == "dense"}
    print(f"dense: ppl {dense[0]['perplexity'] if dense else math.nan:.3f}; passkey found "
          + ", ".join(f"{n}: {f}" for n, f in sorted(dense_pk.items())))
    if "index_build_s" in results:  # the first configuration's build at prefill, against the dense prefill
        print(f"prefill {results['prefill_s']:.3f} s; index build {results['index_build_s']:.3f} s "
              f"({results['index_build_s'] / results['prefill_s']:.1%} of it; the first build in the process "
              f"{results.get('index_build_first_s', math.nan):.3f} s)")
    if results["skipped"]:
        print("skipped: " + "; ".join(results["skipped"]))
    print(f"wrote {out_path} ({results.get('seconds', 0):.0f} s)")
    from attnopt.bench.common import format_table

    print(format_table(results["summary"], [
        ("method", "method", ""), ("clusters", "C", ""), ("dense_layers", "dense layers", ""),
        ("at_most", "sel<=", ".2f"), ("window", "window", ""), ("probes", "probes", ""),
        ("selectivity", "sel", ".3f"), ("recall", "recall", ".3f"), ("agree", "agree", ".3f"),
        ("ppl_vs_dense", "ppl +", ".3f"), ("passkey", "passkey", ""), ("passkey_selectivity", "passkey sel", ""),
        ("done", "done", "")]))
