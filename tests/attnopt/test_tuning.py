"""The measured plan choice (attnopt.tuning): bucket rule, persistence and key invalidation, corrupt files, the
fake-timer-driven choice, never tuning while capturing, bucketed plans at run time, explicit SDPA backends."""
import json
import logging
import math

import pytest
import torch
import torch.nn.functional as F

import attnopt
from attnopt import tuning
from attnopt.hardware import builtin_profile
from attnopt.plan import BucketedPlan, DensePlan, SplitKVPlan, plan_from_json
from attnopt.report import PlanReport, SiteReport
from attnopt.runtime import ops
from attnopt.runtime.reference import decode_attention
from attnopt.runtime.strategies import PlanContext
from attnopt.runtime.strategies.dense import Dense, backend_reason
from attnopt.site import AttentionSite
from attnopt.tuning import ShapeKey, Tuner, TuningCache, bucket_of
from attnopt import timer as tuning_timer
from attnopt.passes.plan import plan_site

ENV = {"device": "NVIDIA H100 80GB HBM3", "driver": "570.1", "torch": "2.11.0", "triton": "3.6.0",
       "attnopt": "0.1.0", "tuning": "1"}
SITE = AttentionSite.canonical()  # B=1 32/8 D=128 N=8192 bf16
CUDA_CTX = PlanContext(device_type="cuda", triton_available=True)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNOPT_CACHE_DIR", str(tmp_path))
    return TuningCache()


class FakeTimer:
    """µs per plan from a rule; records what it was asked to time."""

    def __init__(self, rule):
        self.rule, self.calls = rule, []

    def __call__(self, plan, site):
        self.calls.append((plan.runtime_key(), site.kv_len))
        return self.rule(plan, site)


def _ranked(site=SITE, ctx=CUDA_CTX):
    from attnopt.config import OptimizeConfig
    from attnopt.passes.plan import rank_candidates

    return rank_candidates(site, builtin_profile("h100-sxm"), ctx, OptimizeConfig())[0]


def _cudnn_fastest(plan, site):
    return 5.0 if getattr(plan, "backend", "") == "cudnn" else 10.0 + plan.est_us


def test_bucket_rule():
    assert bucket_of(1) == 1024 and bucket_of(1024) == 1024 and bucket_of(1025) == 2048
    assert bucket_of(300_000) == 524288 and bucket_of(10_000_000) == 524288
    assert tuning.BUCKETS[0] == 1024 and tuning.BUCKETS[-1] == 512 * 1024
    plan = BucketedPlan(bounds=(1024, 4096), plans=(DensePlan().runtime_key(), SplitKVPlan().runtime_key()))
    assert [plan.index_of(n) for n in (1, 1024, 1025, 4096, 10**6)] == [0, 0, 1, 1, 1]
    with pytest.raises(ValueError, match="ascend"):
        BucketedPlan(bounds=(4096, 1024), plans=plan.plans)
    with pytest.raises(ValueError, match="one plan per bound"):
        BucketedPlan(bounds=(1024,), plans=plan.plans)


def test_cache_round_trip_across_instances(cache, tmp_path):
    shape = ShapeKey.of(SITE, 8192, False)
    cache.put(ENV, shape, {"winner": DensePlan(backend="cudnn").to_dict(), "measured_us": 18.7})
    assert cache.path.parent.parent == tmp_path  # $ATTNOPT_CACHE_DIR/tuning/tuning.json
    again = TuningCache()  # another process reads the same file
    record = again.get(ENV, shape)
    assert record["measured_us"] == 18.7 and record["winner"]["data"]["backend"] == "cudnn"
    assert not list(cache.path.parent.glob("*.tmp"))  # the temporary file was renamed into place


@pytest.mark.parametrize("field,value", [("torch", "2.13.0"), ("triton", "3.7.1"), ("attnopt", "0.2.0"),
                                         ("device", "NVIDIA H200"), ("driver", "580.2")])
def test_cache_key_invalidation(cache, field, value):
    shape = ShapeKey.of(SITE, 8192, False)
    cache.put(ENV, shape, {"winner": DensePlan().to_dict(), "measured_us": 1.0})
    assert cache.get(ENV, shape) is not None
    assert cache.get({**ENV, field: value}, shape) is None


def test_cache_key_covers_the_shape(cache):
    cache.put(ENV, ShapeKey.of(SITE, 8192, False), {"winner": DensePlan().to_dict()})
    import dataclasses

    for other in (ShapeKey.of(SITE, 8192, True), ShapeKey.of(SITE, 16384, False),
                  ShapeKey.of(dataclasses.replace(SITE, mask_kind="valid_length"), 8192, False),
                  ShapeKey.of(dataclasses.replace(SITE, dtype="float16"), 8192, False),
                  ShapeKey.of(dataclasses.replace(SITE, q_len=4), 8192, False)):
        assert cache.get(ENV, other) is None


def test_corrupt_cache_warns_once_and_tunes_again(cache, caplog):
    cache.path.parent.mkdir(parents=True)
    cache.path.write_text("{ not json")
    timer = FakeTimer(_cudnn_fastest)
    tuner = Tuner(timer, cache, env=ENV)
    with caplog.at_level(logging.WARNING, logger="attnopt.tuning"):
        choice = tuner.choose(SITE, _ranked())
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(cache.path) in warnings[0].getMessage()
    assert choice.choice == "measured" and timer.calls
    assert json.loads(cache.path.read_text())["records"]  # rewritten whole


def test_measured_winner_beats_the_models_pick(cache):
    ranked = _ranked()
    model_pick = ranked[0]
    assert model_pick.kind != "dense" or model_pick.backend != "cudnn"
    timer = FakeTimer(_cudnn_fastest)
    choice = Tuner(timer, cache, env=ENV).choose(SITE, ranked)
    assert choice.choice == "measured" and choice.plan.kind == "dense" and choice.plan.backend == "cudnn"
    assert choice.measured_us == 5.0
    timed = [k for k, _ in timer.calls]
    assert timed[0] == model_pick.runtime_key()  # the model's pick is always timed, first
    kernels_timed = sum(1 for p in ranked if p.kind != "dense" and p.runtime_key() in timed)
    assert kernels_timed == len([p for p in tuning.to_time(ranked, tuning.DEFAULT_TOP_K) if p.kind != "dense"])
    assert tuning.DEFAULT_TOP_K <= kernels_timed <= tuning.DEFAULT_TOP_K + tuning.DEFAULT_EXTRA_FAMILIES
    # A second process takes the cached winner without timing anything.
    never = FakeTimer(lambda p, s: pytest.fail("timed although cached"))
    cached = Tuner(never, TuningCache(), env=ENV).choose(SITE, ranked)
    assert cached.choice == "cached" and cached.plan.backend == "cudnn" and cached.measured_us == 5.0


def test_failing_candidates_are_skipped_and_the_budget_stops_new_ones(cache):
    def rule(plan, site):
        if plan.kind == "dense" and plan.backend == "cudnn":
            raise RuntimeError("No available kernel")
        return plan.est_us
    timer = FakeTimer(rule)
    choice = Tuner(timer, cache, env=ENV, budget_s=0.0).choose(SITE, _ranked())
    assert len(timer.calls) == 2  # the model's pick and the first SDPA backend only
    assert choice.choice == "measured" and choice.plan.runtime_key() == timer.calls[0][0]
    assert any(str(v).startswith("error: RuntimeError") for v in choice.timings.values())
    assert any(str(v).startswith("skipped") for v in choice.timings.values())


def test_never_tunes_while_capturing(cache):
    timer = FakeTimer(_cudnn_fastest)
    ranked = _ranked()
    capturing = Tuner(timer, cache, env=ENV, capturing=lambda: True)
    choice = capturing.choose(SITE, ranked)
    assert choice.choice == "model" and choice.plan is ranked[0] and not timer.calls
    Tuner(timer, cache, env=ENV).choose(SITE, ranked)  # measured outside the capture
    assert capturing.choose(SITE, ranked).choice == "cached"  # the capture uses the cache


def test_capture_check_reads_the_stream(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert tuning._stream_capturing() is True
    timer = FakeTimer(_cudnn_fastest)
    assert Tuner(timer, None, env=ENV).choose(SITE, _ranked()).choice == "model" and not timer.calls


def test_tuning_is_off_on_cpu_and_interpreter(monkeypatch):
    assert tuning.default_tuner("cpu", True) is None
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert tuning.default_tuner("cuda", True) is None
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv(tuning.TUNE_ENV, "0")
    assert tuning.default_tuner("cuda", True) is None


def test_plan_site_reports_measured_choice(cache):
    from attnopt.config import OptimizeConfig

    report = plan_site(SITE, builtin_profile("h100-sxm"), CUDA_CTX, OptimizeConfig(),
                       Tuner(FakeTimer(_cudnn_fastest), cache, env=ENV))
    assert report.choice == "measured" and report.chosen.backend == "cudnn" and report.measured_us == 5.0
    assert not math.isnan(report.chosen.est_us)
    back = SiteReport.from_dict(json.loads(json.dumps(report.to_dict())))
    assert back.choice == "measured" and back.measured_us == 5.0
    report.rewritten = True
    text = PlanReport(sites=[report], profile="h100-sxm").format_table(width=200)
    assert "measured µs" in text and "5.0" in text and "measured" in text


def test_old_plan_log_and_dense_json_load():
    old = {"kind": "dense", "version": 1, "data": {"reason": "x", "est_us": 3.0}}
    assert plan_from_json(json.dumps(old)).backend == "auto"
    with pytest.raises(ValueError, match="valid: auto, flash, cudnn, efficient, math"):
        DensePlan(backend="fast")
    site_dict = SiteReport(site=SITE).to_dict()
    for key in ("choice", "measured_us"):
        site_dict.pop(key)
    back = SiteReport.from_dict(site_dict)
    assert back.choice == "model" and math.isnan(back.measured_us)


def test_symbolic_length_gets_a_plan_per_bucket(cache, monkeypatch):
    import dataclasses

    from attnopt.runtime.strategies import split_kv as skv

    # the swap-AB and prefetching twins have grids of their own, which the estimate rule below would rank per bucket
    monkeypatch.setattr(skv, "SWAP_AB_TWINS", False)
    monkeypatch.setattr(skv, "PREFETCH_TWINS", 0)
    site = dataclasses.replace(SITE, kv_len=None, kv_len_hint=3000)

    def rule(plan, s):  # dense below 16k keys, the model's best kernel from there on
        if plan.kind == "dense":
            return 1.0 if s.kv_len < 16384 else 1e6
        return plan.est_us
    timer = FakeTimer(rule)
    from attnopt.config import OptimizeConfig

    report = plan_site(site, builtin_profile("h100-sxm"), CUDA_CTX, OptimizeConfig(), Tuner(timer, cache, env=ENV))
    plan = report.chosen
    assert isinstance(plan, BucketedPlan) and plan.bounds == tuning.BUCKETS
    assert plan_from_json(plan.plan_for(3000)).kind == "dense"
    assert plan_from_json(plan.plan_for(100_000)).kind in ("split_kv", "stream_k")
    assert report.measured_us == 1.0  # the bucket of the trace-time hint
    middles = {tuning.bucket_length(b) for b in tuning.BUCKETS}
    ends = {n for b in tuning.BUCKETS for n in tuning.bucket_span(b)}  # where two candidates tie (cuDNN, flash)
    here = tuning.hint_length(3000, 4096)  # the hint's bucket is timed at the hint, rounded up to 16 keys
    assert here == 3008 and here in {n for _, n in timer.calls}
    assert middles - {2880} <= {n for _, n in timer.calls} <= middles | ends | {here}  # the others at their middle
    assert plan_from_json(plan.runtime_key()) == dataclasses.replace(plan, est_us=math.nan)
    assert plan.describe().startswith("bucketed(N 1..") and "dense(" in plan.describe()
    assert "; N 16385..: " in plan.describe()  # (8192, 16384] is timed at 11584 keys, where dense is faster


def test_bucketed_plan_runs_each_buckets_plan_through_the_op():
    inner_small = DensePlan(backend="math").runtime_key()
    inner_large = SplitKVPlan(num_splits=2, block_n=16).runtime_key()
    plan = BucketedPlan(bounds=(32, 128), plans=(inner_small, inner_large))
    for n in (20, 100):
        q, k, v = torch.randn(1, 4, 1, 64), torch.randn(1, 2, n, 64), torch.randn(1, 2, n, 64)
        out = torch.ops.attnopt.decode_attention(q, k, v, None, None, 0.125, False, plan.runtime_key(), "t:bucketed")
        torch.testing.assert_close(out, decode_attention(q, k, v, scale=0.125), atol=1e-5, rtol=1e-5)
    state = next(s for key, s in ops._STATES.items() if key[0] == plan.runtime_key())
    assert [p.kind for p, _, _ in state] == ["dense", "split_kv"]


def test_dense_backend_checker_and_expanded_run():
    import dataclasses

    masked = dataclasses.replace(SITE, mask_kind="valid_length")
    assert "no attn_mask" in backend_reason("flash", masked, "cuda")
    assert backend_reason("cudnn", masked, "cuda") is None
    assert "CUDA" in backend_reason("cudnn", SITE, "cpu")
    assert "float16 or bfloat16" in backend_reason("flash", dataclasses.replace(SITE, dtype="float32"), "cuda")
    assert "enable_gqa" in backend_reason("efficient", SITE, "cuda")
    assert backend_reason("efficient", dataclasses.replace(SITE, kv_heads=32), "cuda") is None
    kinds = [p.backend for p in Dense().candidates(SITE, None, CUDA_CTX)]
    assert kinds == ["auto", "flash", "cudnn"]
    assert [p.backend for p in Dense().candidates(SITE, None, PlanContext())] == ["auto"]
    q, k, v = torch.randn(2, 6, 1, 32), torch.randn(2, 2, 40, 32), torch.randn(2, 2, 40, 32)
    valid = torch.tensor([40, 17])
    ref = decode_attention(q, k, v, valid_len=valid, scale=0.2)
    plan = DensePlan(backend="math")
    for expand in (False, True):  # enable_gqa, and K/V expanded for a backend without it
        out = Dense().run(expand, plan, q, k, v, None, valid, 0.2, False)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert Dense().prepare(plan, q, k, v) is False  # math takes enable_gqa: no expansion


def test_optimize_uses_the_measured_choice_end_to_end(cache):
    """Through attnopt.optimize on the CPU: the fake timer makes a plan the model ranks below its pick the
    winner; the op runs that plan and the result stays exact."""
    torch._dynamo.reset()

    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    q, k, v = torch.randn(1, 4, 1, 64), torch.randn(1, 2, 96, 64), torch.randn(1, 2, 96, 64)
    winner = {}

    def rule(plan, site):  # the last-ranked candidate wins
        winner.setdefault("key", None)
        return 1.0 if plan.runtime_key() == winner.get("key") else 2.0

    class LastWins(Tuner):
        def choose(self, site, ranked, **kw):
            winner["key"] = tuning.to_time(ranked, self.top_k)[-1].runtime_key()
            return super().choose(site, ranked, **kw)

    with tuning.use_tuner(LastWins(FakeTimer(rule), cache, env=ENV)):
        opt = attnopt.optimize(attend, inner_backend="eager", dynamic=False)
        out = opt(q, k, v)
    torch.testing.assert_close(out, attend(q, k, v), atol=1e-5, rtol=1e-5)
    (site,) = attnopt.last_plans(opt).rewritten
    assert site.choice == "measured" and site.chosen.runtime_key() == winner["key"]
    assert site.chosen.runtime_key() != site.candidates[0].runtime_key()


# ---------------------------------------------------------------------------------------- attnopt tune
def test_tune_cli_message_and_shapes(capsys, monkeypatch):
    import argparse

    from attnopt.cli import main
    from attnopt.commands.tune import build_sites, resolve_heads, tune_sites

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["tune", "32/8x128", "--context", "8k"]) == 2
    err = capsys.readouterr().err
    assert "CUDA GPU" in err and "cost model" in err
    assert resolve_heads("smollm2") == (9, 3, 64) and resolve_heads("56x64") == (56, 56, 64)
    with pytest.raises(ValueError, match="neither a preset"):
        resolve_heads("/no/such/model")
    args = argparse.Namespace(shapes=["llama3-8b", "9/3x64"], context="8k,32k", batch="1,4", q_len="1",
                              dtype="bfloat16", mask="none", symbolic=False)
    sites = build_sites(args)
    assert len(sites) == 8 and {s.kv_len for s in sites} == {8192, 32768}
    assert main(["tune", "llama3-8b", "--batch", "0"]) == 2  # bad input: a clear error, exit 2


def test_tune_sites_drives_the_tuner(cache):
    import argparse

    from attnopt.commands.tune import build_sites, tune_sites

    args = argparse.Namespace(shapes=["llama3-8b"], context="8k", batch="1", q_len="1,4", dtype="bfloat16",
                              mask="valid_length", symbolic=False)
    timer = FakeTimer(_cudnn_fastest)
    rows = tune_sites(build_sites(args), Tuner(timer, cache, env=ENV), builtin_profile("h100-sxm"), CUDA_CTX)
    assert [r["choice"] for r in rows] == ["measured", "measured"]
    assert all("backend=cudnn" in r["plan"] and r["measured_us"] == 5.0 for r in rows)
    assert all(r["predicted_us"] > 0 for r in rows)


@pytest.mark.cuda
def test_gpu_timer_times_a_plan_and_the_tuner_picks_on_cuda(cache):
    """On a GPU: the real timer returns a positive time for a kernel plan and an SDPA backend, and the default
    tuner's choice at a small shape is one of the timed candidates, cached for the next process."""
    import dataclasses

    site = dataclasses.replace(SITE, kv_len=4096)
    ranked = _ranked(site)
    assert tuning.gpu_timer(ranked[0], site) > 0
    assert tuning.gpu_timer(DensePlan(backend="cudnn"), site) > 0
    choice = tuning.Tuner(cache=TuningCache()).choose(site, ranked)
    assert choice.choice == "measured" and choice.measured_us > 0
    assert tuning.Tuner(cache=TuningCache()).choose(site, ranked).choice == "cached"


def test_timer_gets_real_inputs_inside_the_compile_and_the_op_path_is_exact(cache):
    """The planner runs inside dynamo's backend call: a timer there must build real tensors (not fake ones) with
    ``synthetic_inputs`` and run the candidate through ``site_call`` (mask -> valid length on the device for
    kernel plans). This runs both on the CPU for every candidate of a static-cache site and checks each result."""
    from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

    torch._dynamo.reset()
    checked = []

    def real_timer(plan, site):
        with unset_fake_temporarily():
            s = tuning.synthetic_inputs(site, 0, device="cpu")
            out = tuning.site_call(plan, site, s)()
            assert not isinstance(out, FakeTensor) and s["mask"].shape == (2, 1, 1, 48)
            keep = s["mask"][:, 0, 0, :].sum(-1)
            ref = decode_attention(s["q"], s["k"], s["v"], valid_len=keep, scale=site.scale or 64 ** -0.5)
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
            checked.append(plan.kind)
            return 1.0 if plan.kind == "split_kv" else 2.0

    def attend(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    q, k, v = torch.randn(2, 4, 1, 64), torch.randn(2, 2, 48, 64), torch.randn(2, 2, 48, 64)
    mask = (torch.arange(48) < 30)[None, None, None, :].expand(2, 1, 1, 48).contiguous()
    with tuning.use_tuner(Tuner(real_timer, cache, env=ENV, top_k=2)):
        opt = attnopt.optimize(attend, inner_backend="eager", dynamic=False)
        out = opt(q, k, v, mask)
    torch.testing.assert_close(out, attend(q, k, v, mask), atol=1e-5, rtol=1e-5)
    (site,) = attnopt.last_plans(opt).rewritten
    assert site.choice == "measured" and site.chosen.kind == "split_kv"
    assert "dense" in checked and checked.count("split_kv") >= 1


def test_an_unwritable_cache_warns_and_the_choice_stands(tmp_path, caplog):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache folder should be")
    cache = TuningCache(blocker / "tuning" / "tuning.json")
    with caplog.at_level(logging.WARNING, logger="attnopt.tuning"):
        choice = Tuner(FakeTimer(_cudnn_fastest), cache, env=ENV).choose(SITE, _ranked())
    assert choice.choice == "measured" and choice.plan.backend == "cudnn"
    assert any("cannot write the tuning cache" in r.getMessage() for r in caplog.records)


def test_symbolic_length_through_optimize_runs_each_buckets_plan(cache):
    """A growing cache through attnopt.optimize: the KV length is symbolic, the tuner (fake timer, buckets of 32
    and 128 keys) picks dense for the first bucket and a Triton kernel plan for the second, and one compiled graph
    runs both plans by the call's length, exactly."""
    torch._dynamo.reset()

    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    def rule(plan, site):
        if site.kv_len <= 32:
            return 1.0 if plan.kind == "dense" else 9.0
        return 1.0 if plan.kind != "dense" else 9.0

    tuner = Tuner(FakeTimer(rule), cache, env=ENV, buckets=(32, 128))
    with tuning.use_tuner(tuner):
        opt = attnopt.optimize(attend, inner_backend="eager")
        for n in (20, 100):
            q, k, v = torch.randn(1, 4, 1, 64), torch.randn(1, 2, n, 64), torch.randn(1, 2, n, 64)
            torch._dynamo.maybe_mark_dynamic(k, 2)
            torch._dynamo.maybe_mark_dynamic(v, 2)
            torch.testing.assert_close(opt(q, k, v), attend(q, k, v), atol=1e-5, rtol=1e-5)
    report = attnopt.last_plans(opt)
    (site,) = report.rewritten
    assert site.site.kv_len is None and isinstance(site.chosen, BucketedPlan)
    kinds = [plan_from_json(p).kind for p in site.chosen.plans]
    assert kinds[0] == "dense" and kinds[1] in ("split_kv", "stream_k") and site.calls == 2


def test_a_failing_tuner_falls_back_to_the_model(caplog):
    from attnopt.config import OptimizeConfig

    class Broken(Tuner):
        def choose(self, site, ranked, **kw):
            raise RuntimeError("driver went away")

    with caplog.at_level(logging.WARNING, logger="attnopt.tuning"):
        report = plan_site(SITE, builtin_profile("h100-sxm"), CUDA_CTX, OptimizeConfig(), Broken(env=ENV))
    assert report.choice == "model" and report.chosen is report.candidates[0]
    assert any("driver went away" in r.getMessage() for r in caplog.records)


def test_the_tuner_releases_the_timers_inputs_after_each_shape(cache):
    timer = FakeTimer(_cudnn_fastest)
    released = []
    timer.release = lambda: released.append(len(timer.calls))
    Tuner(timer, cache, env=ENV).choose(SITE, _ranked())
    assert released == [len(timer.calls)] and len(timer.calls) > 2  # once, after every candidate was timed


def test_concurrent_writers_never_leave_a_torn_file(cache, caplog):
    """Writers in two processes and a reader in this one: every read parses (os.replace swaps whole files)."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")  # no CUDA here; fork skips re-importing torch
    procs = [ctx.Process(target=_write_many, args=(str(cache.path), w)) for w in range(2)]
    for p in procs:
        p.start()
    reads = 0
    with caplog.at_level(logging.WARNING, logger="attnopt.tuning"):
        while any(p.is_alive() for p in procs):
            TuningCache(cache.path).load()
            reads += 1
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert not [r for r in caplog.records if "unreadable" in r.getMessage()] and reads > 0
    assert json.loads(cache.path.read_text())["records"]  # the last writer's merge, whole
    assert not list(cache.path.parent.glob("*.tmp"))


def _write_many(path, writer):
    c = TuningCache(path)
    for i in range(30):
        c.put(ENV, ShapeKey.of(SITE, 1024 * (i + 1), False), {"winner": DensePlan().to_dict(), "writer": writer})


class _FakeProps:
    L2_cache_size = 1 << 20


def _cpu_gpu_timer(monkeypatch, free_bytes):
    """``GpuTimer`` with its CUDA queries and input device redirected to the CPU (its input-set bookkeeping only)."""
    from attnopt import timer as T

    made = []
    real = T.synthetic_inputs

    def on_cpu(site, index, device="cuda", reduce=True):
        made.append(index)
        return real(site, index, device="cpu", reduce=reduce)
    monkeypatch.setattr(T, "synthetic_inputs", on_cpu)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (free_bytes, 2 * free_bytes))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: _FakeProps())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return tuning.GpuTimer(), made


def test_gpu_timer_input_sets_are_kept_per_shape_and_bounded_by_memory(monkeypatch):
    import dataclasses

    site = AttentionSite.canonical(q_heads=4, kv_heads=2, head_dim=64, kv_len=256, dtype="float32")
    set_bytes = 1 * 2 * 256 * 128 * 4
    timer, made = _cpu_gpu_timer(monkeypatch, free_bytes=64 * set_bytes)
    sets = timer._input_sets(site)
    assert len(sets) == 16 and made == list(range(16))  # enough sets to span 4 x L2
    assert timer._input_sets(site) is sets and len(made) == 16  # the next candidate reuses them
    other = timer._input_sets(dataclasses.replace(site, kv_len=128))
    assert other is not sets and other[0]["k"].shape[2] == 128
    timer.release()
    assert timer._sets == [] and timer._shape is None
    tight, _ = _cpu_gpu_timer(monkeypatch, free_bytes=5 * set_bytes)
    assert len(tight._input_sets(site)) == 2  # half the free memory holds two sets
    big_l2, _ = _cpu_gpu_timer(monkeypatch, free_bytes=1 << 40)
    _FakeProps.L2_cache_size = 1 << 30
    try:
        assert len(big_l2._input_sets(site)) == tuning_timer.MAX_SETS
    finally:
        _FakeProps.L2_cache_size = 1 << 20
    none_fit, _ = _cpu_gpu_timer(monkeypatch, free_bytes=set_bytes)
    with pytest.raises(MemoryError, match="GB free"):
        none_fit._input_sets(site)


def test_tune_cli_runs_its_shapes_through_the_tuner(monkeypatch, capsys, cache):
    """``attnopt tune`` end to end with the GPU stood in for: the timer and the CUDA check replaced, the rest real."""
    from attnopt.cli import main

    class Stand:
        calls = 0

        def __call__(self, plan, site):
            Stand.calls += 1
            return 3.0 if plan.kind == "dense" else 5.0

        def release(self):
            pass

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Stand-in GPU")
    monkeypatch.setattr(tuning, "gpu_timer", Stand())
    monkeypatch.setattr(tuning, "environment_key", lambda *a: ENV)
    import attnopt.hardware as H

    monkeypatch.setattr(H, "resolve_profile", lambda name=None: builtin_profile("h100-sxm"))
    assert main(["tune", "smollm2", "--context", "8k,32k", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [r["choice"] for r in data["rows"]] == ["measured", "measured"] and Stand.calls >= 2
    assert all(r["measured_us"] == 3.0 and r["plan"].startswith("dense") for r in data["rows"])
    assert main(["tune", "smollm2", "--context", "8k", "--json"]) == 0  # a second run finds them cached
    assert json.loads(capsys.readouterr().out)["rows"][0]["choice"] == "cached"
    probed = []
    Stand.fresh_length_us = lambda self, plan, site: probed.append(plan.backend) or (50.0, 40.0)
    assert main(["tune", "smollm2", "--symbolic", "--json"]) == 0  # a growing cache: cuDNN probed at new lengths
    capsys.readouterr()
    assert probed == ["cudnn"]
