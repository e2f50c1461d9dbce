"""The measured choice compiles every candidate at once before timing any (attnopt.tuning, attnopt.timer), on the CPU
with fake timers and clocks: the warm-up sees every candidate first, runs before the budget's clock starts, runs its
calls on threads at once, and takes the kernel variant that a captured graph replays."""
import os
import sys
import threading

import pytest
import torch

from attnopt import timer as T
from attnopt import tuning
from attnopt.site import AttentionSite
from attnopt.tuning import Tuner

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_tuning_cost import SMOL_1K  # noqa: E402
from test_tuning_method import ENV, _ranked, cache  # noqa: E402,F401  (cache: the fixture, a fresh cache directory)


class Warmed:
    """A fake timer with a warm-up: records the order of events; the warm-up advances the fake clock ``now[0]`` by
    ``warm_s``, a timing by ``cost_s``."""

    def __init__(self, now, warm_s=0.0, cost_s=0.0, rule=lambda p, s: 5.0, warm_error=None):
        self.now, self.warm_s, self.cost_s, self.rule, self.warm_error = now, warm_s, cost_s, rule, warm_error
        self.events, self.warm_lengths = [], []

    def warm_up(self, plans, site, eager=False):
        self.events.append(("warm", [p.runtime_key() for p in plans], eager))
        self.warm_lengths.append(site.kv_len)
        self.now[0] += self.warm_s
        if self.warm_error is not None:
            raise self.warm_error
        return {}

    def __call__(self, plan, site):
        self.events.append(("time", plan.runtime_key()))
        self.now[0] += self.cost_s
        return self.rule(plan, site)


@pytest.fixture
def clock(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(tuning.time, "perf_counter", lambda: now[0])
    return now


def test_every_candidate_is_warmed_once_before_any_is_timed(cache, clock):
    ranked = _ranked(SMOL_1K)
    plans = tuning.to_time(ranked, tuning.DEFAULT_TOP_K)
    timer = Warmed(clock, warm_s=1.5, cost_s=0.05)
    choice = Tuner(timer, cache, env=ENV, budget_s=4.0).choose(SMOL_1K, ranked)
    assert timer.events[0] == ("warm", [p.runtime_key() for p in plans], False)
    rest = timer.events[1:]
    later = [i for i, e in enumerate(rest) if e[0] == "warm"]
    at_length = rest[:later[0]] if later else rest
    assert [e[0] for e in at_length] == ["time"] * len(at_length)
    assert {e[1] for e in at_length} == {p.runtime_key() for p in plans}  # nothing skipped
    # a near tie timed again at the static cache's low fill is compiled there first, at once (split-KV's mask-tile
    # chunking is a compile-time constant of the key count), then timed: only what that warm-up compiled
    # (the grid siblings, the further configurations' nearest grids and the twins are warmed at the length itself,
    # before they are timed)
    record = cache.get(ENV, tuning.ShapeKey.of(SMOL_1K, 1088, False))
    afterwards = [record.get(name, []) for name in ("grid_siblings", "near_siblings", "twins")]
    assert later and all(n < SMOL_1K.kv_len or keys in afterwards
                         for n, (_, keys, _) in zip(timer.warm_lengths[1:], [rest[i] for i in later]))
    for i in later:
        following = [e for e in rest[i + 1:] if e[0] == "time"][:len(rest[i][1])]
        beside = {following[0][1]} if rest[i][1] in afterwards else set()  # timed beside the fastest
        assert {e[1] for e in following} <= set(rest[i][1]) | beside
    assert choice.choice == "measured" and not any(str(v).startswith("skipped") for v in choice.timings.values())
    assert cache.get(ENV, tuning.ShapeKey.of(SMOL_1K, 1088, False))["warm_up_s"] == 1.5


def test_the_budget_counts_the_timing_after_the_warm_up(cache, clock):
    """A warm-up of 3.9 s (longer than most of a 4 s budget) still leaves every compiled candidate timed: on the H100
    a budget that counted it left S=17/64/4/3 compiled but untimed at SmolLM2's 1k site (tune_s 4.47, pick 7.35 µs).
    The budget then stops new timings: at 1.5 s a timing, three fit in it (the third starts at 3 s)."""
    ranked = _ranked(SMOL_1K)
    plans = tuning.to_time(ranked, tuning.DEFAULT_TOP_K)
    timer = Warmed(clock, warm_s=3.9, cost_s=0.05)
    choice = Tuner(timer, cache, env=ENV, budget_s=4.0, rounds=1).choose(SMOL_1K, ranked)
    timed = [e[1] for e in timer.events if e[0] == "time"]
    assert timed[:len(plans)] == [p.runtime_key() for p in plans]  # (then the static cache's low fill, for ties)
    assert not any(str(v).startswith("skipped") for v in choice.timings.values())
    assert choice.tune_s == pytest.approx(3.9 * len(timer.warm_lengths) + len(timed) * 0.05)  # (with the low fill's)
    clock[0] = 0.0
    slow = Warmed(clock, warm_s=3.9, cost_s=1.5)
    choice = Tuner(slow, tuning.TuningCache(cache.path.parent / "other.json"), env=ENV, budget_s=4.0,
                   rounds=1).choose(SMOL_1K, ranked)
    assert [e[1] for e in slow.events if e[0] == "time"][:3] == [p.runtime_key() for p in plans[:3]]
    assert all(str(choice.timings[p.runtime_key()]).startswith("skipped") for p in plans[3:])


def test_no_budget_warms_only_what_is_always_timed(cache, clock):
    ranked = _ranked(SMOL_1K)
    plans = tuning.to_time(ranked, tuning.DEFAULT_TOP_K)
    timer = Warmed(clock)
    Tuner(timer, cache, env=ENV, budget_s=0.0).choose(SMOL_1K, ranked, graphed=False)
    assert timer.events[0] == ("warm", [p.runtime_key() for p in plans[:2]], False)  # no host_us: not eager


def test_a_failed_warm_up_still_times_every_candidate(cache, clock):
    ranked = _ranked(SMOL_1K)
    timer = Warmed(clock, warm_error=RuntimeError("no threads here"))
    Tuner(timer, cache, env=ENV, budget_s=4.0).choose(SMOL_1K, ranked)
    record = cache.get(ENV, tuning.ShapeKey.of(SMOL_1K, 1088, False))
    assert record["warm_up_errors"] == {"warm_up": "error: RuntimeError: no threads here"}
    afterwards = {k for name in ("grid_siblings", "near_siblings", "twins") for k in record.get(name, [])}
    assert {e[1] for e in timer.events if e[0] == "time"} == {p.runtime_key() for p in tuning.to_time(
        ranked, tuning.DEFAULT_TOP_K)} | afterwards


def test_run_concurrently_runs_the_pooled_calls_at_once_and_the_others_here():
    """Four pooled calls wait for each other at a barrier (one after another, the first would time out there), while
    the calling thread runs its own; errors come back by key."""
    here_thread, seen = threading.get_ident(), {}
    barrier = threading.Barrier(4, timeout=20)

    def pooled(i):
        def call():
            seen[i] = threading.get_ident()
            barrier.wait()
            if i == 3:
                raise ValueError("bad config\nsecond line")
        return call

    def here():
        seen["here"] = threading.get_ident()

    errors = T.run_concurrently({i: pooled(i) for i in range(4)}, {"here": here}, workers=16)
    assert errors == {3: "error: ValueError: bad config"}
    assert seen["here"] == here_thread and len({seen[i] for i in range(4)} | {here_thread}) == 5


def test_the_gpu_timers_warm_up_compiles_each_kernel_plan_on_a_thread_of_its_own(monkeypatch):
    """``GpuTimer.warm_up``: every kernel plan's first call on a pool thread, at once, in the captured graph's
    variant (``tma_now`` true there) and also in the eager one when ``eager``; the dense plans on the calling
    thread; meanwhile the timing's input sets made on another thread and the mask reduction compiled on a third (the
    warm-up's own set written down, not reduced); Triton's driver set up on the calling thread first."""
    from attnopt.runtime.kernels.common import tma_now

    ranked = _ranked(SMOL_1K)
    plans = tuning.to_time(ranked, tuning.DEFAULT_TOP_K)
    kernels = [p for p in plans if p.kind != "dense"]
    # the mask reduction is compiled where a timed plan takes a valid length (stream-K, a window's split-KV; a
    # static site's split-KV reads the mask itself): every kernel plan here, as if it did
    from attnopt.plan import reads_valid_keys
    monkeypatch.setattr(T, "uses_valid_len", reads_valid_keys)
    me, calls, made = threading.get_ident(), [], []
    # every kernel plan's thread, the input sets' one and the mask reduction's
    barrier = threading.Barrier(len(kernels) + 2, timeout=30)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    real = T.synthetic_inputs
    monkeypatch.setattr(T, "synthetic_inputs", lambda site, i, device="cuda", reduce=True: made.append(reduce) or
                        real(site, i, "cpu", reduce))

    def site_call(plan, site, s, state=None):
        def call():
            if not calls or calls[-1][0] != plan.runtime_key():
                barrier.wait() if plan.kind != "dense" else None
            calls.append((plan.runtime_key(), threading.get_ident(), tma_now(torch.device("cuda"))))
        return call
    monkeypatch.setattr(T, "site_call", site_call)
    monkeypatch.setattr(T.GpuTimer, "_input_sets", lambda self, site: barrier.wait())
    monkeypatch.setattr(T, "_start_triton_driver", lambda: calls.append(("driver", threading.get_ident(), None)))
    from attnopt.runtime import ops  # noqa: F401  (registers torch.ops.attnopt.*)

    reduced = []
    monkeypatch.setattr(torch.ops.attnopt, "valid_len_from_mask",
                        lambda mask, b: reduced.append((mask.shape, b)) or barrier.wait())
    site = SMOL_1K.__class__(**{**SMOL_1K.__dict__, "dtype": "float32"})
    errors = T.GpuTimer().warm_up(plans, site, eager=True)
    assert errors == {} and made == [False] and reduced == [((1, 1, 1, 1088), 1)]
    assert calls[0] == ("driver", me, None)  # Triton's driver set up here, before any thread launches
    by_plan = {}
    for key, thread, tma in calls[1:]:
        by_plan.setdefault(key, []).append((thread, tma))
    assert set(by_plan) == {p.runtime_key() for p in plans}
    for p in plans:
        (t1, tma1), (t2, tma2) = by_plan[p.runtime_key()]
        assert t1 == t2 and (t1 == me) == (p.kind == "dense") and (tma1, tma2) == (True, False)
    assert len({by_plan[p.runtime_key()][0][0] for p in kernels}) == len(kernels)


def test_the_unreduced_warm_up_set_has_the_reductions_values():
    for window in (None, 100):
        site = AttentionSite.canonical(q_heads=4, kv_heads=2, head_dim=64, kv_len=300, dtype="float32", batch=2,
                                       mask_kind="valid_length", window=window)
        reduced, written = T.synthetic_inputs(site, 0, "cpu"), T.synthetic_inputs(site, 0, "cpu", reduce=False)
        for name in ("q", "k", "v", "mask", "valid_len") + (("key_start",) if window else ()):
            assert torch.equal(reduced[name], written[name]), name
            assert reduced[name].dtype == written[name].dtype, name


def test_tma_as_captured_holds_on_its_own_thread_only(monkeypatch):
    from attnopt.runtime.kernels.common import tma_as_captured, tma_now

    monkeypatch.delenv("ATTNOPT_TMA_EAGER", raising=False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    cuda, other = torch.device("cuda"), []
    assert not tma_now(cuda)
    with tma_as_captured():
        assert tma_now(cuda)
        thread = threading.Thread(target=lambda: other.append(tma_now(cuda)))
        thread.start()
        thread.join()
        with tma_as_captured():
            pass
        assert tma_now(cuda)
    assert other == [False] and not tma_now(cuda)


def test_the_timers_input_sets_launch_no_mask_reduction(monkeypatch):
    """The input sets' valid lengths are written down: timing a static cache's low fill (another length, another
    tile of the reduction) compiles nothing but what it times."""
    from test_tuning_method import _gpu_on_the_cpu

    from attnopt.runtime import ops  # noqa: F401  (registers torch.ops.attnopt.*)

    _gpu_on_the_cpu(monkeypatch)
    for name in ("valid_len_from_mask", "key_range_from_mask"):
        monkeypatch.setattr(torch.ops.attnopt, name, lambda *a: pytest.fail("a mask reduction was launched"))
    for window in (None, 100):
        site = AttentionSite.canonical(q_heads=4, kv_heads=2, head_dim=64, kv_len=256, dtype="float32",
                                       mask_kind="valid_length", window=window)
        sets = T.GpuTimer()._input_sets(site)
        assert len(sets) > 1 and all(s["valid_len"].tolist() == [256] for s in sets)
        assert window is None or all(s["key_start"].tolist() == [156] for s in sets)


def cuda_stand_ins(monkeypatch):
    """``GpuTimer.warm_up`` on the CPU: CUDA's device calls, the input sets and Triton's driver stood in."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    real = T.synthetic_inputs
    monkeypatch.setattr(T, "synthetic_inputs", lambda site, i, device="cuda", reduce=True: real(site, i, "cpu", reduce))
    monkeypatch.setattr(T, "_start_triton_driver", lambda: None)
    monkeypatch.setattr(T.GpuTimer, "_input_sets", lambda self, site: None)


def test_distributed_and_dense_plans_are_warmed_here_in_order(monkeypatch):
    """A distributed plan's first call issues collectives, which every rank must issue in one order: the warm-up
    makes those (and the dense plans') on the calling thread, one after another in the candidates' order."""
    from attnopt.plan import DensePlan, RingPlan, SplitKVPlan, TreePlan

    cuda_stand_ins(monkeypatch)
    me, calls = threading.get_ident(), []
    monkeypatch.setattr(T, "site_call", lambda plan, site, s, state=None:
                        lambda: calls.append((plan.kind, threading.get_ident() == me)))
    plans = [TreePlan(world=2), SplitKVPlan(num_splits=2, block_n=64), DensePlan(backend="cudnn"),
             RingPlan(world=2), TreePlan(world=2, collective="all_reduce")]
    site = AttentionSite.canonical(q_heads=4, kv_heads=2, head_dim=64, kv_len=256, dtype="float32")
    assert T.GpuTimer().warm_up(plans, site) == {}
    assert [k for k, here in calls if here] == ["tree", "dense", "ring", "tree"]
    assert [k for k, here in calls if not here] == ["split_kv"]


def test_the_warm_up_threads_come_from_the_environment(monkeypatch):
    monkeypatch.delenv(T.WARM_WORKERS_ENV, raising=False)
    assert T.warm_workers() == T.WARM_WORKERS == 16 and T.warm_workers(3) == 3
    monkeypatch.setenv(T.WARM_WORKERS_ENV, " 1 ")
    assert T.warm_workers() == 1
    for bad in ("-1", "two", "1.5"):
        monkeypatch.setenv(T.WARM_WORKERS_ENV, bad)
        with pytest.raises(ValueError, match="ATTNOPT_TUNE_WARM_WORKERS.*expected a whole number"):
            T.warm_workers()
    monkeypatch.setenv(T.WARM_WORKERS_ENV, "0")  # no warm-up: nothing made, nothing called
    monkeypatch.setattr(T, "synthetic_inputs", lambda *a, **k: pytest.fail("the warm-up ran"))
    assert T.GpuTimer().warm_up([tuning.to_time(_ranked(SMOL_1K), 1)[0]], SMOL_1K) == {}


def test_a_bad_warm_up_setting_stops_the_tuner_with_its_name(cache, clock, monkeypatch):
    monkeypatch.setenv(T.WARM_WORKERS_ENV, "many")
    with pytest.raises(ValueError, match="ATTNOPT_TUNE_WARM_WORKERS='many'"):
        Tuner(Warmed(clock), cache, env=ENV).choose(SMOL_1K, _ranked(SMOL_1K))


# ---------------------------------------------------------------------------------------- on a GPU
@pytest.mark.cuda
def test_after_the_warm_up_timing_compiles_nothing(monkeypatch):
    """On the GPU: SmolLM2's 1k static site (bf16), fresh in-process kernel caches; the warm-up's first calls (on
    threads, at once) fail nowhere, and timing every candidate and the valid length afterwards goes through Triton's
    launch path (``kernel[grid]``, where a compile happens) not once: the warm-up compiled what the timing runs."""
    import dataclasses

    from attnopt.runtime.kernels import merge, split_kv, valid_len

    monkeypatch.delenv(T.WARM_WORKERS_ENV, raising=False)
    site = dataclasses.replace(SMOL_1K, dtype="bfloat16")
    plans = tuning.to_time(_ranked(site), tuning.DEFAULT_TOP_K)
    launchers = (split_kv._SPLIT_KV_LAUNCH, merge._MERGE_LAUNCH, valid_len._VALID_LEN_LAUNCH)
    timer = T.GpuTimer()
    try:
        assert timer.warm_up(plans, site) == {}
        before = [launcher.jit for launcher in launchers]
        times = {p.runtime_key(): timer(p, site) for p in plans}
        if any(T.uses_valid_len(p, site) for p in plans):  # as the tuner does: split-KV reads the mask by tiles
            timer.valid_len_us(site)
        assert [launcher.jit for launcher in launchers] == before
        assert all(t > 0 for t in times.values()), times
    finally:
        timer.release()
