"""attnopt.timer_proc: a background tuning's timer calls made in a worker process (off the inner compile's GIL). On
the CPU: the tuner through the proxy chooses as through the timer itself, errors keep the worker's text, a worker that
dies hands the rest of the job to this process's timer, and a real worker process answers over its pipe."""
import os
import sys

import pytest
import torch

from attnopt import timer as T
from attnopt import timer_proc, tuning, tuning_procs
from attnopt.plan import SplitKVPlan
from attnopt.site import AttentionSite
from attnopt.tuning import Tuner

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_tuning_cost import SMOL_1K  # noqa: E402
from test_tuning_method import ENV, _ranked, cache  # noqa: E402,F401  (cache: the fixture, a fresh cache directory)


class FakeGpuTimer:
    """Stands in for the worker's ``GpuTimer``: µs by a rule, a warm-up, a valid length, a fill, and what it was
    asked. A plan of 17 splits fails to run (the worker's error text must reach the tuner)."""

    def __init__(self, rule):
        self.rule, self.asked, self.last_warm_up = rule, [], {}

    def __call__(self, plan, site):
        self.asked.append(("time", plan.runtime_key()))
        if getattr(plan, "num_splits", 0) == 17:
            raise ValueError("no such launch")
        return self.rule(plan, site)

    def at_fill(self, plan, site, keys):
        self.asked.append(("at_fill", keys))
        return self.rule(plan, site) / 2

    def valid_len_us(self, site, eager=False):
        self.asked.append(("valid_len_us", site.kv_len))
        return 3.0

    def warm_up(self, plans, site, eager=False, procs=None):
        self.asked.append(("warm_up", procs))
        self.last_warm_up = {"calls_cpu_s": 0.25}
        return {}

    def release(self):
        self.asked.append(("release",))


class InProcessWorker:
    """A worker whose answers ``serve_timer_call`` makes here, over JSON as the pipe carries them; ``dies_after``:
    answer that many calls, then none (a worker that died)."""

    def __init__(self, gpu_timer, dies_after=None):
        self.gpu_timer, self.dies_after, self.sent, self.closed = gpu_timer, dies_after, [], False

    def send(self, payload):
        import json

        self.sent.append(json.loads(json.dumps(payload)))

    def receive(self, deadline):
        import json

        if self.dies_after is not None and len(self.sent) > self.dies_after:
            return None
        return json.loads(json.dumps(timer_proc.serve_timer_call(self.sent[-1], self.gpu_timer)))

    def problem(self):
        return "exit -9"

    def close(self):
        self.closed = True


def rule(p, s):
    return 5.0 if p.kind == "dense" else 4.0 + 0.01 * getattr(p, "num_splits", 0)


@pytest.fixture
def no_compile_procs(monkeypatch):
    monkeypatch.setenv(tuning_procs.PROCS_ENV, "0")


def test_the_tuner_through_the_worker_chooses_as_through_the_timer(cache, monkeypatch, no_compile_procs):
    """Every call the tuner makes goes over the pipe (none to this process's timer); the choice, its timings and the
    worker's error text of a plan that fails there are those of the timer itself; the record says where it timed."""
    site = SMOL_1K
    ranked = _ranked(site)
    worker_timer, local = FakeGpuTimer(rule), FakeGpuTimer(rule)
    worker = InProcessWorker(worker_timer)
    monkeypatch.setattr(tuning_procs, "_take", lambda n: [worker])
    proxy = timer_proc.ProcessTimer(local, None)
    through = Tuner(proxy, cache, env=ENV, budget_s=4.0).choose(site, ranked, valid_len_sharing=30)
    proxy.release()
    direct = Tuner(FakeGpuTimer(rule), None, env=ENV, budget_s=4.0).choose(site, ranked, valid_len_sharing=30)
    assert through.plan.runtime_key() == direct.plan.runtime_key() and through.timings == direct.timings
    assert set(local.asked) == {("release",)} and ("warm_up", 0) in worker_timer.asked
    assert worker_timer.asked[-1] == ("release",) and len([a for a in worker_timer.asked if a[0] == "time"]) > 3
    failed = {k: v for k, v in through.timings.items() if isinstance(v, str) and "no such launch" in v}
    # SMOL_1K's candidates hold a 17-split plan (and its one-launch twin), which the fake timer cannot launch
    assert failed and set(failed.values()) == {"error: ValueError: no such launch"}
    assert failed == {k: v for k, v in direct.timings.items() if isinstance(v, str) and "no such launch" in v}
    record = cache.get(ENV, tuning.ShapeKey.of(site, site.kv_len, False, 30))
    assert record["timer"] == "worker" and record["warm_up_calls_cpu_s"] == 0.25
    from attnopt.tuning_defer import in_background

    assert not in_background(), "a timer call served in this thread left it marked as a background tuning"


def test_a_worker_that_dies_hands_the_rest_of_the_job_to_this_process(cache, monkeypatch, no_compile_procs):
    site = SMOL_1K
    ranked = _ranked(site)
    worker_timer, local = FakeGpuTimer(rule), FakeGpuTimer(rule)
    worker = InProcessWorker(worker_timer, dies_after=0)  # its first answer never comes: the warm-up's
    monkeypatch.setattr(tuning_procs, "_take", lambda n: [worker])
    proxy = timer_proc.ProcessTimer(local, None)
    choice = Tuner(proxy, cache, env=ENV, budget_s=4.0).choose(site, ranked, valid_len_sharing=30)
    proxy.release()
    proxy.close()
    assert choice.choice == "measured" and worker_timer.asked == [] and worker.closed
    assert local.asked[0] == ("warm_up", None) and len([a for a in local.asked if a[0] == "time"]) > 3
    assert "stopped answering (exit -9)" in proxy.failed
    record = cache.get(ENV, tuning.ShapeKey.of(site, site.kv_len, False, 30))
    assert record["timer"].startswith("this process (the timing worker stopped answering")


class FakeTimerWorker(tuning_procs._Worker):
    """A real worker process (``tuning_procs.serve`` over its pipes) whose GPU timer is a ``FakeGpuTimer``."""

    def __init__(self):
        import subprocess
        import tempfile

        program = (f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})\n"
                   "import test_timer_proc as t\nfrom attnopt import timer, tuning_procs\n"
                   "timer.gpu_timer = t.FakeGpuTimer(t.rule)\nsys.exit(tuning_procs.serve())\n")
        self.log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen([sys.executable, "-c", program], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, bufsize=1)
        self.timed_out = False


def test_a_whole_choice_over_a_real_worker_process_is_the_timers_choice(cache, monkeypatch, no_compile_procs):
    """Every call of a whole choice (warm-up, timings, the tie-break's fill, release) as JSON lines through a real
    worker process: the choice and the timings, errors included, are those of the same timer called here."""
    worker = FakeTimerWorker()
    monkeypatch.setattr(tuning_procs, "_take", lambda n: [worker])
    proxy = timer_proc.ProcessTimer(FakeGpuTimer(rule), None)
    try:
        through = Tuner(proxy, cache, env=ENV, budget_s=30.0).choose(SMOL_1K, _ranked(SMOL_1K), valid_len_sharing=30)
        assert not proxy.failed and worker.alive()
    finally:
        worker.close()
    direct = Tuner(FakeGpuTimer(rule), None, env=ENV, budget_s=30.0).choose(SMOL_1K, _ranked(SMOL_1K),
                                                                           valid_len_sharing=30)
    assert through.plan.runtime_key() == direct.plan.runtime_key() and through.timings == direct.timings
    assert "error: ValueError: no such launch" in through.timings.values()
    record = cache.get(ENV, tuning.ShapeKey.of(SMOL_1K, SMOL_1K.kv_len, False, 30))
    assert record["timer"] == "worker" and record["span_us"] and "tie_warm_up_s" not in record  # (a fill: no compile)


def test_a_real_worker_process_answers_and_its_errors_keep_their_text():
    """A real worker (``python -m attnopt.tuning_procs --serve``): a call that fails there (no CUDA on this machine:
    the GPU timer cannot make its input sets) raises here with the worker's error text, and the worker stays."""
    tuning_procs.shutdown()
    proxy = timer_proc.ProcessTimer(T.GpuTimer(), None)
    site = AttentionSite.canonical(q_heads=4, kv_heads=2, head_dim=16, kv_len=96, dtype="float32",
                                   mask_kind="valid_length")
    try:
        with pytest.raises(timer_proc.WorkerTimerError) as raised:
            proxy.valid_len_us(site)
        assert raised.value.worker_text.startswith("error: ") and T.error_text(raised.value).startswith("error: ")
        assert not proxy.failed and proxy._worker.alive()
        with pytest.raises(timer_proc.WorkerTimerError, match="unknown timer call"):
            proxy._ask("no-such-call", lambda: None)
    finally:
        proxy.close()
        tuning_procs.shutdown()


def test_only_the_process_gpu_timer_on_a_gpu_with_workers_on_moves_to_a_worker(monkeypatch):
    monkeypatch.delenv(tuning_procs.PROCS_ENV, raising=False)
    released = []
    monkeypatch.setattr(timer_proc.ProcessTimer, "release", lambda self: released.append(1))
    monkeypatch.setattr(tuning_procs, "_take", lambda n: [InProcessWorker(FakeGpuTimer(rule))])
    monkeypatch.setattr(tuning_procs, "_give_back", lambda workers: None)
    tuner = Tuner(env=ENV)
    assert tuner.timer is T.gpu_timer
    with timer_proc.timing_in_worker(tuner, 0):
        assert isinstance(tuner.timer, timer_proc.ProcessTimer) and tuner.timer.device == 0
    assert tuner.timer is T.gpu_timer and released == [1]
    with timer_proc.timing_in_worker(tuner, None):  # (not on a GPU)
        assert tuner.timer is T.gpu_timer
    fake = Tuner(lambda p, s: 1.0, env=ENV)
    with timer_proc.timing_in_worker(fake, 0):  # (a test's or a user's timer)
        assert not isinstance(fake.timer, timer_proc.ProcessTimer)
    monkeypatch.setenv(tuning_procs.PROCS_ENV, "0")
    with timer_proc.timing_in_worker(tuner, 0):
        assert tuner.timer is T.gpu_timer


@pytest.mark.cuda
def test_on_a_gpu_the_choice_times_in_a_worker_and_this_thread_stays_idle(cache):
    """SmolLM2's 1k static site, chosen in the background through a timing worker: measured, recorded as timed in the
    worker, with little CPU on this thread (the 256 input sets' captures ran there)."""
    import time

    from attnopt.tuning_defer import _BACKGROUND

    site = AttentionSite.canonical(q_heads=9, kv_heads=3, head_dim=64, kv_len=1088, mask_kind="valid_length",
                                   dtype="bfloat16")
    tuner = Tuner(cache=cache, env=tuning.environment_key())
    ranked = _ranked(site)
    cpu = time.thread_time()
    _BACKGROUND.on = True
    try:
        with timer_proc.timing_in_worker(tuner, torch.cuda.current_device()):
            choice = tuner.choose(site, ranked, valid_len_sharing=30)
    finally:
        _BACKGROUND.on = False
    cpu = time.thread_time() - cpu
    record = cache.get(tuning.environment_key(), tuning.ShapeKey.of(site, site.kv_len, False, 30))
    assert choice.choice == "measured" and record["timer"] == "worker", record
    assert cpu < 0.5 * record["tune_s"], (cpu, record["tune_s"])
