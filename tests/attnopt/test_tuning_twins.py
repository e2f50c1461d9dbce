"""What the measured choice (``attnopt.tuning``) times after its first rounds: the grids of further close
configurations nearest the fastest plan's grid (``grid_siblings``'s ``near``), the twins of the fastest plan
(``variant_twins``: L2 prefetch, head chunks), and how a noisy peer is judged; on the CPU with fake timers, one of
them replaying H100 measurements of the planner bench's worst case."""
import dataclasses
import os
import sys

import pytest

from attnopt import tuning
from attnopt import tuning_candidates as candidates
from attnopt.plan import DensePlan, SplitKVPlan, StreamKPlan, plan_from_json
from attnopt.site import AttentionSite
from attnopt.tuning import ShapeKey, Tuner

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_tuning_method import ENV, Scripted, _ranked, cache  # noqa: E402,F401  (cache: the fixture)

N = 524288
#: corner-B1-g7-d80-512k of the planner bench: B=1, 14/2 heads, D=80, a growing cache at 512k keys.
CORNER = AttentionSite.canonical(batch=1, q_heads=14, kv_heads=2, head_dim=80, kv_len=None, kv_len_hint=N)
#: µs on the H100 by (splits at 512k keys, block_n, warps, stages, head chunks, L2 prefetch): the planner cases at
#: 2cead39 (what the tuner timed there) and benchmarks/trail_variants.py at 2c6eb78 (S66/bn128 and its twins, forced).
H100_512K = {
    (66, 256, 4, 3, True, 0): 120.9, (132, 256, 4, 3, True, 0): 123.4, (198, 64, 4, 3, False, 0): 124.2,
    (396, 64, 4, 3, False, 0): 125.8, (66, 64, 4, 3, False, 0): 126.9, (512, 256, 4, 3, True, 0): 127.8,
    (99, 64, 4, 3, False, 0): 128.4, (33, 256, 4, 3, True, 0): 132.6, (1024, 128, 4, 2, False, 0): 133.6,
    (528, 64, 4, 3, True, 0): 135.0, (512, 256, 4, 2, False, 0): 137.6, (1024, 128, 8, 3, False, 0): 137.9,
    (128, 128, 4, 3, False, 0): 138.8, (512, 256, 8, 2, False, 0): 143.2, (528, 64, 4, 3, False, 0): 144.2,
    (512, 256, 8, 2, False, 2): 151.7, (512, 256, 8, 2, True, 0): 154.0,
    (66, 128, 4, 3, False, 0): 120.3, (66, 128, 4, 3, False, 2): 117.7, (66, 128, 4, 3, True, 0): 119.6,
    (66, 128, 4, 3, True, 2): 118.2, (66, 256, 4, 3, True, 2): 120.4,
}
#: What the table does not hold: slower than every plan of it within 15 % of its fastest, so that it never decides.
UNTIMED_US = 140.0


def _shape(p, n=N):
    return (p.splits_at(n), p.block_n, p.num_warps, p.num_stages, p.head_chunks, p.l2_prefetch)


def _twin_shape(p, n=N):
    """``_shape`` and whether the products are swapped (swap-AB twins are on: SWAP_AB_TWINS)."""
    return _shape(p, n) + (p.swap_ab,)


class H100Corner:
    """A fake timer replaying ``H100_512K`` (scaled by the length); cuDNN builds a graph per KV length (55 ms more a
    call at a new length, as measured), so a growing cache cannot take it."""

    def __init__(self):
        self.calls = []

    def __call__(self, plan, site):
        self.calls.append((plan.runtime_key(), site.kv_len))
        scale = site.kv_len / N
        if plan.kind == "dense":
            return {"cudnn": 117.5, "flash": 164.6}.get(plan.backend, 16000.0) * scale
        if plan.kind != "split_kv":
            return 150.0 * scale
        return H100_512K.get(_shape(plan), UNTIMED_US) * scale

    def fresh_length_us(self, plan, site):
        return [55700.0, 300.0]


def test_the_512k_corner_finds_the_prefetching_one_wave_plan(cache):
    """At 2cead39 the tuner kept S66/bn256 chunks (120.9 µs): 128-key tiles were timed only at the model's fixed 128
    splits (138.8, the seventh configuration), and the one prefetching plan timed was the best-estimated one,
    S1024/bn256/w8 (151.7). Now the close configurations are timed at the fastest plan's grid (S66/bn128: 120.3) and
    the fastest plan's twins after them: S66/bn128 prefetching 2 tiles ahead wins (117.7 µs against cuDNN's 117.5 at
    one length), with a bounded number of timings; the bucket beside the hint's does neither (their compiles)."""
    timer = H100Corner()
    choice = Tuner(timer, cache, env=ENV, buckets=(262144, N)).choose_bucketed(CORNER, _ranked)
    plan = plan_from_json(choice.plan.plan_for(N)) if choice.plan.kind == "bucketed" else choice.plan
    assert _shape(plan) == (66, 128, 4, 3, False, 2) and choice.measured_us == pytest.approx(117.7)
    record = cache.get(ENV, ShapeKey.of(dataclasses.replace(CORNER, kv_len=N, kv_len_hint=None), N, True))
    near = [_shape(plan_from_json(k)) for k in record["near_siblings"]]
    assert (66, 128, 4, 3, False, 0) in near and len(near) <= candidates.SIBLING_FAMILIES_MAX - 2
    twins = [_twin_shape(plan_from_json(k)) for k in record["twins"]]
    assert twins[0] == (66, 128, 4, 3, False, 2, False) and len(twins) <= candidates.TWINS_MOST
    assert {(66, 128, 4, 3, True, 0, False), (66, 128, 4, 3, False, 0, True)} <= set(twins)  # chunked; swapped
    assert len({k for k, n in timer.calls if n == N}) <= 45  # distinct plans timed at the hint's length
    # the bucket beside the hint's times grid siblings (thorough) but no further configurations' grids or twins
    n_other = tuning.bucket_length(262144, (262144, N))
    other = cache.get(ENV, ShapeKey.of(dataclasses.replace(CORNER, kv_len=n_other, kv_len_hint=None), n_other, True))
    assert other["grid_siblings"] and "near_siblings" not in other and "twins" not in other


def test_near_siblings_are_the_grids_nearest_the_fastest_plans():
    """Of each further configuration within SIBLING_FAMILY_NEAR of the fastest kernel plan, of its kind and neither
    prefetching nor swapped, the NEAR_GRIDS grids whose split counts are nearest the fastest's (by ratio), every
    configuration's nearest first; a configuration over SIBLING_FAMILY_NEAR behind, a stream-K or prefetching one,
    and the SIBLING_FAMILIES fastest (their grids come first, in ranked order), get none here."""
    def p(splits, bn, warps=4, stages=3, est=1.0, prefetch=0):
        return SplitKVPlan(num_splits=splits, block_n=bn, num_warps=warps, num_stages=stages, tiles_per_split=1,
                           l2_prefetch=prefetch).with_estimate(est)
    ranked = [p(128, 128), p(2048, 128), p(132, 128), p(33, 128), p(66, 128),  # the configuration timed at S128
              p(66, 256), p(132, 256),  # the fastest
              p(198, 64), p(66, 64), p(99, 64),  # the second fastest
              p(8, 32), p(66, 32), p(64, 32, 8, 2), p(66, 32, 8, 2), DensePlan(backend="cudnn"),
              StreamKPlan(grid=132, block_n=64), StreamKPlan(grid=66, block_n=64),  # close, another kind
              p(8, 128, 8, 3, prefetch=2), p(66, 128, 8, 3, prefetch=2)]  # close, prefetching
    key = {i: q.runtime_key() for i, q in enumerate(ranked)}
    measured = {key[5]: 120.9, key[7]: 124.2, key[0]: 138.8, key[10]: 130.0, key[12]: 150.0, key[14]: 117.5,
                key[15]: 125.0, key[17]: 126.0}
    tried = set(measured)
    near = candidates.grid_siblings(measured, ranked, tried, n_keys=N, near=True)
    assert candidates.NEAR_GRIDS == 1
    assert [q.runtime_key() for q in near] == [key[11], key[4]]  # S66 of 32- and of 128-key tiles, beside S66/bn256
    first = candidates.grid_siblings(measured, ranked, tried, n_keys=N)
    assert [q.runtime_key() for q in first] == [key[6], key[8], key[9]]  # the two fastest, ranked order


def test_a_configuration_timed_at_one_split_gets_its_split_grids_as_siblings():
    """One split compiles apart (no merge), but it is the same configuration: its grids of several splits are its
    siblings (the warm-up compiles that kernel); at 2cead39 only the grids of one compiled kernel were."""
    one = SplitKVPlan(num_splits=1, block_n=128, num_stages=3).with_estimate(1.0)
    three = SplitKVPlan(num_splits=3, block_n=128, num_stages=3, tiles_per_split=1).with_estimate(2.0)
    other = SplitKVPlan(num_splits=3, block_n=64, num_stages=3, tiles_per_split=1).with_estimate(2.0)
    measured = {one.runtime_key(): 10.0, other.runtime_key(): 11.0}
    got = candidates.grid_siblings(measured, [one, three, other], set(measured), n_keys=30464)
    assert [q.runtime_key() for q in got] == [three.runtime_key()]
    assert tuning.compile_key(three) != tuning.compile_key(one)


def test_variant_twins_of_the_fastest_plan_only_and_only_near_the_fastest():
    """The twins timed are those of the fastest kernel plan (TWIN_PLANS), the same grid and tiles with L2 prefetch,
    head chunks or swapped products changed, at most TWINS_MOST; none where a dense plan is over TWINS_WITHIN ahead of every kernel."""
    site = dataclasses.replace(CORNER, kv_len=N, kv_len_hint=None)
    ranked = _ranked(site)
    fastest = next(q for q in ranked if q.kind == "split_kv" and _shape(q) == (66, 128, 4, 3, False, 0))
    runner = next(q for q in ranked if q.kind == "split_kv" and _shape(q) == (66, 256, 4, 3, True, 0))
    cudnn = next(q for q in ranked if getattr(q, "backend", "") == "cudnn")
    measured = {fastest.runtime_key(): 120.3, runner.runtime_key(): 120.9, cudnn.runtime_key(): 117.5}
    twins = candidates.variant_twins(measured, ranked, set(measured))
    assert [_twin_shape(q) for q in twins][0] == (66, 128, 4, 3, False, 2, False) and len(twins) == 3
    # prefetching, chunked and swapped (bf16 at 7 query rows a KV head: swap-AB applies), the first three in the ranking
    assert {_twin_shape(q) for q in twins} == {(66, 128, 4, 3, False, 2, False), (66, 128, 4, 3, True, 0, False),
                                               (66, 128, 4, 3, False, 0, True)}
    assert all(q.tiles_per_split == fastest.tiles_per_split and q.num_splits == fastest.num_splits for q in twins)
    measured[cudnn.runtime_key()] = 100.0  # cuDNN 20 % ahead: no twin can catch up
    assert candidates.variant_twins(measured, ranked, set(measured)) == []


@pytest.mark.parametrize("cudnn_series,kernel_wins", [
    ([119.3, 117.5, 117.4, 117.5, 117.6, 117.5, 117.4, 117.5], False),  # one slow first sample: cuDNN 0.2 % ahead
    ([117.5, 119.3, 119.2, 119.3, 119.1, 119.3, 119.2, 119.3], True),  # one fast first sample: the kernel 1.3 % ahead
])
def test_a_noisy_peer_is_judged_by_its_median_over_the_duel(cache, monkeypatch, cudnn_series, kernel_wins):
    """cuDNN moved 117.5-119.3 µs between H100 runs of one shape. Against a steady kernel plan at 117.7, the duel
    re-times cuDNN with it and the median over all samples decides: cuDNN measurably ahead keeps it, and a kernel plan
    ahead by more than PEER_MARGIN (1 %) takes the site; one lucky or unlucky sample decides neither."""
    monkeypatch.setattr(candidates, "TWIN_PLANS", 0)
    site = AttentionSite.canonical(batch=1, q_heads=14, kv_heads=2, head_dim=80, kv_len=N)
    ranked = _ranked(site)
    kernel = ranked[0].runtime_key()

    def rule(plan, s, n):
        if getattr(plan, "backend", "") == "cudnn":
            return cudnn_series[min(n, len(cudnn_series) - 1)]
        return 117.7 if plan.runtime_key() == kernel else 140.0
    timer = Scripted(rule)
    choice = Tuner(timer, cache, env=ENV).choose(site, ranked)
    record = cache.get(ENV, ShapeKey.of(site, N, False))
    cudnn = next(k for k in record["samples"] if '"cudnn"' in k)
    assert cudnn in record["duel"] and len(record["samples"][cudnn]) > tuning.ROUNDS
    assert (choice.plan.kind != "dense") == kernel_wins


def test_the_twins_are_timed_after_siblings_that_ran_past_the_budget(cache, monkeypatch):
    """Every timing costs 0.3 s of a 4 s budget, so the grid siblings run past it (later ones are skipped): the
    fastest plan's twins are still compiled and timed, and its prefetching twin (3 % faster here) wins."""
    now = [0.0]
    monkeypatch.setattr(tuning.time, "perf_counter", lambda: now[0])
    replay = H100Corner()

    def rule(plan, s, n):
        now[0] += 0.3
        if getattr(plan, "l2_prefetch", 0):
            return 0.97 * replay(dataclasses.replace(plan, l2_prefetch=0), s)
        return replay(plan, s)
    timer = Scripted(rule)
    timer.fresh_length_us = replay.fresh_length_us
    site = dataclasses.replace(CORNER, kv_len=N, kv_len_hint=None)
    choice = Tuner(timer, cache, env=ENV, budget_s=4.0).choose(site, _ranked(site), bucketed=True)
    record = cache.get(ENV, ShapeKey.of(site, N, True))
    assert any(str(v).startswith("skipped: tuning budget") for v in record["timings"].values())
    assert record["twins"] and choice.plan.runtime_key() in record["twins"] and choice.plan.l2_prefetch == 2


def test_every_twin_gets_its_first_round_however_late(cache, monkeypatch):
    """The late step (the twins, at most TWINS_MOST) times each of its plans once even when every timing costs
    0.3 s and the budget ended long before (an earlier step times nothing then): on the H100 at c71a713 the swap-AB winner's prefetching twin at SmolLM2's
    1k static site was compiled and then skipped."""
    now = [100.0]
    monkeypatch.setattr(tuning.time, "perf_counter", lambda: now[0])

    def rule(plan, s, n):
        now[0] += 0.3
        return 50.0
    site = dataclasses.replace(CORNER, kv_len=N, kv_len_hint=None)
    ranked = _ranked(site)
    kernels = [p for p in ranked if p.kind == "split_kv"][:4]
    assert len(kernels) == 4
    for late in (True, False):
        samples = {kernels[0].runtime_key(): [50.0]}
        timings: dict = {}
        Tuner(Scripted(rule), cache, env=ENV, budget_s=4.0)._time_more(
            "twins", "twins", kernels[1:], ranked, site, samples, timings, {}, end=now[0] - 10.0, eager=False,
            late=late)
        timed = [p.runtime_key() in samples for p in kernels[1:]]
        assert timed == [late] * 3, (late, timings)  # not late: nothing once SIBLINGS_S past the budget
