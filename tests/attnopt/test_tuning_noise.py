"""How the measured choice (``attnopt.tuning``) holds up to timing noise and what it costs: the close candidates
re-timed in alternating order (the duel), the third round only for those still close after two, and a long call's
cheaper timing (``attnopt.timer``); on the CPU with fake timers, the timer's own sizing on a GPU."""
import os
import sys

import pytest

from attnopt import tuning
from attnopt import tuning_rounds as rounds
from attnopt.site import AttentionSite
from attnopt.tuning import ShapeKey, Tuner

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_tuning_method import ENV, Scripted, _ranked, cache  # noqa: E402,F401  (cache: the fixture)

SITE = AttentionSite.canonical()


def _scripted(series: dict[str, list[float]], default: float):
    """A timer giving each key its series of samples in turn (the last one repeated), ``default`` for the rest."""
    return Scripted(lambda plan, site, n: (series.get(plan.runtime_key()) or [default])[
        min(n, len(series.get(plan.runtime_key()) or [default]) - 1)])


def test_a_near_tie_decided_by_one_sample_is_timed_again_in_alternating_order(cache):
    """Two candidates 1.5 % apart after the rounds (the fourth sample is the model's pick's, timed beside its grid
    siblings) are timed DUEL_ROUNDS more times each, in alternating order, and the median of all samples decides:
    the one ahead by lucky samples loses."""
    ranked = _ranked(SITE)
    plans = tuning.to_time(ranked, tuning.DEFAULT_TOP_K)
    lucky = plans[0].runtime_key()
    steady = next(p for p in plans if getattr(p, "backend", "") == "cudnn").runtime_key()
    timer = _scripted({lucky: [10.0, 10.4, 9.9, 9.9, 10.4, 10.4, 10.4, 10.4],
                       steady: [10.1, 10.1, 10.1, 10.1, 10.1, 10.1, 10.1]}, 14.0)
    choice = Tuner(timer, cache, env=ENV).choose(SITE, ranked)
    record = cache.get(ENV, ShapeKey.of(SITE, SITE.kv_len, False))
    assert record["duel"] == [lucky, steady] and record["duel_rounds"] == rounds.DUEL_ROUNDS
    duel_calls = [k for k in timer.calls if k in (lucky, steady)][-2 * rounds.DUEL_ROUNDS:]
    assert duel_calls == [steady, lucky, lucky, steady] * (rounds.DUEL_ROUNDS // 2)  # ABBA
    beside = 1 + bool(record.get("twins"))  # timed beside the grid siblings, and beside its twins where it has any
    assert len(record["samples"][lucky]) == 3 + rounds.DUEL_ROUNDS + beside
    assert choice.plan.runtime_key() == steady and choice.measured_us == pytest.approx(10.1)


def test_no_duel_where_the_winner_is_clear(cache):
    ranked = _ranked(SITE)
    plans = tuning.to_time(ranked, tuning.DEFAULT_TOP_K)
    fast = plans[0].runtime_key()
    timer = _scripted({fast: [8.0]}, 10.0)
    choice = Tuner(timer, cache, env=ENV).choose(SITE, ranked)
    record = cache.get(ENV, ShapeKey.of(SITE, SITE.kv_len, False))
    assert choice.plan.runtime_key() == fast and "duel" not in record
    assert record["rounds"] == 1  # nobody within PRUNE of it: no second round either


def test_duel_keys():
    from attnopt.plan import DensePlan, SplitKVPlan

    plans = {"a": SplitKVPlan(num_splits=2), "b": SplitKVPlan(num_splits=4), "c": SplitKVPlan(num_splits=8),
             "d": SplitKVPlan(num_splits=16), "cudnn": DensePlan(backend="cudnn")}
    assert rounds.duel_keys({"a": 10.0, "b": 10.1, "c": 10.15, "d": 10.16, "cudnn": 10.19}, plans) == \
        ["a", "b", "c", "cudnn"]  # TIE_MAX closest, and the fastest dense plan within DUEL_WITHIN
    assert rounds.duel_keys({"a": 10.0, "cudnn": 10.3}, plans) == ["a"]  # 3 % apart: nothing to decide
    assert rounds.duel_keys({}, plans) == []


def test_the_third_round_times_only_the_candidates_still_close(cache):
    """After two rounds, a candidate more than PRUNE_LATE behind the best's median of two is not timed again."""
    ranked = _ranked(SITE)
    plans = tuning.to_time(ranked, tuning.DEFAULT_TOP_K)
    keys = [p.runtime_key() for p in plans]
    best, near, behind = keys[0], keys[1], keys[2]
    timer = _scripted({best: [10.0], near: [10.3], behind: [11.0]}, 12.0)  # 3 %, 10 % and (the rest) 20 % behind
    Tuner(timer, cache, env=ENV).choose(SITE, ranked)
    n = len(keys)
    assert timer.calls[n:n + 3] == [best, near, behind]  # round 2: within PRUNE (the 12.0 µs ones are not)
    assert timer.calls[n + 3:n + 5] == [best, near] and timer.calls.count(behind) == 2  # round 3


@pytest.mark.cuda
def test_a_long_call_is_captured_in_few_calls_after_one_eager_estimate():
    """captured_calls_estimated: a call of long_ms or more is sized by one timed call and captured ``floor`` times
    (one per input set at least); a short one as captured_calls always did."""
    import torch

    from attnopt.bench.common import captured_calls_estimated, sleep_cycles

    cycles = sleep_cycles(3.0)
    graph, n, est = captured_calls_estimated(lambda: torch.cuda._sleep(cycles), target_ms=2.0, min_calls=1,
                                             floor=2, long_ms=1.0)
    assert n == 2 and est > 1.0
    x = torch.zeros(16, device="cuda")
    graph, n, est = captured_calls_estimated(lambda: x.add_(1), target_ms=2.0, min_calls=1, floor=2, long_ms=1.0)
    assert est < 1.0 and n > 4


def _ranker(calls: list):
    def rank(at):
        calls.append(at.kv_len)
        return _ranked(at)
    return rank


def test_the_layers_of_a_model_share_one_bucketed_tuning(cache):
    """30 sites of one shape (a decoder's layers) and a growing cache: the first tunes every bucket, each other one
    ranks the hint's bucket once and takes the same plan, timing nothing."""
    import dataclasses

    site = AttentionSite.canonical(q_heads=9, kv_heads=3, head_dim=64, kv_len=None, kv_len_hint=8192)
    timer = Scripted(lambda plan, s, n: 5.0 if plan.kind == "dense" else 4.0 + s.kv_len / 1e4)
    tuner = Tuner(timer, cache, env=ENV)
    ranks: list = []
    first = tuner.choose_bucketed(dataclasses.replace(site, node="layers.0"), _ranker(ranks))
    timed, ranked_first = len(timer.calls), len(ranks)
    assert first.choice == "measured" and timed > 0 and ranked_first >= len(tuning.BUCKETS)
    for layer in range(1, 30):
        other = tuner.choose_bucketed(dataclasses.replace(site, node=f"layers.{layer}", module_path=f"m.{layer}"),
                                      _ranker(ranks))
        assert other.plan == first.plan and other.choice == "cached"
    assert len(timer.calls) == timed and len(ranks) == ranked_first + 29
    # another valid-length sharing (or other options, which rank other candidates) is not the same tuning
    tuner.choose_bucketed(site, _ranker(ranks), valid_len_sharing=2)
    assert len(ranks) > ranked_first + 30


def _buckets_called(monkeypatch, method: str) -> list:
    """Spy on ``Tuner.<method>(self, x, at, ...)``: the list of the buckets of ``at.kv_len`` it was called at."""
    called, original = [], getattr(Tuner, method)

    def spy(self, x, at, *args, **kw):
        called.append(tuning.bucket_of(at.kv_len))
        return original(self, x, at, *args, **kw)
    monkeypatch.setattr(Tuner, method, spy)
    return called


def test_grid_siblings_and_duels_only_near_the_hint(cache, monkeypatch):
    site = AttentionSite.canonical(batch=7, q_heads=4, kv_heads=2, head_dim=96, kv_len=None, kv_len_hint=3264)
    seen = _buckets_called(monkeypatch, "_time_siblings")
    dueled = _buckets_called(monkeypatch, "_duel")
    timer = Scripted(lambda plan, s, n: 20.0 if plan.kind == "dense" else 10.0 + hash(plan.runtime_key()) % 7 / 10)
    Tuner(timer, cache, env=ENV).choose_bucketed(site, _ranked)
    h = tuning.BUCKETS.index(tuning.bucket_of(3264))
    near = [tuning.BUCKETS[i] for i in range(h - tuning.NEAR_HINT_BUCKETS, h + tuning.NEAR_HINT_BUCKETS + 1)]
    assert sorted(seen) == near and sorted(dueled) == near
