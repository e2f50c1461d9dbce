"""``attnopt bench multigpu``'s summary of its rows, per case: the tree's overhead over local attention, ring over
tree, the cost model's predicted / measured ratios and whether it picked the fastest of the planner's candidates
(``TREE`` x ``RING``)."""
from __future__ import annotations

import math
from typing import Any

#: The planner's candidates that the bench times: tree collectives and ring variants.
TREE = ("all_gather", "all_reduce", "all_reduce3")
RING = ("pass_kv", "pass_q")


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per case: tree overhead over local attention, ring/tree ratio, whether the model picked right."""
    out = {}
    for case in dict.fromkeys(r["case"] for r in rows):
        rs = [r for r in rows if r["case"] == case and r["us"] is not None]

        def get(method, mode):
            return next((r["us"] for r in rs if r["method"] == method and r["mode"] == mode), None)

        s: dict[str, Any] = {}
        for mode in ("eager", "graph"):
            # tree time minus the local attention it runs (flash, or split_kv for the @split_kv row)
            pairs = [(f"tree:{c}", "local:flash") for c in TREE] + [("tree:symm_mem", "local:flash"),
                                                                    ("tree:all_gather@split_kv", "local:split_kv")]
            over = {t: get(t, mode) - get(lk, mode) for t, lk in pairs
                    if get(t, mode) is not None and get(lk, mode) is not None}
            trees = {t: get(t, mode) for t, _ in pairs if get(t, mode) is not None}
            if trees:
                best = min(trees, key=trees.get)
                s[f"best_tree_{mode}"] = best
                s[f"best_tree_us_{mode}"] = trees[best]
            if over:
                least = min(over, key=over.get)
                s[f"tree_overhead_us_{mode}"] = round(over[least], 2)
                s[f"tree_overhead_method_{mode}"] = least
            # the stricter reading: the fastest tree against the fastest local attention of any kind, so that a
            # tree whose own local kernel is slow (host-bound) cannot look cheap against that kernel
            locals_ = [get(lk, mode) for _, lk in pairs if get(lk, mode) is not None]
            if trees and locals_:
                s[f"tree_over_best_local_us_{mode}"] = round(min(trees.values()) - min(locals_), 2)
        for mode in ("eager", "graph"):
            rings = [t for t in (get(f"ring:{v}", mode) for v in RING) if t is not None]
            trees_mode = [t for t in (get(f"tree:{c}", mode) for c in TREE + ("symm_mem",)) if t is not None]
            if rings and trees_mode:
                s[f"ring_over_tree_{mode}"] = round(min(rings) / min(trees_mode), 2)
        s["ring_over_tree"] = s.get("ring_over_tree_graph", s.get("ring_over_tree_eager"))
        trees_all = [r["us"] for r in rs if r["method"].startswith("tree:")]
        # The cost model's error on the planner's candidates: predicted / measured per row.
        ratios = [r["est_us"] / r["us"] for r in rs if r.get("est_us") and r["us"]
                  and r["method"].split(":")[0] in ("tree", "ring") and "@" not in r["method"]]
        if ratios:
            errs = sorted(abs(math.log(x)) for x in ratios)
            s["est_over_measured_min"] = round(min(ratios), 3)
            s["est_over_measured_max"] = round(max(ratios), 3)
            s["est_abs_log_err_median"] = round(errs[len(errs) // 2], 3)
        single = get("single:flash", "graph") or get("single:flash", "eager")
        if single and trees_all:
            s["single_over_tree"] = round(single / min(trees_all), 2)
        picks = [r.get("model_pick_ok") for r in rs if "model_pick_ok" in r]
        if picks:
            s["model_pick_ok"] = all(picks)
        s["max_rel_err"] = max((r["rel_err"] for r in rs if r["rel_err"] is not None), default=None)
        out[case] = s
    return out
