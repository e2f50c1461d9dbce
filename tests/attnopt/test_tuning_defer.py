"""The measured choice in the background (attnopt.tuning_defer): the backend returns while the tuner still runs, the
inner compile runs beside it, the first call waits and runs the winner, exactly; a failing tuner falls back to the
model's pick with its reason; a cached shape starts no thread; the report shows the resolved plan."""
import logging
import math
import threading

import pytest
import torch
import torch.nn.functional as F

import attnopt
from attnopt import backend as backend_mod
from attnopt import tuning, tuning_defer
from attnopt.backend import Backend
from attnopt.config import OptimizeConfig
from attnopt.plan import uses_valid_len
from attnopt.runtime import ops
from attnopt.tuning import Tuner, TuningCache

ENV = {"device": "NVIDIA H100 80GB HBM3", "driver": "570.1", "torch": "2.11.0", "triton": "3.6.0",
       "attnopt": "0.1.0", "tuning": "1"}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNOPT_CACHE_DIR", str(tmp_path))
    tuning_defer.forget_jobs()
    torch._dynamo.reset()
    yield TuningCache()
    tuning_defer.forget_jobs()


def attend(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def inputs(n=96):
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 1, 64), torch.randn(1, 2, n, 64), torch.randn(1, 2, n, 64)
    mask = torch.ones(1, 1, 1, n, dtype=torch.bool)
    mask[..., n - 9:] = False  # a static cache's empty tail: a valid-length mask
    return q, k, v, mask


class Gated(Tuner):
    """Times nothing until ``gate`` opens (the test opens it from the inner compile); records where it ran and what
    it was offered; the last candidate it is offered wins (the fake timer makes it fastest)."""

    def __init__(self, cache, fail: bool = False):
        self.gate, self.events, self.offered, self.fail = threading.Event(), [], [], fail
        self.winner = None
        super().__init__(lambda plan, site: 1.0 if plan.runtime_key() == self.winner else 2.0, cache, env=ENV)

    def choose(self, site, ranked, **kw):
        self.events.append(("tuning starts", threading.current_thread().name))
        opened = self.gate.wait(20)
        self.events.append(("gate opened" if opened else "gate timed out", threading.current_thread().name))
        if self.fail:
            raise RuntimeError("the driver went away")
        self.offered = list(ranked)
        self.winner = tuning.to_time(ranked, self.top_k)[-1].runtime_key()
        return super().choose(site, ranked, **kw)


def compiled_graphed(tuner, monkeypatch):
    """``attend`` compiled by a backend whose graphs replay as CUDA graphs (as step graphs run them), with the inner
    compile opening the tuner's gate: a tuning that ran before it would wait 20 s and time out."""
    inner = backend_mod._compile_inner

    def compile_inner(*args, **kw):
        tuner.events.append(("inner compile", threading.current_thread().name))
        tuner.gate.set()
        return inner(*args, **kw)

    monkeypatch.setattr(backend_mod, "_compile_inner", compile_inner)
    backend = Backend(OptimizeConfig(inner_backend="eager"))
    return backend, torch.compile(attend, backend=backend.with_mode(None, graphed=True), dynamic=False)


def test_the_tuning_overlaps_the_inner_compile_and_the_first_call_runs_the_winner(cache, monkeypatch):
    tuner = Gated(cache)
    backend, opt = compiled_graphed(tuner, monkeypatch)
    q, k, v, mask = inputs()
    with tuning.use_tuner(tuner):
        out = opt(q, k, v, mask)
    # (a) the backend went on to the inner compile while the tuner (on its own thread) could not finish
    names = [e[0] for e in tuner.events]
    assert names.index("inner compile") < names.index("gate opened") and "gate timed out" not in names
    assert all(thread.startswith("attnopt-tune") for what, thread in tuner.events if what != "inner compile")
    # only candidates lowered alike were offered (a static cache's mask: none computes a device valid length)
    (site,) = backend.report().rewritten
    assert tuner.offered and not any(uses_valid_len(p, site.site) for p in tuner.offered)
    assert any(uses_valid_len(p, site.site) for p in site.candidates)  # (there were such candidates)
    # (b) the first call waited for the choice, and the op ran the measured winner, not the model's pick
    assert backend.tune_wait_seconds >= 0 and backend.background_tunings[0].done.is_set()
    assert site.chosen.runtime_key() == tuner.winner != tuner.offered[0].runtime_key()
    assert ops._RESOLVED[site.pending_key][0].runtime_key() == tuner.winner
    # (c) exact
    torch.testing.assert_close(out, attend(q, k, v, mask), atol=1e-5, rtol=1e-5)
    # (e) the report shows the resolved plan, how it was chosen and the tuning's seconds
    assert site.choice == "measured" and "background" in site.tuning and site.tune_s >= 0
    saved = attnopt.PlanReport.from_json(backend.report().to_json()).rewritten[0]
    assert saved.choice == "measured" and saved.chosen.runtime_key() == tuner.winner and not math.isnan(saved.tune_s)
    assert site.calls == 1
    # no tuner thread is left after the join: none can make a CUDA call during a later capture
    assert not [t.name for t in threading.enumerate() if t.name.startswith(("attnopt-tune", "attnopt-warm"))]
    assert not tuning_defer.unfinished()


def test_a_background_warm_up_compiles_on_fewer_threads(monkeypatch):
    """Beside the inner compile the warm-up's threads take the GIL from it: a background tuning uses
    ``BACKGROUND_WARM_WORKERS`` threads (the environment's setting still wins)."""
    from attnopt import timer as T
    from attnopt.site import AttentionSite

    seen = []
    monkeypatch.setattr(T, "run_concurrently", lambda pooled, here, workers: seen.append(workers) or {})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(T, "synthetic_inputs", lambda *a, **k: {"mask": None})
    monkeypatch.setattr(T, "_start_triton_driver", lambda: None)
    monkeypatch.delenv(T.WARM_WORKERS_ENV, raising=False)
    site = AttentionSite.canonical()
    plans = [tuning.to_time(tuning_ranked(site), 1)[0]]

    def in_a_background_tuning():
        tuning_defer._BACKGROUND.on = True
        T.GpuTimer().warm_up(plans, site)

    T.GpuTimer().warm_up(plans, site)
    for env in (None, "7"):
        if env:
            monkeypatch.setenv(T.WARM_WORKERS_ENV, env)
        thread = threading.Thread(target=in_a_background_tuning)
        thread.start()
        thread.join()
    assert seen == [T.WARM_WORKERS, T.BACKGROUND_WARM_WORKERS, 7] and T.BACKGROUND_WARM_WORKERS < T.WARM_WORKERS


def tuning_ranked(site):
    from attnopt.hardware import builtin_profile
    from attnopt.passes.plan import rank_candidates
    from attnopt.runtime.strategies import PlanContext

    return rank_candidates(site, builtin_profile("h100-sxm"), PlanContext(device_type="cuda", triton_available=True),
                           OptimizeConfig())[0]


def test_a_failing_background_tuning_falls_back_to_the_models_pick_with_its_reason(cache, monkeypatch, caplog):
    tuner = Gated(cache, fail=True)
    backend, opt = compiled_graphed(tuner, monkeypatch)
    q, k, v, mask = inputs()
    with tuning.use_tuner(tuner), caplog.at_level(logging.WARNING, logger="attnopt.tuning"):
        out = opt(q, k, v, mask)
    (site,) = backend.report().rewritten
    assert site.choice == "model" and "the driver went away" in site.tuning
    assert site.chosen.runtime_key() == [p for p in site.candidates if not uses_valid_len(p, site.site)][0].runtime_key()
    assert any("the driver went away" in r.getMessage() for r in caplog.records)
    torch.testing.assert_close(out, attend(q, k, v, mask), atol=1e-5, rtol=1e-5)


def test_a_cached_shape_starts_no_thread_and_other_graphs_share_one_job(cache, monkeypatch):
    tuner = Gated(cache)
    backend, opt = compiled_graphed(tuner, monkeypatch)
    q, k, v, mask = inputs()
    with tuning.use_tuner(tuner):
        opt(q, k, v, mask)
        torch._dynamo.reset()
        again = torch.compile(attend, backend=backend.with_mode(None, graphed=True), dynamic=False)
        out = again(q, k, v, mask)
    first, second = backend.reports[0].sites[0], backend.reports[1].sites[0]
    assert second.choice == "cached" and not second.pending_key and second.chosen.runtime_key() == tuner.winner
    assert [e[0] for e in tuner.events].count("tuning starts") == 1  # tuned once
    assert first.pending_key and len(backend.background_tunings) == 1
    torch.testing.assert_close(out, attend(q, k, v, mask), atol=1e-5, rtol=1e-5)
    # another process (a new tuner, no jobs) finds the shape in the tuning file: resolved at once, no thread
    tuning_defer.forget_jobs()
    fresh = Gated(cache)  # its gate stays shut: a tuning would wait 20 s and record that it started
    torch._dynamo.reset()
    with tuning.use_tuner(fresh):
        third = torch.compile(attend, backend=backend.with_mode(None, graphed=True), dynamic=False)
        out = third(q, k, v, mask)
    site = backend.reports[2].sites[0]
    assert fresh.events == [] and site.choice == "cached" and not site.pending_key
    assert site.chosen.runtime_key() == tuner.winner and len(backend.background_tunings) == 1
    torch.testing.assert_close(out, attend(q, k, v, mask), atol=1e-5, rtol=1e-5)


def test_where_the_choice_stays_synchronous(cache):
    from attnopt.passes import make_context
    from attnopt.passes.plan import deferral_reason
    from attnopt.site import AttentionSite

    site, cfg = AttentionSite.canonical(), OptimizeConfig()
    ctx = make_context(cfg, graphed=True).plan_context
    assert "resolves plans at once" in deferral_reason(site, ctx, cfg, True)  # export, the CLI
    ctx = make_context(cfg, graphed=True, defer_tuning=True).plan_context
    assert deferral_reason(site, ctx, cfg, True) is None
    assert "host time" in deferral_reason(site, ctx, cfg, False)
    assert "window" in deferral_reason(AttentionSite.canonical(window=512), ctx, cfg, True)


def test_a_host_timed_graph_tunes_before_the_lowering(cache):
    """inner_backend="eager" without CUDA graphs: the choice adds host time, so it is made at once, in the pass."""
    tuner = Gated(cache)
    tuner.gate.set()
    q, k, v, mask = inputs()
    with tuning.use_tuner(tuner):
        opt = attnopt.optimize(attend, inner_backend="eager", dynamic=False)
        out = opt(q, k, v, mask)
    (site,) = attnopt.last_plans(opt).rewritten
    assert tuner.events[0][1] == "MainThread" and site.choice == "measured" and not site.pending_key
    torch.testing.assert_close(out, attend(q, k, v, mask), atol=1e-5, rtol=1e-5)


def test_the_e2e_bench_reports_how_much_tuning_the_compile_hid(cache, monkeypatch):
    from attnopt.bench.e2e import overlap_row

    tuner = Gated(cache)
    backend, opt = compiled_graphed(tuner, monkeypatch)
    with tuning.use_tuner(tuner):
        opt(*inputs())
    row = overlap_row(backend)
    job = backend.background_tunings[0]
    assert row["background_tunings"] == 1 and row["tuning_wall_s"] == round(job.wall_s, 3) > 0
    assert row["first_call_waited_s"] == round(backend.tune_wait_seconds, 3)
    assert row["tuning_hidden_s"] == round(max(0.0, job.wall_s - backend.tune_wait_seconds), 3)
    assert row["tuning_failed"] == []


def test_a_symbolic_length_is_tuned_per_bucket_in_the_background(cache):
    """A growing cache (symbolic KV length): the buckets are timed on the worker, the graph's op resolves to the
    bucketed plan (dense for short caches, a kernel plan for long ones) and runs each bucket's plan exactly."""
    def attend_gqa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    def rule(plan, site):
        if site.kv_len <= 32:
            return 1.0 if plan.kind == "dense" else 9.0
        return 1.0 if plan.kind != "dense" else 9.0

    threads = []

    class Recording(Tuner):
        def choose_bucketed(self, site, rank, **kw):
            threads.append(threading.current_thread().name)
            return super().choose_bucketed(site, rank, **kw)

    backend = Backend(OptimizeConfig(inner_backend="eager"))
    opt = torch.compile(attend_gqa, backend=backend.with_mode(None, graphed=True))
    with tuning.use_tuner(Recording(rule, cache, env=ENV, buckets=(32, 128))):
        for n in (20, 100):
            q, k, v = torch.randn(1, 4, 1, 64), torch.randn(1, 2, n, 64), torch.randn(1, 2, n, 64)
            torch._dynamo.maybe_mark_dynamic(k, 2)
            torch._dynamo.maybe_mark_dynamic(v, 2)
            torch.testing.assert_close(opt(q, k, v), attend_gqa(q, k, v), atol=1e-5, rtol=1e-5)
    (site,) = backend.report().rewritten
    assert threads and all(t.startswith("attnopt-tune") for t in threads) and site.pending_key
    assert site.chosen.kind == "bucketed" and site.choice == "measured" and site.calls == 2
    kinds = [plan.split('"kind": "')[1].split('"')[0] for plan in site.chosen.plans]
    assert kinds[0] == "dense" and kinds[1] != "dense"


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["reduce-overhead", "step-graphs"])
def test_on_a_gpu_the_real_tuner_runs_beside_inductor_and_the_replays_stay_exact(cache, mode):
    """On a GPU: the real timer (its CUDA-graph captures on the worker) beside inductor's compile, then inductor's
    CUDA-graph trees (or a graph replayed as step graphs replay it: inductor, graphed) record and replay the winner
    exactly, with a valid-length mask as a static cache has."""
    from attnopt.runtime.reference import decode_attention

    torch.manual_seed(0)
    n = 4096
    q = torch.randn(1, 8, 1, 64, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(1, 2, n, 64, device="cuda", dtype=torch.float16) for _ in range(2))
    mask = torch.zeros(1, 1, 1, n, dtype=torch.bool, device="cuda")
    mask[..., :3000] = True
    backend = Backend(OptimizeConfig(inner_backend="inductor"))
    compiled = backend.with_mode("reduce-overhead") if mode == "reduce-overhead" else backend.with_mode(None, True)
    with tuning.use_tuner(Tuner(cache=cache, budget_s=0.5)):
        opt = torch.compile(attend, backend=compiled, dynamic=False)
        ref = decode_attention(q, k, v, attn_mask=mask)
        for _ in range(4):
            torch.testing.assert_close(opt(q, k, v, mask).clone(), ref, atol=2e-3, rtol=2e-3)
    (site,) = backend.report().rewritten
    assert site.choice == "measured" and "background" in site.tuning and site.tune_s > 0, site.tuning
    assert backend.background_tunings[0].error == "" and not tuning_defer.unfinished()


class _FakeCuda:
    """Stands in for torch.cuda in ``bench.common.replayed_us``: a GPU that runs what is enqueued only when the host
    syncs, unless ``caught_up`` says it already reached the first event (a host pause longer than the preroll)."""

    def __init__(self, caught_up):
        self.log, self.caught_up, self.clock = [], list(caught_up), 0.0
        fake = self

        class Event:
            def __init__(self, enable_timing=True):
                self.at = None

            def record(self):
                fake.log.append("event")
                self.at = fake.clock

            def query(self):
                return fake.caught_up.pop(0)

            def elapsed_time(self, other):
                return other.at - self.at

        self.Event = Event

    def _sleep(self, cycles):
        self.log.append(("sleep", cycles))

    def synchronize(self):
        self.log.append("sync")


@pytest.mark.parametrize("caught_up", [[False], [True, False]])
def test_background_replays_are_enqueued_behind_a_gpu_wait(monkeypatch, caught_up):
    """A replay releases the GIL; beside the inner compile the host got it back a switch interval later, the GPU idle
    meanwhile and the end event late. With a preroll every timed replay is enqueued behind a GPU sleep before the
    host syncs; a GPU that caught up with the host anyway (the first event done before the last was enqueued) is
    timed again behind a wait twice as long."""
    from attnopt.bench import common

    fake = _FakeCuda(caught_up)
    monkeypatch.setattr(common.torch, "cuda", fake)
    monkeypatch.setattr(common, "sleep_cycles", lambda ms: int(ms * 1000))

    class Graph:
        def replay(self):  # 1 ms of GPU work
            fake.log.append("replay")
            fake.clock += 1.0

    assert common.replayed_us(Graph(), calls=4, replays=3, preroll_ms=20.0) == pytest.approx(1e3 / 4)
    tries = [i for i, e in enumerate(fake.log) if isinstance(e, tuple)]
    assert [fake.log[i][1] for i in tries] == [20000 * 2 ** k for k in range(len(caught_up))]
    last = fake.log[tries[-1]:]
    assert last == [("sleep", last[0][1]), "event"] + ["replay", "event"] * 3 + ["sync"]  # no sync in between


def test_the_gpu_timer_prerolls_longer_in_a_background_tuning(monkeypatch):
    from attnopt import timer as T
    from attnopt.bench import common

    seen = []
    monkeypatch.setattr(common, "replayed_us", lambda graph, n, replays, preroll_ms=0.0: seen.append(preroll_ms) or 1.0)

    def in_a_background_tuning():
        tuning_defer._BACKGROUND.on = True
        T.GpuTimer()._replayed("graph", 4)

    T.GpuTimer()._replayed("graph", 4)
    thread = threading.Thread(target=in_a_background_tuning)
    thread.start()
    thread.join()
    assert seen == [common.REPLAY_PREROLL_MS, T.BACKGROUND_PREROLL_MS] and T.BACKGROUND_PREROLL_MS >= 10
    assert common.REPLAY_PREROLL_MS > 0  # a replay's time is the GPU's alone (not the host's launch of it)


def test_the_bench_times_graph_replays_behind_a_gpu_wait(monkeypatch):
    """``time_us`` (every method of the benches, peers included) times replays enqueued behind a GPU sleep, as the
    tuner does: a graph's launch latency on the host is not a call's time, whatever the calls per graph."""
    from attnopt.bench import common

    seen = []
    monkeypatch.setattr(common, "captured_calls", lambda fn, **kw: ("graph", 7))
    monkeypatch.setattr(common, "replayed_us", lambda graph, n, replays, preroll_ms=0.0: seen.append((n, preroll_ms))
                        or 1.0)
    assert common.time_us(lambda: None, "graph") == 1.0
    assert seen == [(7, common.REPLAY_PREROLL_MS)]


@pytest.mark.parametrize("fail", [False, True])
def test_the_timers_inputs_and_graphs_are_freed_on_the_worker_at_the_end_of_the_job(cache, monkeypatch, fail):
    tuner = Gated(cache, fail=fail)
    released = []

    class Timer:
        def __call__(self, plan, site):
            return 1.0 if plan.runtime_key() == tuner.winner else 2.0

        def release(self):
            released.append(threading.current_thread().name)

    tuner.timer = Timer()
    backend, opt = compiled_graphed(tuner, monkeypatch)
    with tuning.use_tuner(tuner):
        opt(*inputs())
    assert released and released[-1].startswith("attnopt-tune")


def test_calls_of_a_graphed_graph_launch_the_captured_variant_outside_a_capture(cache, monkeypatch):
    """A graph that replays as CUDA graphs (step graphs record it; inductor's trees replay it): its calls before the
    recording run the kernels' captured variant (``tma_as_captured``), the one the tuner compiled, instead of
    compiling the pointer variant cold on the first call. A graph run eagerly at every call keeps pointer tiles."""
    from attnopt.runtime.kernels import common

    seen = []

    def inner(name, gm, example_inputs, mode):
        def run(*args):
            seen.append(getattr(common._AS_CAPTURED, "on", False))
            return gm.forward(*args)
        return run

    monkeypatch.setattr(backend_mod, "_compile_inner", inner)
    q, k, v, mask = inputs()
    for graphed in (True, False):
        backend = Backend(OptimizeConfig(inner_backend="eager"))
        torch._dynamo.reset()
        with tuning.use_tuner(Tuner(lambda p, s: 1.0, cache, env=ENV)):
            opt = torch.compile(attend, backend=backend.with_mode(None, graphed=graphed), dynamic=False)
            torch.testing.assert_close(opt(q, k, v, mask), attend(q, k, v, mask), atol=1e-5, rtol=1e-5)
        assert seen.pop() is graphed and not getattr(common._AS_CAPTURED, "on", False)
