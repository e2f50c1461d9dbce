"""What the measured choice times, and how cheaply (attnopt.tuning, attnopt.timer), on the CPU with fake timers: a
static cache timed full, the most parallel split-KV plan always a candidate, rounds that stop once the ranking is
clear, a symbolic length's buckets timed at their middles from the hint outwards within one shared budget, and one
tuner per process."""
import dataclasses
import os
import sys

import pytest
import torch

from attnopt import timer as T
from attnopt import tuning
from attnopt.plan import SplitKVPlan
from attnopt.site import AttentionSite
from attnopt.tuning import Tuner
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_tuning_method import ENV, _ranked, _untwinned, cache, rounds_only  # noqa: E402,F401  (cache: the fixture, a fresh cache directory)

#: SmolLM2's decode site over the e2e bench's 1k static cache (1024 + 64 slots, a valid-length mask).
SMOL_1K = AttentionSite.canonical(q_heads=9, kv_heads=3, head_dim=64, kv_len=1088, mask_kind="valid_length")


class Clocked:
    """A fake timer: ``rule(plan, site) -> µs``; each call records (runtime key, KV length) and advances the fake
    clock ``now[0]`` by ``cost_s``."""

    def __init__(self, rule, now=None, cost_s=0.0):
        self.rule, self.calls, self.now, self.cost_s = rule, [], now, cost_s

    def __call__(self, plan, site):
        self.calls.append((plan.runtime_key(), site.kv_len))
        if self.now is not None:
            self.now[0] += self.cost_s
        return self.rule(plan, site)


@pytest.mark.parametrize("mask_kind,window", [("valid_length", None), ("arbitrary", None), ("valid_length", 100)])
def test_a_static_cache_is_timed_full(mask_kind, window):
    """The valid length of a static cache is unknown at compile time; the tuner times it where a step is longest,
    full: the mask keeps every key (a window's band ends at the last key) and valid_len is N."""
    site = AttentionSite.canonical(q_heads=4, kv_heads=2, head_dim=64, kv_len=300, dtype="float32", batch=2,
                                   mask_kind=mask_kind, window=window)
    s = T.synthetic_inputs(site, 0, device="cpu")
    assert T.STATIC_FILL == 1.0 and s["valid_len"].tolist() == [300, 300]
    kept = s["mask"][0, 0, 0]
    if window is None:
        assert bool(kept.all())
    else:
        assert kept.nonzero().flatten().tolist() == list(range(200, 300))
        assert s["key_start"].tolist() == [200, 200]
    assert T.synthetic_inputs(AttentionSite.canonical(kv_len=64, dtype="float32"), 0, device="cpu")["mask"] is None


def test_the_most_parallel_split_kv_plan_is_always_a_candidate():
    """At a short KV the one-tile-per-split plan (SmolLM2's 1k site: 17 splits of one 64-key tile) is timed even when
    the top estimates and the further families leave it out."""
    ranked = _untwinned(_ranked(SMOL_1K))
    widest = tuning.most_parallel([p for p in ranked if p.kind != "dense"], SMOL_1K.kv_len)
    assert isinstance(widest, SplitKVPlan) and (widest.splits_at(SMOL_1K.kv_len), widest.block_n) == (17, 64)
    assert widest.runtime_key() != ranked[0].runtime_key()
    for top_k, extra in ((tuning.DEFAULT_TOP_K, tuning.DEFAULT_EXTRA_FAMILIES), (1, 0)):
        keys = [p.runtime_key() for p in tuning.to_time(ranked, top_k, extra, n_keys=SMOL_1K.kv_len)]
        assert widest.runtime_key() in keys and len(keys) == len(set(keys))
    assert len(tuning.to_time(ranked, 1, 0, n_keys=SMOL_1K.kv_len)) == 3  # the model's pick, cuDNN, the widest
    assert tuning.most_parallel([p for p in ranked if p.kind == "dense"]) is None


@pytest.mark.parametrize("site", [SMOL_1K, AttentionSite.canonical()], ids=["smollm2-1k-static", "canonical"])
def test_configurations_come_before_second_grids(site):
    """Timing order: the model's pick, SDPA, the most parallel plan, one plan per configuration, then further grids
    of a configuration already timed (no new configuration after the first repeat)."""
    ranked = _ranked(site)
    plans = tuning.to_time(ranked, tuning.DEFAULT_TOP_K, n_keys=site.kv_len)
    dense = [p for p in plans if p.kind == "dense"]
    assert plans[0].runtime_key() == ranked[0].runtime_key() and all(p.kind == "dense" for p in plans[1:1 + len(dense)])
    widest = tuning.most_parallel([p for p in ranked if p.kind != "dense"], site.kv_len)
    assert plans[1 + len(dense)].runtime_key() == widest.runtime_key()
    families = [tuning._family(p) for p in plans if p.kind != "dense"]
    repeats = [i for i, f in enumerate(families) if f in families[:i]]
    if repeats:
        assert set(families[repeats[0]:]) <= set(families[:repeats[0]])
    assert (site is SMOL_1K) == (not repeats)  # the canonical site has two grids of one configuration


def test_the_budget_reaches_the_most_parallel_plan(cache, monkeypatch):
    """Every timing costs a cold compile's second, the budget is 4 s: SmolLM2's 1k site still times S=17/64/4/3. By
    estimate it is the fifth kernel plan, sixth after cuDNN, which a 4 s budget cut (t = 5 s)."""
    ranked = _untwinned(_ranked(SMOL_1K))
    plans = tuning.to_time(ranked, tuning.DEFAULT_TOP_K)
    now = [0.0]
    monkeypatch.setattr(tuning.time, "perf_counter", lambda: now[0])
    timer = Clocked(lambda p, s: 5.0, now, cost_s=1.0)
    choice = Tuner(timer, cache, env=ENV, budget_s=4.0).choose(SMOL_1K, ranked)
    timed = [k for k, _ in timer.calls]
    assert plans[2].runtime_key() in timed and (plans[2].splits_at(SMOL_1K.kv_len), plans[2].block_n) == (17, 64)
    by_estimate = [p.runtime_key() for p in ranked if p.kind != "dense"]
    assert by_estimate.index(plans[2].runtime_key()) == 4
    assert len(set(timed)) == 5 and sum(str(v).startswith("skipped") for v in choice.timings.values()) == 2


def test_rounds_stop_once_one_candidate_is_clearly_ahead(cache, monkeypatch):
    """Every candidate is timed once; when no other is within PRUNE of the best, no second round runs (the grid
    siblings and twins timed after the rounds: test_tuning_lengths, test_tuning_twins)."""
    rounds_only(monkeypatch)
    ranked = _ranked(SMOL_1K)
    fast = ranked[0].runtime_key()
    timer = Clocked(lambda p, s: 5.0 if p.runtime_key() == fast else 8.0)
    choice = Tuner(timer, cache, env=ENV, rounds=3).choose(SMOL_1K, ranked)
    plans = tuning.to_time(ranked, tuning.DEFAULT_TOP_K)
    assert [k for k, _ in timer.calls] == [p.runtime_key() for p in plans]  # one round
    assert choice.plan.runtime_key() == fast and choice.measured_us == 5.0
    assert cache.get(ENV, tuning.ShapeKey.of(SMOL_1K, 1088, False))["rounds"] == 1


def test_a_candidate_that_falls_behind_in_round_two_leaves_the_rounds(cache, monkeypatch):
    """The close set is recomputed from the medians after every round: B is within PRUNE of A after round 1 (11 vs
    10), not after round 2 (median 12.5), so round 3 would time A alone and does not run (siblings and twins off)."""
    rounds_only(monkeypatch)
    ranked = _ranked(SMOL_1K)
    plans = tuning.to_time(ranked, tuning.DEFAULT_TOP_K)
    a, b = plans[0].runtime_key(), plans[1].runtime_key()
    seen: dict[str, int] = {}

    def rule(p, s):
        k = p.runtime_key()
        seen[k] = seen.get(k, 0) + 1
        if k == a:
            return 10.0
        return (11.0, 14.0, 14.0)[seen[k] - 1] if k == b else 30.0
    timer = Clocked(rule)
    choice = Tuner(timer, cache, env=ENV, rounds=3).choose(SMOL_1K, ranked)
    assert seen[a] == 2 and seen[b] == 2 and all(n == 1 for k, n in seen.items() if k not in (a, b))
    assert choice.plan.runtime_key() == a


def test_a_bucket_is_timed_at_its_geometric_middle():
    assert [tuning.bucket_length(b) for b in tuning.BUCKETS[:4]] == [704, 1472, 2880, 5824]
    for i, b in enumerate(tuning.BUCKETS):
        low = tuning.BUCKETS[i - 1] if i else b // 2
        n = tuning.bucket_length(b)
        assert low < n <= b and n % 64 == 0 and tuning.bucket_of(n) == b
    assert tuning.bucket_length(32, (32, 128)) == 23 and tuning.bucket_length(128, (32, 128)) == 64


def test_buckets_are_tuned_from_the_hint_outwards_within_one_shared_budget(cache, monkeypatch):
    """Each timing costs 1 s of a fake clock, the budget is 4 s of timing a shape (five timings start within it), 12 s
    of compiling for all buckets: the hint's bucket (8k) and its neighbours warm every candidate; the buckets that
    start later compile nothing new: they time
    the model's pick, the SDPA backends and the candidates whose kernels (``compile_key``) an earlier bucket
    compiled, and leave the others out (not even "skipped")."""
    now = [0.0]
    monkeypatch.setattr(tuning.time, "perf_counter", lambda: now[0])
    site = dataclasses.replace(AttentionSite.canonical(), kv_len=None, kv_len_hint=6000)
    timer = Clocked(lambda p, s: 5.0 if p.kind == "dense" else 9.0, now, cost_s=1.0)
    tuner = Tuner(timer, cache, env=ENV, budget_s=4.0)
    started: dict[int, float] = {}

    def rank(at):
        started.setdefault(at.kv_len, now[0])
        return _ranked(at)
    choice = tuner.choose_bucketed(site, rank)
    order = list(dict.fromkeys(n for _, n in timer.calls))
    hint = tuning.BUCKETS.index(8192)
    expect = sorted(range(len(tuning.BUCKETS)), key=lambda i: (abs(i - hint), i))
    assert order == [tuning.hint_length(6000, 8192) if i == hint else tuning.bucket_length(tuning.BUCKETS[i])
                     for i in expect]  # the hint's bucket at the hint, the others at their middle
    compiled: set[str] = set()
    left_out = 0
    for n in order:
        plans = tuning.to_time(_ranked(dataclasses.replace(site, kv_len=n, kv_len_hint=None)), tuning.DEFAULT_TOP_K)
        timed = {k for k, m in timer.calls if m == n}
        if started[n] <= tuning.BUCKETED_BUDGET_FACTOR * 4.0:  # all warmed; the 4 s budget times the first five
            warmed = plans
            assert timed == {p.runtime_key() for p in plans[:5]}
        else:
            warmed = [p for i, p in enumerate(plans) if i < 2 or p.kind == "dense" or tuning.compile_key(p) in compiled]
            assert timed == {p.runtime_key() for p in warmed[:5]}
            left_out += len(plans) - len(warmed)
        compiled |= {tuning.compile_key(p) for p in warmed}
    assert left_out > 0 and started[order[-1]] > tuning.BUCKETED_BUDGET_FACTOR * 4.0
    assert choice.choice == "measured" and choice.measured_us == 5.0  # dense was faster in every bucket
    assert choice.plan.kind == "dense"


def test_compile_keys_ignore_the_grid_but_not_what_triton_specializes():
    """Split counts apart from 1 share kernels (the split count is not specialised: a grid that follows the cache's
    length changes it between steps), as do grids that follow the length; block size, warps, stages, TMA do not."""
    def key(**kw):
        return tuning.compile_key(SplitKVPlan(**{"num_splits": 5, "block_n": 64, **kw}))
    assert key(num_splits=5) == key(num_splits=7) == key(num_splits=16) != key(num_splits=1)
    assert key(tiles_per_split=1) == key(tiles_per_split=4) == key()
    assert len({key(), key(block_n=128), key(num_warps=8), key(num_stages=3), key(tma=True)}) == 5
    from attnopt.plan import StreamKPlan

    assert tuning.compile_key(StreamKPlan(grid=132)) == tuning.compile_key(StreamKPlan(grid=264))


def test_the_planner_shares_one_tuner_per_process(monkeypatch, tmp_path):
    """The graphs of one model (graph breaks, recompiles) share a tuner, and so its measurements; another cache
    directory or budget gets its own."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv(tuning.TUNE_ENV, raising=False)
    monkeypatch.setattr(tuning, "_PROCESS_TUNERS", {})
    monkeypatch.setenv("ATTNOPT_CACHE_DIR", str(tmp_path / "a"))
    first = tuning.default_tuner("cuda", True)
    assert isinstance(first, Tuner) and tuning.default_tuner("cuda", True) is first
    monkeypatch.setenv("ATTNOPT_CACHE_DIR", str(tmp_path / "b"))
    assert tuning.default_tuner("cuda", True) is not first
    monkeypatch.setenv("ATTNOPT_CACHE_DIR", str(tmp_path / "a"))
    monkeypatch.setenv(tuning.BUDGET_ENV, "1.5")
    other = tuning.default_tuner("cuda", True)
    assert other is not first and other.budget_s == 1.5
    assert tuning.default_tuner("cpu", True) is None


def test_each_device_gets_its_own_process_tuner(monkeypatch, tmp_path):
    """Two GPUs of one process may differ (the environment key names the device): one tuner each."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv(tuning.TUNE_ENV, raising=False)
    monkeypatch.setattr(tuning, "_PROCESS_TUNERS", {})
    monkeypatch.setenv("ATTNOPT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    current = [0]
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    first = tuning.default_tuner("cuda", True)
    current[0] = 1
    second = tuning.default_tuner("cuda", True)
    assert second is not first and tuning.default_tuner("cuda", True) is second
    current[0] = 0
    assert tuning.default_tuner("cuda", True) is first


# ---------------------------------------------------------------------------------------- on a GPU
@pytest.mark.cuda
def test_smollm2_static_pick_is_no_slower_than_the_forced_sweeps_best(cache):
    """At SmolLM2's e2e 1k static site (full, its mask shared by 30 layers) the measured choice is within 5 % of
    S=16/64/4/3, the best of a forced sweep on the H100 (6.2 µs; the tuner of version 3 kept S=5/256/8/2, 10 µs),
    both timed by the tuner's own timer with the same valid-length share."""
    site = dataclasses.replace(SMOL_1K, dtype="bfloat16")
    ranked = _ranked(site)
    choice = Tuner(cache=cache, env=tuning.environment_key()).choose(site, ranked, valid_len_sharing=30)
    assert choice.choice == "measured"
    record = cache.get(tuning.environment_key(), tuning.ShapeKey.of(site, site.kv_len, False, 30))
    print(f"tune_s={choice.tune_s:.2f} warm_up_s={record.get('warm_up_s')} rounds={record.get('rounds')} "
          f"pick={choice.plan.describe()} {choice.measured_us:.2f} us")
    # the warm-up compiled every candidate at once: the budget reached all of them (at f9e648f, compiling one after
    # another, it did not reach S=17/64/4/3, and the pick stayed S=5/256/8/2 at 7.78 µs against 7.25 µs)
    assert not [k for k, v in choice.timings.items() if str(v).startswith("skipped")], (choice.tune_s, record)
    forced = SplitKVPlan(num_splits=16, block_n=64, num_warps=4, num_stages=3, tma=True)
    forced_us = T.gpu_timer(forced, site) + T.gpu_timer.valid_len_us(site) / 30
    T.gpu_timer.release()
    assert choice.measured_us <= 1.05 * forced_us, (choice.plan.describe(), choice.measured_us, forced_us,
                                                    choice.timings, choice.tune_s)


@pytest.mark.cuda
def test_the_gpu_timer_times_a_low_fill_in_the_measured_cache():
    """``GpuTimer.at_fill``: a split-KV plan over an eighth of a 32k static cache's slots runs in the cache timed full,
    faster than full (it reads only the valid keys), on its own sets (the full timing's sets keep their mask)."""
    site = dataclasses.replace(SMOL_1K, kv_len=32832, dtype="bfloat16")
    plan = SplitKVPlan(num_splits=16, block_n=64, num_warps=4, num_stages=3, tma=True)
    timer = T.GpuTimer()
    try:
        full = timer(plan, site)
        low = timer.at_fill(plan, site, 4096)
        assert 0 < low < full, (low, full)
        assert bool(timer._input_sets(site)[0]["mask"].all()) and int(timer._fill[1][0]["valid_len"][0]) == 4096
        assert len(timer._fill[1]) >= len(timer._input_sets(site))
    finally:
        timer.release()


def test_a_cached_shape_is_read_from_the_file_once_per_process(cache, monkeypatch):
    """30 layers of a shape measured by another process: the file is read for the first site only."""
    site = AttentionSite.canonical()
    ranked = _ranked(site)
    Tuner(Clocked(lambda p, s: 5.0), cache, env=ENV).choose(site, ranked)
    reads = []
    load = tuning.TuningCache.load
    monkeypatch.setattr(tuning.TuningCache, "load", lambda self: reads.append(1) or load(self))
    tuner = Tuner(Clocked(lambda p, s: pytest.fail("timed although cached")), tuning.TuningCache(), env=ENV)
    choices = [tuner.choose(site, ranked) for _ in range(30)]
    assert {c.choice for c in choices} == {"cached"} and len(reads) == 1
    assert len({c.plan.runtime_key() for c in choices}) == 1 and choices[0].measured_us == 5.0


def _two_close(site, a_us, b_us):
    """A rule where the model's pick (A) and cuDNN (B) take ``a_us(n)`` / ``b_us(n)`` µs at KV length n and every
    other candidate 30 µs."""
    a = _ranked(site)[0].runtime_key()

    def rule(p, s):
        if p.runtime_key() == a:
            return a_us(s.kv_len)
        return b_us(s.kv_len) if getattr(p, "backend", "") == "cudnn" else 30.0
    return rule


def test_a_near_tie_in_a_bucket_is_decided_at_its_ends(cache):
    """At the bucket's middle A is 2 % faster than cuDNN, at its short end cuDNN is 10 % faster, at its long end 1 %
    slower: cuDNN's worst ratio (1.02) beats A's (1.11). The ends are timed for the two alone, and recorded."""
    site = AttentionSite.canonical(kv_len=tuning.bucket_length(4096))
    span = tuning.bucket_span(4096)
    assert span == (2112, 4096)
    rule = _two_close(site, lambda n: 10.0, lambda n: {2880: 10.2, 2112: 9.0, 4096: 10.1}[n])
    timer = Clocked(rule)
    choice = Tuner(timer, cache, env=ENV).choose(site, _ranked(site), bucketed=True, span=span)
    assert choice.plan.kind == "dense" and choice.plan.backend == "cudnn" and choice.measured_us == 10.2
    ends = [(k, n) for k, n in timer.calls if n != 2880]
    assert sorted(n for _, n in ends) == [2112, 2112, 4096, 4096] and len({k for k, _ in ends}) == 2
    record = cache.get(ENV, tuning.ShapeKey.of(site, 2880, True))
    assert record["winner"]["data"]["backend"] == "cudnn" and set(record["span_us"]) == {"2112", "4096"}
    again = Tuner(Clocked(lambda p, s: pytest.fail("timed although cached")), tuning.TuningCache(), env=ENV)
    assert again.choose(site, _ranked(site), bucketed=True, span=span).plan.backend == "cudnn"


def test_no_tie_no_ends_and_the_faster_keeps_a_tie_that_holds(cache):
    site = AttentionSite.canonical(kv_len=tuning.bucket_length(4096))
    span = tuning.bucket_span(4096)
    clear = Clocked(_two_close(site, lambda n: 10.0, lambda n: 11.0))  # 10 % apart: no tie, cuDNN beyond PEER_SPAN
    Tuner(clear, cache, env=ENV).choose(site, _ranked(site), bucketed=True, span=span)
    assert {n for _, n in clear.calls} == {2880} and tuning.PEER_SPAN < 0.1
    site2 = dataclasses.replace(site, batch=2)  # another shape: not cached
    steady = Clocked(_two_close(site2, lambda n: 10.0, lambda n: 10.2))  # a tie, the same at both ends
    choice = Tuner(steady, cache, env=ENV).choose(site2, _ranked(site2), bucketed=True, span=span)
    assert {n for _, n in steady.calls} == {2880, 2112, 4096} and choice.plan.kind != "dense"


def test_a_kernel_winner_is_judged_against_a_close_dense_plan_at_the_bucket_ends(cache):
    """5 % apart at the middle is no near tie of two kernel plans, but cuDNN (within PEER_SPAN) is timed with the
    kernel winner at the bucket's ends: 10 % faster at the short end, it wins the worst ratio (1.05 vs 1.11)."""
    site = AttentionSite.canonical(kv_len=tuning.bucket_length(4096))
    span = tuning.bucket_span(4096)
    timer = Clocked(_two_close(site, lambda n: 10.0, lambda n: {2880: 10.5, 2112: 9.0, 4096: 10.5}[n]))
    choice = Tuner(timer, cache, env=ENV).choose(site, _ranked(site), bucketed=True, span=span)
    assert choice.plan.kind == "dense" and choice.plan.backend == "cudnn"
    assert sorted(n for _, n in timer.calls if n != 2880) == [2112, 2112, 4096, 4096]


def test_a_kernel_plan_must_beat_the_peer_by_the_margin(cache):
    """A fixed shape: a kernel plan 0.5 % ahead of cuDNN is within the timing noise, so cuDNN (the peer's own kernel)
    is kept; 3 % ahead, the kernel plan wins. In a bucket the same margin weighs the worst ratios."""
    site = AttentionSite.canonical(kv_len=4000)
    narrow = Tuner(Clocked(_two_close(site, lambda n: 10.0, lambda n: 10.05)), cache, env=ENV)
    assert narrow.choose(site, _ranked(site)).plan.backend == "cudnn"
    site2 = dataclasses.replace(site, batch=2)
    clear = Tuner(Clocked(_two_close(site2, lambda n: 10.0, lambda n: 10.3)), cache, env=ENV)
    assert clear.choose(site2, _ranked(site2)).plan.kind != "dense"
    site3 = AttentionSite.canonical(kv_len=tuning.bucket_length(4096))
    same = Clocked(_two_close(site3, lambda n: 10.0, lambda n: 10.05))  # 0.5 % at every length
    choice = Tuner(same, cache, env=ENV).choose(site3, _ranked(site3), bucketed=True, span=tuning.bucket_span(4096))
    assert choice.plan.backend == "cudnn" and tuning.PEER_MARGIN == 0.01


def test_buckets_pass_their_span():
    assert [tuning.bucket_span(b) for b in tuning.BUCKETS[:2]] == [(576, 1024), (1088, 2048)]
    assert tuning.bucket_span(128, (32, 128)) == (33, 128) and tuning.bucket_span(32, (32, 128)) == (17, 32)


def test_a_static_near_tie_is_decided_at_a_low_fill(cache):
    """SmolLM2's 8k static site: two kernel plans 2 % apart full; over an eighth of the keys the runner-up is 40 %
    faster (its splits still fill the GPU), so it wins. Only the pair is timed again, over 1024 keys."""
    site = dataclasses.replace(SMOL_1K, kv_len=8256)
    ranked = _ranked(site)
    plans = tuning.to_time(ranked, tuning.DEFAULT_TOP_K)
    a, b = [p.runtime_key() for p in plans if p.kind != "dense"][:2]

    def rule(p, s):
        full = s.kv_len == 8256
        if p.runtime_key() == a:
            return 10.0 if full else 5.0
        if p.runtime_key() == b:
            return 10.2 if full else 3.0
        return 30.0
    timer = Clocked(rule)
    choice = Tuner(timer, cache, env=ENV).choose(site, ranked, valid_len_sharing=30)
    assert choice.plan.runtime_key() == b and choice.measured_us == 10.2
    low = [(k, n) for k, n in timer.calls if n != 8256]
    assert sorted(low) == sorted([(a, 1024), (b, 1024)]) and tuning.STATIC_LOW_FILL == 1 / 8


def test_a_timer_with_at_fill_times_the_low_fill_in_the_measured_cache_without_a_warm_up(cache):
    """A timer that can time a fill of the cache the graph runs (``at_fill``: the GPU timer) is asked for the pair's
    times over 1024 valid keys of the 8256-slot cache, and the tie-break warms nothing up at another length (the
    kernels compiled for 8256 slots are the ones the model runs at any fill). The choice is the one the fill gives."""
    site = dataclasses.replace(SMOL_1K, kv_len=8256)
    ranked = _ranked(site)
    a, b = [p.runtime_key() for p in tuning.to_time(ranked, tuning.DEFAULT_TOP_K) if p.kind != "dense"][:2]

    class Filled(Clocked):
        def __init__(self, rule):
            super().__init__(rule)
            self.fills, self.warmed = [], []

        def at_fill(self, plan, at, keys):
            self.fills.append((plan.runtime_key(), at.kv_len, keys))
            return {a: 5.0, b: 3.0}[plan.runtime_key()]

        def warm_up(self, plans, at, eager=False):
            self.warmed.append(at.kv_len)
            return {}

    timer = Filled(lambda p, s: {a: 10.0, b: 10.2}.get(p.runtime_key(), 30.0))
    choice = Tuner(timer, cache, env=ENV).choose(site, ranked, valid_len_sharing=30)
    assert choice.plan.runtime_key() == b
    assert sorted(timer.fills) == sorted([(a, 8256, 1024), (b, 8256, 1024)])
    assert {n for _, n in timer.calls} == {8256} and set(timer.warmed) == {8256}  # (the grid siblings' warm-up too)


def test_a_dense_plan_keeps_its_full_time_at_a_low_fill(cache):
    """cuDNN reads the whole static cache at any fill: in a near tie with a kernel plan it is not timed again, and
    the kernel plan, faster over fewer keys, wins."""
    site = dataclasses.replace(SMOL_1K, kv_len=8256)
    ranked = _ranked(site)
    kernel = ranked[0].runtime_key()

    def rule(p, s):
        if getattr(p, "backend", "") == "cudnn":
            return 10.0
        return (10.2 if s.kv_len == 8256 else 4.0) if p.runtime_key() == kernel else 30.0
    timer = Clocked(rule)
    choice = Tuner(timer, cache, env=ENV).choose(site, ranked, valid_len_sharing=30)
    assert choice.plan.runtime_key() == kernel
    assert [(k, n) for k, n in timer.calls if n != 8256] == [(kernel, 1024)]
    window = dataclasses.replace(site, window=512)  # a window's band does not grow with the fill: no low-fill look
    assert not tuning._static_cache(window) and tuning._static_cache(site)


@pytest.mark.parametrize("dense_full, kernel_wins", [(10.0, True), (7.0, False)])
def test_a_dense_static_winner_is_judged_at_a_low_fill(cache, dense_full, kernel_wins):
    """cuDNN 15 % ahead of the best kernel plan over a full static cache is not a near tie, yet at an eighth of the
    keys it keeps its full time while the kernel plan shrinks: within ``STATIC_DENSE_TIE`` the kernel plan is timed
    at the low fill and wins on the worst ratio (the H100's 4k-of-32k check fell to 1.0x without this). Far
    ahead (over the margin), cuDNN stays, and nothing is timed again."""
    site = dataclasses.replace(SMOL_1K, kv_len=8256)
    ranked = _ranked(site)
    kernel = ranked[0].runtime_key()

    def rule(p, s):
        if getattr(p, "backend", "") == "cudnn":
            return dense_full
        return (11.5 if s.kv_len == 8256 else 2.0) if p.runtime_key() == kernel else 30.0
    timer = Clocked(rule)
    choice = Tuner(timer, cache, env=ENV).choose(site, ranked, valid_len_sharing=30)
    low = [(k, n) for k, n in timer.calls if n != 8256]
    if kernel_wins:
        assert choice.plan.runtime_key() == kernel and low == [(kernel, 1024)]
    else:
        assert choice.plan.kind == "dense" and low == []
    assert tuning.STATIC_DENSE_TIE == 0.25


def test_at_most_tie_max_near_ties_are_timed_again(cache):
    """Every candidate equal full: the first three in timing order are the contenders (ties keep that order); of
    them the kernel plans are timed at the low fill (cuDNN keeps its full time), no others."""
    site = dataclasses.replace(SMOL_1K, kv_len=8256)
    ranked = _ranked(site)
    timer = Clocked(lambda p, s: 10.0 if s.kv_len == 8256 else 2.0)
    Tuner(timer, cache, env=ENV).choose(site, ranked, valid_len_sharing=30)
    first = tuning.to_time(ranked, tuning.DEFAULT_TOP_K)[:tuning.TIE_MAX]
    low = [k for k, n in timer.calls if n == 1024]
    assert tuning.TIE_MAX == 3 and [p.kind for p in first] == ["split_kv", "dense", "split_kv"]
    assert low == [first[0].runtime_key(), first[2].runtime_key()]


def test_a_short_static_cache_is_never_timed_past_its_length(cache):
    site = dataclasses.replace(SMOL_1K, kv_len=48)
    timer = Clocked(lambda p, s: 10.0)
    Tuner(timer, cache, env=ENV).choose(site, _ranked(site))
    assert {n for _, n in timer.calls} == {48}


def test_a_dense_static_winner_is_judged_against_several_readers_at_a_low_fill(cache):
    """4k of a 32k cache: cuDNN is fastest full, two kernel plans within STATIC_DENSE_TIE of it; the one slower full
    but faster over an eighth of the keys (more splits) wins the worst ratio. A reader beyond the margin is not
    timed again."""
    site = dataclasses.replace(SMOL_1K, q_heads=32, kv_heads=8, head_dim=128, kv_len=32768)
    ranked = _ranked(site)
    kernels = [p.runtime_key() for p in tuning.to_time(ranked, tuning.DEFAULT_TOP_K) if p.kind != "dense"]
    few, many, far = kernels[:3]
    full = {few: 59.0, many: 62.0, far: 80.0}
    low = {few: 17.0, many: 9.0, far: 5.0}

    def rule(p, s):
        if getattr(p, "backend", "") == "cudnn":
            return 58.0
        k = p.runtime_key()
        return (full if s.kv_len == 32768 else low).get(k, 200.0)
    timer = Clocked(rule)
    choice = Tuner(timer, cache, env=ENV).choose(site, ranked, valid_len_sharing=32)
    assert choice.plan.runtime_key() == many and choice.measured_us == 62.0
    assert sorted(k for k, n in timer.calls if n != 32768) == sorted([few, many])


def test_the_timed_call_returns_the_layout_the_op_returns(monkeypatch):
    """SDPA flash/cuDNN hand back a transposed view at q_len > 1 and the op copies it into the contiguous layout its
    fake declares: the timer's call pays that copy too, so a dense plan is not timed cheaper than it runs."""
    from attnopt.plan import DensePlan
    from attnopt.runtime.strategies import dense

    real = dense._sdpa
    monkeypatch.setattr(dense, "_sdpa", lambda *a, **kw: real(*a, **kw).transpose(1, 2).contiguous().transpose(1, 2))
    site = AttentionSite.canonical(q_heads=4, kv_heads=2, head_dim=64, kv_len=40, q_len=4, dtype="float32")
    s = T.synthetic_inputs(site, 0, device="cpu")
    out = T.site_call(DensePlan(), site, s)()
    assert out.is_contiguous() and out.shape == (1, 4, 4, 64)
    raw = dense._sdpa(DensePlan(), False, s["q"], s["k"], s["v"], None, site.head_dim ** -0.5, False)
    assert not raw.is_contiguous()
    torch.testing.assert_close(out, raw)


def test_a_static_reader_is_not_traded_for_the_peer_within_the_margin(cache):
    """Without CUDA graphs no low fill is timed; a kernel plan 0.5 % ahead of cuDNN full still wins a static cache,
    where it reads only the valid keys (the margin that keeps the peer elsewhere does not apply)."""
    site = dataclasses.replace(SMOL_1K, kv_len=8256)
    ranked = _ranked(site)
    kernel = ranked[0].runtime_key()

    class Eager(Clocked):
        def host_us(self, plan, site):
            return 0.0
    timer = Eager(lambda p, s: 10.0 if p.runtime_key() == kernel else (10.05 if getattr(p, "backend", "") == "cudnn"
                                                                       else 30.0))
    choice = Tuner(timer, cache, env=ENV).choose(site, ranked, valid_len_sharing=30, graphed=False)
    assert choice.plan.runtime_key() == kernel


@pytest.mark.parametrize("fresh_us, cudnn_wins", [(60.0, True), (5000.0, False)])
def test_a_growing_cache_charges_cudnn_what_a_new_length_costs(cache, fresh_us, cudnn_wins):
    """A symbolic length runs a new length every step. cuDNN is fastest replayed at one length; where its call at a
    new length costs far more than at a known one (a graph build per shape), that difference is charged to it in
    every bucket and a kernel plan wins; where it does not (host noise under FRESH_LENGTH_SLACK_US), cuDNN keeps its
    lead. The probe runs once per site, not per bucket, and never for a fixed length."""
    class Probed(Clocked):
        probes = 0

        def fresh_length_us(self, plan, site):
            assert plan.kind == "dense" and plan.backend == "cudnn"
            self.probes += 1
            return fresh_us, 40.0

    site = dataclasses.replace(AttentionSite.canonical(), kv_len=None, kv_len_hint=6000)
    timer = Probed(lambda p, s: 50.0 if getattr(p, "backend", "") == "cudnn" else (55.0 if p.kind != "dense" else 90.0))
    choice = Tuner(timer, cache, env=ENV).choose_bucketed(site, _ranked)
    assert timer.probes == 1
    assert (choice.plan.kind == "dense" and choice.plan.backend == "cudnn") == cudnn_wins
    n = tuning.hint_length(6000, 8192)  # the hint's bucket, timed at the hint
    record = cache.get(ENV, tuning.ShapeKey.of(dataclasses.replace(site, kv_len=n), n, True))
    assert list(record["fresh_length_us"].values()) == [[fresh_us, 40.0]]
    fixed = AttentionSite.canonical(kv_len=4000)
    Tuner(timer, cache, env=ENV).choose(fixed, _ranked(fixed))
    assert timer.probes == 1


def test_the_gpu_timers_fresh_length_probe_calls_new_then_known_lengths(monkeypatch):
    """fresh_length_us: three lengths just below the site's, each called twice (first new, then known), over
    contiguous copies of the first input set's keys (a growing cache's new tensor); a strategy that builds per length
    shows the build."""
    import time as _time

    import attnopt.runtime.strategies as strategies
    from test_tuning_method import _gpu_on_the_cpu

    calls, built = [], set()

    class PerLength:
        def prepare(self, plan, q, k, v):
            return None

        def run(self, state, plan, q, k, v, mask, valid_len, scale, is_causal):
            n = k.shape[2]
            calls.append((n, k.is_contiguous(), bool(torch.equal(k, timer._sets[0]["k"][:, :, :n]))))
            if n not in built:
                built.add(n)
                _time.sleep(0.003)
            return q
    monkeypatch.setattr(strategies, "get_strategy", lambda kind: PerLength())
    _gpu_on_the_cpu(monkeypatch)
    site = AttentionSite.canonical(q_heads=4, kv_heads=2, head_dim=64, kv_len=256, dtype="float32")
    timer = T.GpuTimer(warm_ms=0.0)
    from attnopt.plan import DensePlan

    fresh, repeat = timer.fresh_length_us(DensePlan(backend="cudnn"), site)
    assert [n for n, _, _ in calls] == [255, 254, 253, 255, 254, 253]
    assert all(contiguous and same for _, contiguous, same in calls)
    assert fresh - repeat > 2000 and T.FRESH_LENGTHS == 3


def test_a_backend_that_builds_per_length_is_not_timed_again_in_later_buckets(cache):
    """Once the first bucket's probe shows cuDNN building per length, the other buckets neither warm nor time it (each
    new length would build again, 40-108 ms on the H100), and their records say why."""
    class Probed(Clocked):
        def fresh_length_us(self, plan, site):
            return 40000.0, 120.0

    site = dataclasses.replace(AttentionSite.canonical(), kv_len=None, kv_len_hint=6000)
    timer = Probed(lambda p, s: 50.0 if getattr(p, "backend", "") == "cudnn" else 55.0)
    Tuner(timer, cache, env=ENV).choose_bucketed(site, _ranked)
    cudnn = [n for k, n in timer.calls if '"cudnn"' in k]
    assert cudnn == [tuning.hint_length(6000, 8192)]  # the hint's bucket only (timed at the hint)
    record = cache.get(ENV, tuning.ShapeKey.of(dataclasses.replace(site, kv_len=2880), 2880, True))
    assert [v for k, v in record["timings"].items() if '"cudnn"' in k][0].startswith("skipped: a new KV length")
