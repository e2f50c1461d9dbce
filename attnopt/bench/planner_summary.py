"""The planner bench's results: one case's summary against its best peer, the overall figures over the cases, the
printed table, and the join of several ``--part`` runs' files (``attnopt bench planner --merge``)."""
from __future__ import annotations

import statistics
from typing import Any

from .planner_grid import STATIC_CHECK_CASE, STATIC_CHECK_MIN, geomean
from .planner_timing import growing_us

#: Relative error above which a row does not count (bf16 outputs land near 3e-3).
REL_ERR_OK = 2e-2


def row_error(row: dict[str, Any]) -> float | None:
    """A row's relative error: the worse of its first call's (``rel_err``) and, where measured, that of the variant
    the timing replays (``rel_err_captured``); None when not measured."""
    errors = [row[k] for k in ("rel_err", "rel_err_captured") if row.get(k) is not None]
    return max(errors) if errors else None


def summarize(case_name: str, case, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One case's summary: our rows against the best peer (ratio = best peer µs / ours; >= 1 is faster)."""
    ok = [r for r in rows if r.get("us") and (row_error(r) if row_error(r) is not None else 1.0) < REL_ERR_OK]
    peers = [r for r in ok if r["peer"]]
    ours = {r["method"]: r for r in rows if not r["peer"]}
    planner = ours.get("attnopt:planner", {})
    s = {"case": case_name, "cache": case[6], "plan": planner.get("plan"), "choice": planner.get("choice"),
         "compile_s": planner.get("compile_s"), "tune_s": planner.get("tune_s"), "attnopt_us": planner.get("us"),
         "frac_of_roofline": planner.get("frac_of_roofline"), "error": planner.get("error")}
    # an attnopt row whose output is off: the worst result this bench can show, never only a missing ratio
    wrong = {m: row_error(r) for m, r in ours.items() if row_error(r) is not None and not row_error(r) < REL_ERR_OK}
    if wrong:
        s["wrong_answer"] = {m: {"rel_err": e, "plan": ours[m].get("plan")} for m, e in wrong.items()}
    if not peers:
        return s
    best = min(peers, key=lambda r: r["us"])
    s.update(best_peer=best["method"], best_peer_us=best["us"])
    for r in rows:
        if r.get("us"):
            r["ratio_to_best_peer"] = best["us"] / r["us"]
    for method, key in (("attnopt:planner", "ratio_to_best_peer"), ("attnopt:model", "model_ratio_to_best_peer")):
        r = ours.get(method)
        if r and r in ok:
            s[key] = best["us"] / r["us"]
    if "attnopt:model" in ours:
        s.update(model_plan=ours["attnopt:model"].get("plan"), model_us=ours["attnopt:model"].get("us"),
                 model_compile_s=ours["attnopt:model"].get("compile_s"))
    # per step of a growing cache: a peer that builds something per length (cuDNN) pays it every step
    growing = [r for r in peers if growing_us(r)]
    if planner in ok and growing:
        best_growing = min(growing, key=growing_us)
        s.update(best_growing_peer=best_growing["method"],
                 growing_ratio_to_best_peer=growing_us(best_growing) / growing_us(planner))
    sdpa = [r for r in peers if r["method"].startswith("sdpa")]
    if case[6] == "static" and sdpa and planner in ok:  # a nearly full cache (static-full) has nothing to skip
        s["speedup_vs_sdpa_full_cache"] = min(r["us"] for r in sdpa) / planner["us"]
    return s


def overall(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """Over the cases with a ratio: min, geometric mean, the count >= 0.99 and the worst case, for the tuned pick
    and the model's (``model_*``); the attnopt rows whose output is off (``wrong_answers``, ``wrong``: case and
    method -> rel err and plan); the static-cache check; first-call seconds."""
    out: dict[str, Any] = {"cases": len(summaries)}
    for key, prefix in (("ratio_to_best_peer", ""), ("model_ratio_to_best_peer", "model_"),
                        ("growing_ratio_to_best_peer", "growing_")):
        ratios = {s["case"]: s[key] for s in summaries if s.get(key)}
        if not ratios:
            continue
        worst = min(ratios, key=ratios.get)
        out.update({f"{prefix}with_ratio": len(ratios), f"{prefix}min_ratio": ratios[worst],
                    f"{prefix}worst_case": worst, f"{prefix}geomean_ratio": geomean(ratios.values()),
                    f"{prefix}at_least_0_99": sum(r >= 0.99 for r in ratios.values())})
    wrong = {f"{s['case']} {m}": w for s in summaries for m, w in (s.get("wrong_answer") or {}).items()}
    out["wrong_answers"] = len(wrong)
    if wrong:
        out["wrong"] = wrong
    static = [s for s in summaries if s.get("speedup_vs_sdpa_full_cache")]
    if static:
        out["static_speedup_vs_sdpa_full_cache_min"] = min(s["speedup_vs_sdpa_full_cache"] for s in static)
    check = next((s for s in summaries if s["case"] == STATIC_CHECK_CASE), None)
    if check is not None and check.get("speedup_vs_sdpa_full_cache"):
        out["static_check"] = {"case": STATIC_CHECK_CASE, "speedup": check["speedup_vs_sdpa_full_cache"],
                               "pass": check["speedup_vs_sdpa_full_cache"] >= STATIC_CHECK_MIN}
    for key in ("compile_s", "tune_s"):
        values = [s[key] for s in summaries if s.get(key) is not None]
        if values:
            out.update({f"{key}_median": statistics.median(values), f"{key}_max": max(values)})
    return out


def print_summary(results: dict[str, Any]) -> None:
    """The per-case table (ratio = best peer µs / ours: >= 1 is faster) and the overall line."""
    from .common import format_table

    print("\nsummary (ratio = best peer / attnopt; model = the cost model's pick alone; roof = floor / attnopt)")
    print(format_table(results.get("summary", []), [
        ("case", "case", ""), ("best_peer", "best peer", ""), ("best_peer_us", "peer µs", ".1f"),
        ("attnopt_us", "tuned µs", ".1f"), ("ratio_to_best_peer", "ratio", ".3f"), ("model_us", "model µs", ".1f"),
        ("model_ratio_to_best_peer", "model ratio", ".3f"), ("growing_ratio_to_best_peer", "growing", ".3f"),
        ("frac_of_roofline", "roof", ".2f"),
        ("compile_s", "first s", ".1f"), ("tune_s", "tune s", ".1f"), ("speedup_vs_sdpa_full_cache", "vs full", ".1f"),
        ("choice", "choice", ""),
        ("plan", "plan", ""), ("error", "error", "")]))
    for name, w in ((results.get("overall") or {}).get("wrong") or {}).items():
        print(f"WRONG ANSWER {name}: rel err {w['rel_err']:.3g} (over {REL_ERR_OK:g}), plan {w.get('plan')}")
    print("\noverall:", results.get("overall"), "skipped:", len(results.get("skipped_cases", [])))


def parse_part(text: str) -> tuple[int, int]:
    """``"I/K"`` -> (I, K) with 0 <= I < K; a clear error otherwise."""
    try:
        i, k = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"--part {text!r}: expected I/K such as 0/2") from None
    if not 0 <= i < k:
        raise ValueError(f"--part {text!r}: need 0 <= I < K")
    return i, k


def merge(paths: list[str]) -> dict[str, Any]:
    """One results dict from the files of several ``--part`` runs: the first file's header, every file's rows,
    summaries and skipped cases (less those another file timed: a ``--cases`` run of one part's skipped cases
    completes it), the overall recomputed, and each part's commit and elapsed seconds."""
    import json

    parts = [json.loads(open(p).read()) for p in paths]
    out = {k: v for k, v in parts[0].items() if k not in ("rows", "summary", "overall", "skipped_cases", "elapsed_s")}
    out["parts"] = [{"file": p, "commit": d.get("commit"), "device": d.get("device"), "elapsed_s": d.get("elapsed_s"),
                     "cases": len(d.get("summary", []))} for p, d in zip(paths, parts)]
    out["rows"] = [r for d in parts for r in d.get("rows", [])]
    out["summary"] = [s for d in parts for s in d.get("summary", [])]
    timed = {s["case"] for s in out["summary"]}
    out["skipped_cases"] = [c for d in parts for c in d.get("skipped_cases", []) if c not in timed]
    out["overall"] = overall(out["summary"])
    return out


def tuning_records(before: dict[str, Any], after: dict[str, Any]) -> list[dict[str, Any]]:
    """The measurements a case added to the tuning cache (``after`` less ``before``, two ``TuningCache.load()``), in
    short: the timed KV length, whether it stands for a bucket, the winner and each candidate's µs (or why it has
    none) by ``describe()``, the near-tied candidates' µs at other lengths (a bucket's ends, a static cache's low
    fill), the rounds, each candidate's samples, the seconds it took and of those the warm-up's (the compiles), the
    timing's and the tie-break's, whether it was a bucket past
    the compile deadline (``late``: only what was compiled timed), a growing cache's cuDNN call at a new length
    against a known one (``fresh_length_us``: [new µs, known µs]), and what was timed after the rounds
    (``after_rounds``: grid siblings, near siblings, twins, the duel; ``after_rounds_warm_up_s``). Sorted by length."""
    import json

    from attnopt.plan import plan_from_dict, plan_from_json

    def name(key: str) -> str:
        try:
            return plan_from_json(key).describe()
        except (TypeError, ValueError):
            return key

    out = []
    for key, record in after.items():
        if key in before:
            continue
        shape = json.loads(key).get("shape", {})
        timings = record.get("timings", {})
        out.append({"kv_len": shape.get("kv_len"), "bucketed": shape.get("bucketed"),
                    "winner": plan_from_dict(record["winner"]).describe() if "winner" in record else None,
                    "measured_us": record.get("measured_us"), "rounds": record.get("rounds"),
                    "tune_s": record.get("tune_s"), "warm_up_s": record.get("warm_up_s"),
                    "late": bool(record.get("late")), "measure_s": record.get("measure_s"),
                    "tie_break_s": record.get("tie_break_s"),
                    # each candidate's samples in the order taken (round by round, then any re-timing): what the
                    # choice's noise and pruning are judged by
                    "samples": {name(k): [round(float(x), 3) for x in v] for k, v in (record.get("samples") or {}).items()},
                    "fresh_length_us": {name(k): v for k, v in (record.get("fresh_length_us") or {}).items()},
                    "timings": {name(k): v for k, v in sorted(timings.items(), key=_fastest_first)},
                    "near_tie_us": {n: {name(k): v for k, v in by.items()}
                                    for n, by in (record.get("span_us") or {}).items()},
                    # what was timed after the rounds, by name, and the seconds its compiles took
                    "after_rounds": {what: [name(k) for k in record[what]] for what in _AFTER_ROUNDS
                                     if record.get(what)},
                    "after_rounds_warm_up_s": {what: record[what] for what in _AFTER_ROUNDS_WARM_UP
                                               if record.get(what) is not None}})
    return sorted(out, key=lambda r: (r["kv_len"] or 0))


#: The tuning record's lists of what was timed after the rounds (``attnopt.tuning_rounds``), and their warm-ups' seconds.
_AFTER_ROUNDS = ("grid_siblings", "near_siblings", "twins", "duel")
_AFTER_ROUNDS_WARM_UP = ("siblings_warm_up_s", "near_warm_up_s", "twins_warm_up_s")


def _fastest_first(item: tuple[str, Any]) -> tuple[bool, float]:
    value = item[1]
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return (not number, float(value) if number else 0.0)
