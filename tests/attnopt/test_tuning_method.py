"""How the measured choice measures (attnopt.tuning, attnopt.timer), on the CPU with fake timers and a fake GPU:
round-robin medians, the valid length charged per sharing site, prepare() outside the timed region, the input
rotation, and the cache key's invalidation by versions, shape bucket, dtype and valid-length sharing."""
import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

import attnopt
from attnopt import timer as T
from attnopt import tuning
from attnopt import tuning_candidates
from attnopt.config import OptimizeConfig
from attnopt.hardware import builtin_profile
from attnopt.passes.plan import plan_site, rank_candidates
from attnopt.plan import DensePlan, SplitKVPlan, StreamKPlan, reads_valid_keys
from attnopt.runtime.strategies import PlanContext
from attnopt.site import AttentionSite
from attnopt.tuning import ShapeKey, Tuner, TuningCache

ENV = {"device": "NVIDIA H100 80GB HBM3", "driver": "570.1", "torch": "2.11.0", "triton": "3.6.0",
       "attnopt": "0.1.0", "tuning": str(tuning.TUNING_VERSION)}
CUDA_CTX = PlanContext(device_type="cuda", triton_available=True)
HW = builtin_profile("h100-sxm")
#: SmolLM2's decode site over a 1k static cache (a valid-length mask), the shape of the first GPU run.
STATIC = AttentionSite.canonical(q_heads=9, kv_heads=3, head_dim=64, kv_len=1024, mask_kind="valid_length")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNOPT_CACHE_DIR", str(tmp_path))
    return TuningCache()


def _ranked(site):
    return rank_candidates(site, HW, CUDA_CTX, OptimizeConfig())[0]


def rounds_only(monkeypatch):
    """The tuner times its candidates' rounds (and tie-breaks and duels) but no grid siblings or twins after them:
    for tests that count the rounds' calls."""
    from attnopt.tuning_rounds import TimingRounds

    monkeypatch.setattr(TimingRounds, "_time_siblings", lambda self, *a, **k: {})
    monkeypatch.setattr(TimingRounds, "_time_twins", lambda self, *a, **k: {})


class Scripted:
    """A fake timer: ``rule(plan, site, round) -> µs``; records the order of its calls."""

    def __init__(self, rule, valid_len=None):
        self.rule, self.calls, self.valid_len_calls = rule, [], 0
        if valid_len is not None:
            def valid_len_us(site):
                self.valid_len_calls += 1
                return valid_len
            self.valid_len_us = valid_len_us

    def __call__(self, plan, site):
        key = plan.runtime_key()
        n = sum(1 for k in self.calls if k == key)
        self.calls.append(key)
        return self.rule(plan, site, n)


def test_candidates_are_timed_round_robin_and_keep_their_median(cache, monkeypatch):
    monkeypatch.setattr(tuning_candidates, "TWIN_PLANS", 0)  # (the twins timed after the siblings: test_tuning_twins)
    ranked = _ranked(AttentionSite.canonical())
    plans = tuning.to_time(ranked, tuning.DEFAULT_TOP_K)
    first, cudnn = plans[0].runtime_key(), next(p for p in plans if getattr(p, "backend", "") == "cudnn").runtime_key()

    def rule(plan, site, n):  # the model's pick has one slow outlier round (clocks ramping); the rest are steady
        if plan.runtime_key() == first:
            return (13.2, 10.0, 11.0)[n]
        return 11.5 if plan.runtime_key() == cudnn else 12.5
    timer = Scripted(rule)
    choice = Tuner(timer, cache, env=ENV, rounds=3).choose(AttentionSite.canonical(), ranked)
    keys = [p.runtime_key() for p in plans]
    # round-robin: every candidate once per round, in the same order; the third round only for those within
    # PRUNE_LATE of the best's median of two (11.6 and 11.5 here; the others, 12.5, are 7.8 % behind)
    third = [k for k in keys if k in (first, cudnn)]
    assert timer.calls[:2 * len(keys) + 2] == keys * 2 + third
    # then the other grids of the fastest kernel configurations (compiled already), beside the fastest kernel plan
    record = cache.get(ENV, ShapeKey.of(AttentionSite.canonical(), 8192, False))
    siblings = record["grid_siblings"]
    near = record.get("near_siblings", [])  # (grids of further close configurations: test_tuning_twins)
    assert siblings and not set(siblings) & set(keys)
    assert set(timer.calls[2 * len(keys) + 2:]) == set(siblings) | set(near) | {first}
    assert "duel" not in record  # 11.0 against 11.5: more than DUEL_WITHIN apart
    assert choice.plan.runtime_key() == first and choice.measured_us == 11.0  # the median, not the mean (11.4)
    assert record["samples"][first][:3] == [13.2, 10.0, 11.0] and record["rounds"] == 3


@pytest.fixture
def charged_kernels(monkeypatch):
    """Every kernel plan of a masked site takes a device valid length, as split-KV did before it read the mask over
    its own tiles (stream-K still does): the charge's arithmetic, tested on the candidates a static site times."""
    monkeypatch.setattr(tuning, "uses_valid_len", reads_valid_keys)


def test_candidates_far_behind_after_the_first_round_are_not_timed_again(cache, charged_kernels, monkeypatch):
    """A candidate over PRUNE slower than the best in round 1 (its valid-length share included) keeps its one
    sample; the close ones get every round (grid siblings and twins off: their own tests)."""
    rounds_only(monkeypatch)
    site = STATIC
    ranked = _ranked(site)
    best_kernel = next(p for p in ranked if p.kind != "dense").runtime_key()

    def rule(plan, site, n):
        if plan.kind == "dense":
            return 10.0
        return 9.0 if plan.runtime_key() == best_kernel else 20.0  # + 1.5 µs of valid length: 10.5 and 21.5
    timer = Scripted(rule, valid_len=1.5)
    choice = Tuner(timer, cache, env=ENV, rounds=3).choose(site, ranked)
    counts = {k: timer.calls.count(k) for k in set(timer.calls)}
    slow = [k for k in counts if '"dense"' not in k and k != best_kernel]
    # the best kernel plan: three rounds, then once at the low fill (a dense winner of a static cache is judged
    # there against it: STATIC_DENSE_TIE); the scripted times do not shrink with the fill, so cuDNN stays
    assert slow and all(counts[k] == 1 for k in slow) and counts[best_kernel] == 4
    assert all(n == 3 for k, n in counts.items() if k not in slow and k != best_kernel)
    assert choice.plan.backend == "cudnn" and choice.measured_us == 10.0
    assert tuning.PRUNE == 0.15


def test_later_rounds_stop_when_the_budget_is_spent(cache):
    timer = Scripted(lambda p, s, n: 5.0)
    Tuner(timer, cache, env=ENV, rounds=3, budget_s=0.0).choose(AttentionSite.canonical(),
                                                               _ranked(AttentionSite.canonical()))
    assert len(timer.calls) == 2  # round 1: the model's pick and the first SDPA backend only; no round 2


@pytest.mark.parametrize("sharing,winner", [(1, "dense"), (30, "split_kv")])
def test_the_valid_length_is_charged_per_sharing_site(cache, sharing, winner, charged_kernels):
    """The first GPU run's failure, with its numbers: split-KV runs in 9.2 µs, cuDNN over the mask in 21 µs, and
    the device valid length costs 15 µs per step. Charged whole to each site, split-KV (24.2 µs) loses; shared by
    SmolLM2's 30 layers (0.5 µs each), it wins. Dense plans take the mask and are never charged."""
    def rule(plan, site, n):
        if plan.kind == "dense":
            return 21.0 if plan.backend == "cudnn" else 40.0
        return 9.2 if plan.kind == "split_kv" else 30.0
    timer = Scripted(rule, valid_len=15.0)
    choice = Tuner(timer, cache, env=ENV).choose(STATIC, _ranked(STATIC), valid_len_sharing=sharing)
    assert choice.plan.kind == winner and timer.valid_len_calls == 1
    split = [v for k, v in choice.timings.items() if '"split_kv"' in k]
    assert min(split) == pytest.approx(9.2 + 15.0 / sharing)
    assert [v for k, v in choice.timings.items() if '"cudnn"' in k] == [21.0]
    record = cache.get(ENV, ShapeKey.of(STATIC, 1024, False, sharing))
    assert record["valid_len_us"] == 15.0 and record["valid_len_sharing"] == sharing
    assert cache.get(ENV, ShapeKey.of(STATIC, 1024, False, 31 - sharing)) is None  # the sharing is in the key


def test_no_valid_length_is_timed_without_a_mask(cache):
    timer = Scripted(lambda p, s, n: 5.0, valid_len=15.0)
    Tuner(timer, cache, env=ENV).choose(AttentionSite.canonical(), _ranked(AttentionSite.canonical()))
    assert timer.valid_len_calls == 0


def test_split_kv_over_a_static_mask_is_charged_no_valid_length(cache):
    """Split-KV reads the mask over its own tiles: at a static cache (no window) it is charged nothing, and where no
    timed candidate takes a valid length none is timed; at a sliding window it takes the window's range (a scan)."""
    def rule(plan, site, n):
        return 21.0 if plan.kind == "dense" else 9.2
    timer = Scripted(rule, valid_len=15.0)
    choice = Tuner(timer, cache, env=ENV).choose(STATIC, _ranked(STATIC))
    assert choice.plan.kind == "split_kv" and choice.measured_us == 9.2 and timer.valid_len_calls == 0
    assert not tuning.uses_valid_len(choice.plan, STATIC) and reads_valid_keys(choice.plan, STATIC)
    assert tuning.uses_valid_len(choice.plan, dataclasses.replace(STATIC, window=256))
    assert not reads_valid_keys(DensePlan(), STATIC)
    assert ShapeKey.of(AttentionSite.canonical(), 8192, False, 30).valid_len_sharing == 0


class Listening(Tuner):
    """A tuner (fake timer, one kernel candidate) that records the keyword arguments the planner gives it."""

    def __init__(self, cache):
        super().__init__(Scripted(lambda p, s, n: 1.0), cache, env=ENV, top_k=1)
        self.heard = []

    def choose(self, site, ranked, **kw):
        self.heard.append(kw)
        return super().choose(site, ranked, **kw)


def test_the_plan_pass_counts_the_sites_that_share_a_mask(cache):
    """Three attention calls over one mask (a decoder's layers): the tuner hears ``valid_len_sharing=3`` for
    each; a site with its own mask hears 1."""
    torch._dynamo.reset()

    def layers(q, k, v, mask, other):
        o = q
        for _ in range(3):
            o = F.scaled_dot_product_attention(o, k, v, attn_mask=mask, enable_gqa=True)
        return F.scaled_dot_product_attention(o, k, v, attn_mask=other, enable_gqa=True)

    q, k, v = torch.randn(2, 4, 1, 64), torch.randn(2, 2, 48, 64), torch.randn(2, 2, 48, 64)
    mask = (torch.arange(48) < 30)[None, None, None, :].expand(2, 1, 1, 48).contiguous()
    other = (torch.arange(48) < 20)[None, None, None, :].expand(2, 1, 1, 48).contiguous()
    with tuning.use_tuner(Listening(cache)) as tuner:
        opt = attnopt.optimize(layers, inner_backend="eager", dynamic=False)
        out = opt(q, k, v, mask, other)
    torch.testing.assert_close(out, layers(q, k, v, mask, other), atol=1e-5, rtol=1e-5)
    assert sorted(kw["valid_len_sharing"] for kw in tuner.heard) == [1, 3, 3, 3]


# ---------------------------------------------------------------------------------------- the GPU timer, faked
class _Props:
    L2_cache_size = 1 << 20


def _gpu_on_the_cpu(monkeypatch):
    """The GPU timer's CUDA queries answered for a big GPU with a 1 MB L2, its input sets made on the CPU."""
    real_inputs = T.synthetic_inputs
    monkeypatch.setattr(T, "synthetic_inputs", lambda site, i, device="cuda", reduce=True:
                        real_inputs(site, i, device="cpu", reduce=reduce))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (1 << 34, 1 << 35))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: _Props())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)


class _Recording:
    """A strategy standing in for the real one: records prepare and run calls and what run was given."""

    def __init__(self, log):
        self.log = log

    def prepare(self, plan, q, k, v):
        self.log.append(("prepare",))
        return "state"

    def run(self, state, plan, q, k, v, mask, valid_len, scale, is_causal):
        self.log.append(("run", state, k.data_ptr(), valid_len))
        return q


def test_gpu_timer_times_run_only_over_every_set_with_the_valid_length_precomputed(monkeypatch):
    """prepare() once, before the timed region; the timed function calls only run(), cycling over every input
    set (the graph holds at least one call per set), each with the valid length computed once for its set."""
    import attnopt.bench.common as common
    import attnopt.runtime.strategies as strategies

    log = []
    strategy = _Recording(log)
    monkeypatch.setattr(strategies, "get_strategy", lambda kind: strategy)
    _gpu_on_the_cpu(monkeypatch)
    seen = {}

    est_ms = [0.01]  # the eager ms of one call that the capture reports

    def fake_capture(fn, *, target_ms=5.0, min_calls=4, capture_error_mode="global", floor=4, long_ms=None):
        seen.update(min_calls=min_calls, log_at_start=list(log), capture_error_mode=capture_error_mode,
                    captures=seen.get("captures", 0) + 1, floor=floor, long_ms=long_ms)
        for _ in range(min_calls):
            fn()
        return "graph", min_calls, est_ms[0]

    def fake_replay(graph, calls, replays, preroll_ms=0.0):
        assert preroll_ms == common.REPLAY_PREROLL_MS  # (in the plan pass: no other thread to pause the host longer)
        seen.setdefault("replays", []).append((graph, calls))
        seen.setdefault("replay_counts", []).append(replays)
        return 7.5
    monkeypatch.setattr(common, "captured_calls_estimated", fake_capture)
    monkeypatch.setattr(common, "replayed_us", fake_replay)
    site = AttentionSite.canonical(q_heads=4, kv_heads=2, head_dim=64, kv_len=256, dtype="float32",
                                   mask_kind="valid_length")
    timer = T.GpuTimer(warm_ms=0.0)
    plan = StreamKPlan(grid=2, block_n=16)  # a plan that takes the valid length (split-KV reads the mask itself)
    assert timer(plan, site) == 7.5
    sets = timer._sets
    assert len(sets) == 16  # 4 x 1 MB of L2 over 256 kB sets
    assert seen["min_calls"] == len(sets) and seen["replays"] == [("graph", len(sets))]
    assert seen["capture_error_mode"] == "thread_local"  # other threads' CUDA calls (an inner compile) stay legal
    assert seen["log_at_start"][0] == ("prepare",) and log.count(("prepare",)) == 1
    assert all(e[0] == "run" for e in seen["log_at_start"][1:])  # only the warm-up ran before timing began
    runs = [e for e in log[len(seen["log_at_start"]):]]
    assert all(e[0] == "run" for e in runs) and len(runs) == len(sets)
    assert [e[2] for e in runs] == [s["k"].data_ptr() for s in sets]  # one call per set, in turn
    assert all(e[3] is s["valid_len"] for e, s in zip(runs, sets))  # the set's own, computed once
    assert sets[0]["valid_len"].tolist() == [256] and T.STATIC_FILL == 1.0  # a static cache is timed full
    # a later round of the same plan replays the graph it captured: no new prepare, capture or run call
    calls_before = len(log)
    assert timer(plan, site) == 7.5 and seen["captures"] == 1 and len(log) == calls_before
    assert seen["replays"] == [("graph", len(sets))] * 2
    timer.release()  # a new shape (or the end of the tuning) drops the graphs with the sets
    assert timer(plan, site) == 7.5 and seen["captures"] == 2 and log.count(("prepare",)) == 2
    # a short call is replayed REPLAYS times; a call of LONG_CALL_MS or more (sized by one eager call, in a graph
    # of at least LONG_CALLS calls) LONG_REPLAYS times, in every later round too
    assert seen["replay_counts"] == [T.REPLAYS] * 3 and seen["floor"] == T.LONG_CALLS < 4
    assert seen["long_ms"] == T.LONG_CALL_MS
    timer.release()
    est_ms[0] = 2.5
    assert timer(plan, site) == 7.5 and timer(plan, site) == 7.5
    assert seen["replay_counts"][3:] == [T.LONG_REPLAYS] * 2 and T.LONG_REPLAYS < T.REPLAYS
    assert T.site_call(DensePlan(), site, sets[0], "s") is not None  # dense takes the mask, no valid length


def test_set_count_spans_the_l2_within_memory():
    assert T.set_count(1 << 20, 50 << 20, 1 << 40) == 200  # 4 x 50 MB of 1 MB sets
    assert T.set_count(1 << 30, 50 << 20, 1 << 40) == 1
    assert T.set_count(1 << 10, 50 << 20, 1 << 40) == T.MAX_SETS
    assert T.set_count(1 << 20, 50 << 20, 8 << 20) == 4  # half the free memory
    with pytest.raises(MemoryError, match="GB free"):
        T.set_count(1 << 30, 50 << 20, 1 << 30)


# ---------------------------------------------------------------------------------------- cache keys
def test_environment_key_follows_the_installed_versions(monkeypatch):
    import triton

    from attnopt import __version__

    env = tuning.environment_key()
    assert env["torch"] == torch.__version__ and env["triton"] == triton.__version__
    assert env["attnopt"] == __version__ and env["tuning"] == str(tuning.TUNING_VERSION) and env["device"] == "cpu"
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    monkeypatch.setattr(triton, "__version__", "8.8.8")
    monkeypatch.setattr(attnopt, "__version__", "7.7.7")
    changed = tuning.environment_key()
    assert (changed["torch"], changed["triton"], changed["attnopt"]) == ("9.9.9", "8.8.8", "7.7.7")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "NVIDIA H200")
    assert tuning.environment_key()["device"] == "NVIDIA H200"


def test_a_new_environment_measures_again_and_both_records_persist(cache):
    site = AttentionSite.canonical()
    ranked = _ranked(site)
    Tuner(Scripted(lambda p, s, n: 5.0), cache, env=ENV).choose(site, ranked)
    for field, value in (("torch", "2.13.0"), ("triton", "3.7.1"), ("attnopt", "0.2.0"), ("device", "NVIDIA H200"),
                         ("tuning", "1")):
        timer = Scripted(lambda p, s, n: 5.0)
        assert Tuner(timer, TuningCache(), env={**ENV, field: value}).choose(site, ranked).choice == "measured"
        assert timer.calls
    assert Tuner(Scripted(lambda p, s, n: pytest.fail("timed")), TuningCache(), env=ENV).choose(
        site, ranked).choice == "cached"
    assert len(json.loads(cache.path.read_text())["records"]) == 6


def test_bucket_and_dtype_are_in_the_key(cache):
    site = dataclasses.replace(AttentionSite.canonical(), kv_len=None, kv_len_hint=3000)
    tuner = Tuner(Scripted(lambda p, s, n: 5.0), cache, env=ENV, buckets=(2048, 4096))
    tuner.choose_bucketed(site, lambda at: _ranked(at))
    n = tuning.hint_length(3000, 4096, (2048, 4096))  # the hint's bucket (2048, 4096] is timed, and keyed, at the
    assert n == 3008  # hint rounded up to 16 keys; the other bucket at its middle
    other = tuning.bucket_length(2048, (2048, 4096))
    assert cache.get(ENV, ShapeKey.of(dataclasses.replace(site, kv_len=n), n, True)) is not None
    assert cache.get(ENV, ShapeKey.of(dataclasses.replace(site, kv_len=other), other, True)) is not None
    assert cache.get(ENV, ShapeKey.of(dataclasses.replace(site, kv_len=n), n, False)) is None  # exact != bucket
    middle = tuning.bucket_length(4096, (2048, 4096))
    assert cache.get(ENV, ShapeKey.of(dataclasses.replace(site, kv_len=middle), middle, True)) is None
    fp16 = dataclasses.replace(site, kv_len=n, dtype="float16")
    assert cache.get(ENV, ShapeKey.of(fp16, n, True)) is None


def test_a_measurement_of_tuning_version_1_is_not_reused(cache):
    """Records of the first timer (version 1, which mismeasured kernel plans at masked sites) carry the old
    version in their key, so this version measures again."""
    site = STATIC
    old_env = {**ENV, "tuning": "1"}
    cache.put(old_env, ShapeKey.of(site, 1024, False), {"winner": DensePlan(backend="cudnn").to_dict(),
                                                        "measured_us": 21.0})
    timer = Scripted(lambda p, s, n: 5.0 if p.kind == "split_kv" else 21.0, valid_len=1.0)
    choice = Tuner(timer, cache, env=ENV).choose(site, _ranked(site), valid_len_sharing=30)
    assert choice.choice == "measured" and choice.plan.kind == "split_kv"


# ---------------------------------------------------------------------------------------- on a GPU
@pytest.mark.cuda
def test_gpu_timer_agrees_with_the_kernels_bench_and_the_choice_is_no_slower_than_cudnn(cache):
    """The tuner's time of a kernel plan equals ``attnopt bench kernels``' way of timing it (valid length given
    directly, the same rotation and CUDA-graph timing) within 25 %; at SmolLM2's 1k static-cache site shared by 30
    layers, the measured winner is no slower than cuDNN over the mask (the first GPU run's wrong pick)."""
    from attnopt.bench.common import Rotation, cycle, time_us
    from attnopt.bench.kernels import _make_set, plan_call

    site = dataclasses.replace(STATIC, dtype="bfloat16")
    ranked = _ranked(site)
    kernel = next(p for p in ranked if p.kind == "split_kv")
    tuned_us = T.gpu_timer(kernel, site)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    set_bytes = 3 * 1024 * 128 * 2
    valid = int(1024 * T.STATIC_FILL)  # the bench's sets hold what the tuner's hold
    rot = Rotation(lambda i: _make_set(i, 1, 9, 3, 64, 1024, 1, valid, torch.bfloat16), set_bytes, l2,
                   max_sets=T.MAX_SETS)
    calls = [plan_call(kernel, s, 0.125) for s in rot.sets]
    bench_us = time_us(cycle(calls), "graph", target_ms=2.0, replays=5, min_calls=len(calls))
    assert 0.8 <= tuned_us / bench_us <= 1.25, (tuned_us, bench_us)
    valid_len_us = T.gpu_timer.valid_len_us(site)
    assert valid_len_us > 0
    choice = Tuner(cache=cache, env=tuning.environment_key()).choose(site, ranked, valid_len_sharing=30)
    assert choice.choice == "measured"
    import argparse

    from attnopt.bench.kernels import _peer_methods

    peers = {m.name: m for m in _peer_methods(1, 9, 3, 64, 1024, valid, 0.125,
                                              argparse.Namespace(no_flex=True, no_eager_peer=True))}
    cudnn_us = time_us(cycle([peers["sdpa-cudnn"].make(s) for s in rot.sets]), "graph", target_ms=2.0, replays=5,
                       min_calls=len(rot.sets))
    if choice.plan.kind == "dense":
        winner_us = cudnn_us if choice.plan.backend == "cudnn" else choice.measured_us
    else:  # timed independently, the bench's way, plus its share of the valid length
        winner_us = time_us(cycle([plan_call(choice.plan, s, 0.125) for s in rot.sets]), "graph", target_ms=2.0,
                            replays=5, min_calls=len(rot.sets)) + valid_len_us / 30
    assert winner_us <= 1.05 * cudnn_us, (choice.plan.describe(), winner_us, cudnn_us)
    T.gpu_timer.release()


def test_tune_charges_each_preset_site_its_share_of_the_valid_length(cache, charged_kernels):
    """``attnopt tune smollm2 --mask valid_length`` charges each of SmolLM2's 30 layers 1/30 of the valid
    length; a bare shape is one site (``--layers`` overrides both)."""
    import argparse

    from attnopt.commands.tune import build_sites, layers_of, tune_sites

    assert layers_of("smollm2", None) == 30 and layers_of("9/3x64", None) == 1 and layers_of("9/3x64", 12) == 12
    with pytest.raises(ValueError, match="--layers 0"):
        layers_of("smollm2", 0)
    args = argparse.Namespace(shapes=["smollm2", "9/3x64"], context="1k", batch="1", q_len="1", dtype="bfloat16",
                              mask="valid_length", symbolic=False)

    def rule(plan, site, n):
        if plan.kind == "dense":
            return 21.0 if plan.backend == "cudnn" else 40.0
        return 9.2 if plan.kind == "split_kv" else 30.0
    rows = tune_sites(build_sites(args), Tuner(Scripted(rule, valid_len=15.0), cache, env=ENV), HW, CUDA_CTX,
                      {spec: layers_of(spec, None) for spec in args.shapes})
    assert rows[0]["plan"].startswith("split_kv") and rows[0]["measured_us"] == pytest.approx(9.7)
    assert "cudnn" in rows[1]["plan"] and rows[1]["measured_us"] == 21.0


# ---------------------------------------------------------------------------------------- the default pick: cuDNN
def test_hopper_offers_cudnn_first_and_a_masked_dense_site_gets_it_without_tuning():
    """On H100/H200 profiles the dense plan is cuDNN (measured no slower than flash on every decode shape there, and
    23x faster than SDPA's own masked pick, the memory-efficient kernel); elsewhere SDPA's own pick stays first."""
    from attnopt.cost import kernel as K
    from attnopt.runtime.strategies.dense import Dense

    site = AttentionSite.canonical(head_dim=112, kv_len=32768, mask_kind="valid_length")  # no kernel takes D=112
    report = plan_site(site, HW, CUDA_CTX, OptimizeConfig())
    assert report.chosen.kind == "dense" and report.chosen.backend == "cudnn"
    auto = next(c for c in report.candidates if c.kind == "dense" and c.backend == "auto")
    assert auto.est_us > 10 * report.chosen.est_us  # SDPA's own pick with a mask: the efficient kernel
    unmasked = AttentionSite.canonical(head_dim=112, kv_len=32768)
    assert K.cudnn_us(site, HW) == pytest.approx(K.dense_us(unmasked, HW) + 32768 / (HW.hbm_read_gbps * 1e3))
    assert plan_site(unmasked, HW, CUDA_CTX, OptimizeConfig()).chosen.backend == "cudnn"  # ties: cuDNN first
    a100 = builtin_profile("a100-80gb")
    assert [p.backend for p in Dense().candidates(unmasked, a100, CUDA_CTX)][0] == "auto"
    assert [p.backend for p in Dense().candidates(unmasked, HW, CUDA_CTX)][:2] == ["cudnn", "auto"]
    assert [p.backend for p in Dense().candidates(unmasked, HW, PlanContext())] == ["auto"]  # CPU: SDPA's own


def test_a_backend_that_cannot_run_falls_back_to_sdpas_own_pick(caplog):
    """A planned cuDNN plan on a build or GPU without it (here: the CPU) is found out in prepare(), outside any
    capture, and runs as SDPA's own pick: slower, never an error."""
    import logging

    from attnopt.runtime.reference import decode_attention
    from attnopt.runtime.strategies.dense import Dense

    q, k, v = torch.randn(2, 6, 1, 32), torch.randn(2, 2, 40, 32), torch.randn(2, 2, 40, 32)
    plan = DensePlan(backend="cudnn")
    with caplog.at_level(logging.WARNING, logger="attnopt"):
        state = Dense().prepare(plan, q, k, v)
    assert state == "auto" and any("cannot run" in r.getMessage() for r in caplog.records)
    valid = torch.tensor([40, 17])
    out = Dense().run(state, plan, q, k, v, None, valid, 0.2, False)
    torch.testing.assert_close(out, decode_attention(q, k, v, valid_len=valid, scale=0.2), atol=1e-5, rtol=1e-5)


def test_the_default_switch_and_the_environment_variable(monkeypatch):
    monkeypatch.delenv(tuning.TUNE_ENV, raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(tuning, "TUNE_BY_DEFAULT", False)
    assert tuning.default_tuner("cuda", True) is None
    monkeypatch.setattr(tuning, "TUNE_BY_DEFAULT", True)
    assert isinstance(tuning.default_tuner("cuda", True), Tuner)
    assert tuning.default_tuner("cpu", True) is None  # never off CUDA
    monkeypatch.setenv(tuning.TUNE_ENV, "off")
    assert tuning.default_tuner("cuda", True) is None
    monkeypatch.setattr(tuning, "TUNE_BY_DEFAULT", False)
    monkeypatch.setenv(tuning.TUNE_ENV, "yes")
    assert isinstance(tuning.default_tuner("cuda", True), Tuner)
    monkeypatch.setenv(tuning.TUNE_ENV, "sometimes")
    with pytest.raises(ValueError, match="ATTNOPT_TUNE='sometimes': expected 1/true/yes/on or 0/false/no/off"):
        tuning.default_tuner("cuda", True)


# ---------------------------------------------------------------------------------------- graphs or not
class HostAware(Scripted):
    """A fake timer with host times: ``host(plan) -> µs`` per call issued eagerly."""

    def __init__(self, rule, host, valid_len=None):
        super().__init__(rule, valid_len)
        self.host = host

    def host_us(self, plan, site):
        return self.host(plan)


def test_without_cuda_graphs_a_call_costs_the_longer_of_device_and_host_time(cache):
    """Split-KV: 9 µs on the device but 33 µs of host launches; cuDNN: 12 µs and 15 µs (the dispatch bench's host
    costs on the H100). Replayed as CUDA graphs split-KV wins; launched eagerly cuDNN does."""
    site = AttentionSite.canonical(q_heads=9, kv_heads=3, head_dim=64, kv_len=1024)
    ranked = _ranked(site)

    def rule(plan, site, n):
        return 12.0 if plan.kind == "dense" else 9.0

    def host(plan):
        return 15.0 if plan.kind == "dense" else 33.0
    graphed = Tuner(HostAware(rule, host), cache, env=ENV).choose(site, ranked, graphed=True)
    eager = Tuner(HostAware(rule, host), cache, env=ENV).choose(site, ranked, graphed=False)
    assert graphed.plan.kind != "dense" and graphed.measured_us == 9.0
    assert eager.plan.kind == "dense" and eager.measured_us == 15.0
    record = cache.get(ENV, ShapeKey.of(site, 1024, False, graphed=False))
    assert record["host_us"] and record["device_us"] and ShapeKey.of(site, 1024, False) != ShapeKey.of(
        site, 1024, False, graphed=False)


def test_the_backend_tells_the_planner_whether_its_graph_replays_as_cuda_graphs(cache):
    from attnopt.backend import replays_as_cuda_graphs
    from attnopt.passes import make_context

    assert replays_as_cuda_graphs("inductor", "reduce-overhead") and replays_as_cuda_graphs("cudagraphs", None)
    assert not replays_as_cuda_graphs("inductor", None) and not replays_as_cuda_graphs("inductor", "max-autotune")
    assert not replays_as_cuda_graphs("eager", "reduce-overhead")
    assert make_context(OptimizeConfig(), graphed=True).plan_context.extras["graphed"] is True
    assert "graphed" not in make_context(OptimizeConfig()).plan_context.extras
    torch._dynamo.reset()

    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    q, k, v = torch.randn(1, 4, 1, 64), torch.randn(1, 2, 48, 64), torch.randn(1, 2, 48, 64)
    with tuning.use_tuner(Listening(cache)) as tuner:
        attnopt.optimize(attend, inner_backend="eager", dynamic=False)(q, k, v)
    assert [kw["graphed"] for kw in tuner.heard] == [False]


def test_gpu_timer_host_time_calls_the_op(monkeypatch):
    """``host_us`` issues the lowered op itself (its dispatch and state lookup are part of an eager call)."""
    from attnopt.runtime import ops

    _gpu_on_the_cpu(monkeypatch)
    site = AttentionSite.canonical(q_heads=4, kv_heads=2, head_dim=64, kv_len=64, dtype="float32",
                                   mask_kind="valid_length")
    before = ops.CALL_COUNTS[T.TUNING_SITE]
    timer = T.GpuTimer(warm_ms=0.0)
    us = timer.host_us(DensePlan(backend="math"), site)
    calls = ops.CALL_COUNTS[T.TUNING_SITE] - before
    assert us > 0 and calls >= T.HOST_CALLS
    # at most HOST_CALLS of the sets, however many the shape has: a warm-up over them and three repeats
    assert len(timer._sets) > T.HOST_CALLS and calls <= 4 * T.HOST_CALLS


def _untwinned(ranked):
    """``ranked`` without the swap-AB and prefetching twins (timed after the configurations: test_tile_ops)."""
    return [p for p in ranked if not (getattr(p, "swap_ab", False) or getattr(p, "l2_prefetch", 0))]


def test_one_tuner_measures_a_shape_once_even_when_its_cache_cannot_be_written(tmp_path):
    """30 layers of one shape: the first site is measured, the other 29 reuse it, with or without a cache file."""
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    site = AttentionSite.canonical()
    ranked = _ranked(site)
    for cache in (None, TuningCache(blocker / "tuning" / "tuning.json")):
        timer = Scripted(lambda p, s, n: 5.0)
        tuner = Tuner(timer, cache, env=ENV)
        choices = [tuner.choose(site, ranked)]
        calls = len(timer.calls)  # the candidates' rounds, then the grid siblings'
        choices += [tuner.choose(site, ranked) for _ in range(29)]
        assert choices[0].choice == "measured" and {c.choice for c in choices[1:]} == {"cached"}
        assert len(timer.calls) == calls >= len(tuning.to_time(ranked, tuning.DEFAULT_TOP_K)) * tuning.ROUNDS
        assert {c.plan.runtime_key() for c in choices} == {choices[0].plan.runtime_key()}


def test_one_plan_of_each_further_kernel_configuration_is_timed():
    """Beyond the top estimates, the best-estimated plan of each further (kind, block_n, warps, stages) family within
    EXTRA_WITHIN of the best estimate is a candidate: the model ranks grids within a configuration well and
    configurations against each other poorly. Families estimated further behind (stream-K here, 3x) are not."""
    site = dataclasses.replace(STATIC, kv_len=1088)
    ranked = _untwinned(_ranked(site))
    kernels = [p for p in ranked if p.kind != "dense"]
    families = []
    for p in kernels:
        if tuning._family(p) not in families:
            families.append(tuning._family(p))
    plans = tuning.to_time(ranked, tuning.DEFAULT_TOP_K)
    timed = [tuning._family(p) for p in plans if p.kind != "dense"]
    top = {tuning._family(p) for p in kernels[:tuning.DEFAULT_TOP_K]} | {tuning._family(ranked[0])}
    ceiling = tuning.EXTRA_WITHIN * min(p.est_us for p in kernels[:tuning.DEFAULT_TOP_K])
    best_of = {f: next(p for p in kernels if tuning._family(p) == f) for f in families}
    further = [f for f in families if f not in top and best_of[f].est_us <= ceiling][:tuning.DEFAULT_EXTRA_FAMILIES]
    behind = [f for f in families if best_of[f].est_us > ceiling]
    assert further and behind, "the site should offer further configurations near and far from the top estimates"
    assert all(f in timed for f in further) and not any(f in timed for f in behind)
    assert {f[0] for f in behind} == {"stream_k"}
    for f in further:  # each further family by its best-estimated plan, in the model's order
        assert any(p.runtime_key() == best_of[f].runtime_key() for p in plans)
    assert len(tuning.to_time(ranked, tuning.DEFAULT_TOP_K, extra_families=0)) < len(plans)


def test_a_variant_site_is_keyed_apart_from_the_plain_site_of_its_shape(cache):
    """A 4k window over a 128k cache reads its band, not the cache: a measurement of the plain site of that shape
    (where cuDNN may win) is not the window site's, and neither are a cap's or ALiBi's. A plain site's key is the one
    it had before the variant joined the key (its records stay valid)."""
    plain = AttentionSite.canonical(kv_len=131072, mask_kind="arbitrary")
    window = dataclasses.replace(plain, window=4096)
    keys = {TuningCache.key(ENV, ShapeKey.of(s, 131072, False)) for s in
            (plain, window, dataclasses.replace(plain, softcap=50.0), dataclasses.replace(plain, alibi=True))}
    assert len(keys) == 4
    assert "variant" not in json.loads(TuningCache.key(ENV, ShapeKey.of(plain, 131072, False)))["shape"]
    cudnn = next(p for p in _ranked(plain) if p.kind == "dense" and p.backend == "cudnn")
    cache.put(ENV, ShapeKey.of(plain, 131072, False), {"winner": cudnn.to_dict(), "measured_us": 197.8})
    timer = Scripted(lambda p, s, n: 20.0 if p.kind == "split_kv" else 197.8, valid_len=3.0)
    choice = Tuner(timer, cache, env=ENV).choose(window, _ranked(window))
    assert choice.choice == "measured" and choice.plan.kind == "split_kv", choice
    mine = Tuner(timer, cache, env=ENV).choose(plain, _ranked(plain))
    assert mine.choice == "cached" and mine.plan == cudnn  # its own record


def test_a_window_site_is_timed_over_its_band_with_one_key_range():
    """The timer's input sets for a window site: a band of exactly ``window`` keys ending at the static fill, and
    the key start and valid length of ``key_range_from_mask`` (what the lowered graph runs, and what the tuner
    charges as the site's mask computation); a plain masked site gets ``valid_len_from_mask``."""
    site = AttentionSite.canonical(batch=2, q_heads=4, kv_heads=2, head_dim=64, kv_len=300, dtype="float32",
                                   mask_kind="arbitrary", window=40)
    s = T.synthetic_inputs(site, 0, device="cpu")
    keep = int(300 * T.STATIC_FILL)
    visible = s["mask"][:, 0, 0].nonzero()[:, 1].view(2, -1)
    assert visible.tolist() == [list(range(keep - 40, keep))] * 2
    assert s["key_start"].tolist() == [keep - 40] * 2 and s["valid_len"].tolist() == [keep] * 2
    assert T.mask_reduction(site) == "key_range_from_mask"
    assert T.mask_reduction(dataclasses.replace(site, window=None)) == "valid_len_from_mask"
    plain = T.synthetic_inputs(dataclasses.replace(site, window=None), 0, device="cpu")
    assert "key_start" not in plain and plain["valid_len"].tolist() == [keep] * 2
