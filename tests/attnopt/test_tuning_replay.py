"""The measured choice replayed on the CPU from an H100 run: each case's tuning record (every candidate's median µs at
the length its site runs at) drives a fake timer, and the tuner's current rules must time only what the run timed and
keep the run's winner. What changes which plans are timed (the sibling and twin rules) is checked against measured
times here, not only against made-up ones."""
import json
import os
import sys

import pytest

from attnopt.bench import planner_grid as G
from attnopt.plan import DensePlan
from attnopt.site import AttentionSite
from attnopt.tuning import ShapeKey, Tuner, TuningCache

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_tuning_method import ENV, _ranked  # noqa: E402

RUN = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "results", "experiments",
                   "planner-cases-nvidia-h100-ef39938.json")
#: µs a candidate the run did not time is given: it cannot win, and the test says it was timed.
UNTIMED = 1e4


def _cases():
    with open(RUN) as f:
        rows = json.load(f)["rows"]
    out = []
    for row in rows:
        if row["method"] != "attnopt:planner" or row["cache"] not in ("dynamic", "fixed"):
            continue  # (a static cache's choice is also judged at a low fill, which the record does not time)
        b, hq, hkv, d, n, q, cache = G.case_of(row["case"])
        dynamic = cache == "dynamic"
        # the length the site runs at: a fixed cache's, a growing cache's hint rounded up to 16 keys (its bucket)
        record = next(t for t in row["tuning"] if not t["late"] and 0 <= t["kv_len"] - n < (16 if dynamic else 1))
        out.append(pytest.param(row["case"], (b, hq, hkv, d, q, cache), record, id=row["case"]))
    return out


@pytest.mark.parametrize("case,shape,record", _cases())
def test_the_current_rules_keep_the_h100_runs_winner(tmp_path, monkeypatch, case, shape, record):
    # that run had no swap-AB candidates (SWAP_AB_TWINS on since 9ff0ebf): the rules replayed are the rest
    from attnopt.runtime.strategies import split_kv as split_kv_strategy
    monkeypatch.setattr(split_kv_strategy, "SWAP_AB_TWINS", False)
    b, hq, hkv, d, q, cache = shape
    dynamic = cache == "dynamic"
    site = AttentionSite.canonical(batch=b, q_heads=hq, kv_heads=hkv, head_dim=d, kv_len=record["kv_len"], q_len=q)
    ranked = _ranked(site)
    key_of = {p.describe(): p.runtime_key() for p in ranked}
    measured = {key_of[name]: us for name, us in record["timings"].items() if isinstance(us, float)}

    def timer(plan, s):
        if dynamic and isinstance(plan, DensePlan) and plan.backend == "cudnn":
            return UNTIMED  # built per KV length: the run skipped it (a new length costs it ~55 ms)
        return measured.get(plan.runtime_key(), UNTIMED)
    cache_file = TuningCache(str(tmp_path / "t.json"))
    choice = Tuner(timer, cache_file, env=ENV).choose(site, ranked, bucketed=dynamic)
    timed = cache_file.get(ENV, ShapeKey.of(site, site.kv_len, dynamic))["timings"]
    assert not [k for k, us in timed.items() if us == UNTIMED and "cudnn" not in k], "timed what the run did not"
    assert choice.plan.describe() == record["winner"] and choice.measured_us == pytest.approx(record["measured_us"])
