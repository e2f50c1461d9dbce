"""attnopt.tuning_procs: a background tuning's warm-up compiles its candidates' kernels in worker processes (on the
CPU: the plumbing for real, in subprocesses that run the CPU path of the same first calls; the wiring with stand-ins)."""
import os
import sys
import threading

import pytest
import torch

from attnopt import timer as T
from attnopt import tuning, tuning_defer, tuning_procs
from attnopt.plan import DensePlan, SplitKVPlan
from attnopt.site import AttentionSite
from attnopt.tuning import Tuner

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_tuning_cost import SMOL_1K  # noqa: E402
from test_tuning_method import ENV, _ranked, cache  # noqa: E402,F401
from test_tuning_warm import Warmed, clock, cuda_stand_ins  # noqa: E402,F401

SITE = AttentionSite.canonical(q_heads=4, kv_heads=2, head_dim=16, kv_len=96, dtype="float32",
                               mask_kind="valid_length")


def test_plans_are_dealt_round_robin_into_at_most_procs_groups():
    plans = [SplitKVPlan(num_splits=s, block_n=64) for s in range(1, 8)]
    groups = tuning_procs.split(plans, 3)
    assert [len(g) for g in groups] == [3, 2, 2] and sorted(sum(groups, []), key=plans.index) == plans
    assert tuning_procs.split(plans[:2], 3) == [[plans[0]], [plans[1]]] and tuning_procs.split(plans, 1) == [plans]


def test_the_first_calls_run_in_worker_processes_and_report_their_errors():
    """Two real worker processes, each making its plans' first calls (the CPU path here) on the site's input set; a
    plan whose first call fails there is reported by its key, the others not at all."""
    class Unknown:  # a plan the worker cannot make: its first call fails there
        def runtime_key(self):
            return '{"data": {}, "kind": "no-such-kind", "version": 1}'

    good, bad = SplitKVPlan(num_splits=2, block_n=64), Unknown()
    got = tuning_procs.first_calls_in_processes([good, bad], SITE, procs=2, timeout_s=300)
    assert got["procs"] == 2 and got["procs_s"] > 0
    assert set(got["errors"]) == {bad.runtime_key()} and got["errors"][bad.runtime_key()].startswith("error: ")


def test_a_worker_that_fails_as_a_whole_fails_its_plans_only(monkeypatch):
    """A worker that cannot even start its calls (here: a payload it cannot read) gives each of its plans the error,
    and the call returns; nothing raises."""
    monkeypatch.setattr(tuning_procs.AttentionSite, "to_dict", lambda self: {"not": "a site"})
    plans = [SplitKVPlan(num_splits=2, block_n=64)]
    got = tuning_procs.first_calls_in_processes(plans, SITE, procs=1, timeout_s=300)
    assert list(got["errors"]) == [plans[0].runtime_key()]
    assert got["errors"][plans[0].runtime_key()].startswith("error: compile worker:")


def test_started_workers_serve_later_warm_ups_and_end_at_shutdown():
    """``prestart`` starts the workers before any tuning (beside dynamo's tracing); the warm-ups use them, one job
    after another, and hand them back; ``shutdown`` ends them."""
    tuning_procs.shutdown()
    try:
        assert tuning_procs.prestart(2) == 2
        started = {w.proc.pid for w in tuning_procs._idle}
        plans = [SplitKVPlan(num_splits=2, block_n=64), SplitKVPlan(num_splits=4, block_n=64)]
        first = tuning_procs.first_calls_in_processes(plans, SITE, procs=2, timeout_s=300)
        again = tuning_procs.first_calls_in_processes(plans[:1], SITE, procs=2, timeout_s=300)
        assert first["errors"] == {} == again["errors"]
        assert set(first["pids"]) == started and set(again["pids"]) <= started  # no new process
        workers = list(tuning_procs._idle)
        assert len(workers) == 2 and all(w.alive() for w in workers)
    finally:
        tuning_procs.shutdown()
    assert tuning_procs._idle == [] and all(w.proc.poll() is not None for w in workers)


def test_no_workers_start_without_a_gpu_or_a_background_tuning(monkeypatch):
    tuning_procs.shutdown()
    tuning_procs.prestart_for_tuning("reduce-overhead")  # no CUDA here
    tuning_procs.prestart_for_tuning(None)
    assert tuning_procs._idle == []


def test_the_procs_come_from_the_environment(monkeypatch):
    monkeypatch.delenv(tuning_procs.PROCS_ENV, raising=False)
    assert tuning_procs.compile_procs() == tuning_procs.BACKGROUND_COMPILE_PROCS and tuning_procs.compile_procs(0) == 0
    monkeypatch.setenv(tuning_procs.PROCS_ENV, "2")
    assert tuning_procs.compile_procs(0) == 2
    monkeypatch.setenv(tuning_procs.PROCS_ENV, "some")
    with pytest.raises(ValueError, match="ATTNOPT_TUNE_COMPILE_PROCS='some'.*whole number"):
        tuning_procs.compile_procs()


def _warm_up_with_stand_ins(monkeypatch, background: bool):
    """``GpuTimer.warm_up`` with CUDA and the first calls stood in: (what went to worker processes, the plans whose
    first call ran in this process)."""
    cuda_stand_ins(monkeypatch)
    here, sent = [], []
    monkeypatch.setattr(T, "site_call", lambda plan, site, s, state=None: lambda: here.append(plan.kind))
    monkeypatch.setattr(tuning_procs, "first_calls_in_processes", lambda plans, site, **kw: sent.append(
        ([p.runtime_key() for p in plans], kw["device"])) or {"procs": 2, "procs_s": 1.5, "errors": {}})
    plans = [SplitKVPlan(num_splits=2, block_n=64), DensePlan(backend="cudnn"), SplitKVPlan(num_splits=4, block_n=64)]
    timer = T.GpuTimer()
    result = {}

    def run():
        tuning_defer._BACKGROUND.on = background
        result["errors"] = timer.warm_up(plans, SITE)

    thread = threading.Thread(target=run)  # (the background flag is per thread)
    thread.start()
    thread.join()
    assert result["errors"] == {}
    return sent, sorted(here), timer.last_warm_up, plans


def test_a_background_warm_up_compiles_the_kernel_plans_in_processes_first(monkeypatch):
    monkeypatch.delenv(tuning_procs.PROCS_ENV, raising=False)
    sent, here, last, plans = _warm_up_with_stand_ins(monkeypatch, background=True)
    # the kernel plans went to the workers (on this device), the dense one not (cuDNN's graphs are per thread);
    # every first call still runs here afterwards (loading what the workers compiled)
    assert sent == [([plans[0].runtime_key(), plans[2].runtime_key()], 0)]
    assert here == ["dense", "split_kv", "split_kv"] and last["procs"] == 2
    assert last["calls_cpu_s"] >= 0  # the CPU its first calls here took, on every thread


def test_a_warm_up_on_the_callers_thread_or_with_no_procs_compiles_here(monkeypatch):
    monkeypatch.delenv(tuning_procs.PROCS_ENV, raising=False)
    sent, here, last, _ = _warm_up_with_stand_ins(monkeypatch, background=False)
    assert sent == [] and len(here) == 3 and set(last) == {"calls_cpu_s"}
    monkeypatch.setenv(tuning_procs.PROCS_ENV, "0")
    sent, here, last, _ = _warm_up_with_stand_ins(monkeypatch, background=True)
    assert sent == [] and len(here) == 3 and set(last) == {"calls_cpu_s"}


def test_the_tuning_record_says_what_the_workers_did(cache, clock):
    timer = Warmed(clock)
    timer.last_warm_up = {"procs": 3, "procs_s": 4.25, "errors": {"k": "error: X: y"}, "calls_cpu_s": 0.5}
    Tuner(timer, cache, env=ENV, budget_s=4.0).choose(SMOL_1K, _ranked(SMOL_1K))
    record = cache.get(ENV, tuning.ShapeKey.of(SMOL_1K, 1088, False))
    assert record["compile_procs"] == 3 and record["compile_procs_s"] == 4.25
    assert record["compile_procs_errors"] == {"k": "error: X: y"} and record["warm_up_calls_cpu_s"] == 0.5
    assert record["tune_cpu_s"] >= 0  # the tuner thread's own CPU seconds


# ---------------------------------------------------------------------------------------- on a GPU
@pytest.mark.cuda
def test_after_the_workers_this_process_compiles_nothing(monkeypatch, tmp_path):
    """On the GPU, in a fresh process (the GPU suite runs one per test) with an empty Triton cache: the compile
    workers make SmolLM2's 1k static site's kernel plans' first calls, then the same first calls here build no
    Triton IR at all (``ASTSource.make_ir`` is where a compile starts; a cache hit never gets there): the work moved
    out of this process."""
    import dataclasses

    from triton.compiler.compiler import ASTSource

    from attnopt.runtime.kernels.common import tma_as_captured

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    tuning_procs.shutdown()  # (workers started earlier would not see this cache directory)
    site = dataclasses.replace(SMOL_1K, dtype="bfloat16")
    plans = [p for p in tuning.to_time(_ranked(site), tuning.DEFAULT_TOP_K) if not T._warmed_here(p)]
    assert plans
    got = tuning_procs.first_calls_in_processes(plans, site, device=torch.cuda.current_device(), procs=2)
    assert got["errors"] == {} and got["procs"] == 2
    assert any((tmp_path / "triton").iterdir())  # the workers' compiles are on disk
    built = []
    real = ASTSource.make_ir
    monkeypatch.setattr(ASTSource, "make_ir", lambda self, *a, **k: built.append(self.name) or real(self, *a, **k))
    warm_set = T.synthetic_inputs(site, 0, reduce=False)
    with torch.no_grad():
        for plan in plans:
            with tma_as_captured():
                T.site_call(plan, site, warm_set)()
        torch.cuda.synchronize()
    assert built == []


def test_workers_start_at_optimize_on_a_first_run_with_a_background_tuning_ahead(monkeypatch, tmp_path):
    """``prestart_for_tuning`` (what ``optimize`` calls): with a GPU, Triton compiling, tuning on and no tuning cache
    file yet; not for another mode, with tuning off, or once the cache file exists (the shapes are likely measured)."""
    from attnopt.tuning_cache import cache_path

    started = []
    monkeypatch.setattr(tuning_procs, "prestart", lambda n=None: started.append(1) or 3)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("ATTNOPT_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("ATTNOPT_TUNE", raising=False)
    monkeypatch.delenv(tuning_procs.PROCS_ENV, raising=False)
    tuning_procs.prestart_for_tuning("reduce-overhead")
    assert started == [1]
    tuning_procs.prestart_for_tuning(None)
    monkeypatch.setenv("ATTNOPT_TUNE", "0")
    tuning_procs.prestart_for_tuning("reduce-overhead")
    monkeypatch.delenv("ATTNOPT_TUNE")
    cache_path().parent.mkdir(parents=True, exist_ok=True)
    cache_path().write_text("{}")
    tuning_procs.prestart_for_tuning("reduce-overhead")
    assert started == [1]
