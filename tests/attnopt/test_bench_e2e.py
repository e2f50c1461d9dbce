"""``attnopt bench e2e`` on the CPU: runs taking turns (no timed section beside a compile), a context's methods
starting together, and the host time of generate()'s decode calls on HF's path and attnopt's."""
from __future__ import annotations

import threading
import time
import types

import pytest
import torch

import attnopt
from attnopt.bench import e2e, e2e_parallel, turns


def _holds(turn, started: threading.Event, release: threading.Event) -> threading.Thread:
    def run():
        with turn():
            started.set()
            release.wait(10)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_compiles_share_their_turn_and_a_timed_section_waits_for_them(tmp_path, monkeypatch):
    monkeypatch.setenv(turns.LOCK_ENV, str(tmp_path / "gpu.lock"))
    first, second, timed = threading.Event(), threading.Event(), threading.Event()
    release = threading.Event()
    workers = [_holds(turns.compile_turn, first, release)]
    assert first.wait(5)
    workers.append(_holds(turns.compile_turn, second, release))
    assert second.wait(5)  # two compiles at once
    workers.append(_holds(turns.gpu_turn, timed, threading.Event()))
    assert not timed.wait(0.3)  # the timed section waits while a compile runs
    release.set()
    assert timed.wait(5)
    blocked = threading.Event()
    workers.append(_holds(turns.compile_turn, blocked, threading.Event()))
    assert not blocked.wait(0.3)  # and a compile waits while the timed section runs


@pytest.fixture
def fresh_turns(tmp_path, monkeypatch):
    """The lock file set, and no turn held by this thread from an earlier test."""
    import threading

    monkeypatch.setenv(turns.LOCK_ENV, str(tmp_path / "gpu.lock"))
    monkeypatch.setattr(turns, "_held", threading.local())
    monkeypatch.setattr(turns, "_BOOT_FD", None)
    return tmp_path / "gpu.lock"


def test_turns_nest_and_a_timed_section_inside_a_shared_turn_excludes_the_others(fresh_turns):
    other, release = threading.Event(), threading.Event()
    with turns.compile_turn():
        with turns.compile_turn():  # covered: a no-op, not a second lock of this thread's own
            pass
        with turns.gpu_turn():  # the shared turn becomes the exclusive one ...
            _holds(turns.compile_turn, other, release)
            assert not other.wait(0.3)  # ... and another run's compile waits for it
        assert other.wait(5)  # back to shared: compiles run side by side again
    release.set()


def test_a_worker_holds_the_shared_turn_from_its_boot_to_its_exit(fresh_turns):
    """The boot of an isolated worker takes the shared turn before anything else (its imports are CPU work beside
    which no timed section may run), and keeps it until the process ends, unless a timed section converts it."""
    import subprocess
    import sys

    boot = turns.WORKER_BOOT.split("from attnopt.cli")[0] + "print('booted', flush=True)\nsys.stdin.read()\n"
    env = dict(__import__("os").environ)
    timed, release = threading.Event(), threading.Event()
    _holds(turns.gpu_turn, timed, release)
    assert timed.wait(5)
    proc = subprocess.Popen([sys.executable, "-c", boot], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=env)
    try:
        time.sleep(0.5)
        assert proc.poll() is None and not _ready(proc)  # waiting for the timed section before its boot goes on
        release.set()
        assert proc.stdout.readline().strip() == "booted"
        mine = threading.Event()
        _holds(turns.gpu_turn, mine, threading.Event())
        assert not mine.wait(0.5)  # the worker lives, holding the shared turn: no timed section
        proc.stdin.close()
        proc.wait(10)
        assert mine.wait(5)  # it exited: the turn is free
    finally:
        proc.kill()


def _ready(proc) -> bool:
    import select

    return bool(select.select([proc.stdout], [], [], 0)[0])


def test_the_boot_descriptor_is_the_main_threads_shared_turn(fresh_turns, monkeypatch):
    """In the worker, ``turns`` adopts the boot's descriptor: the main thread already holds the shared turn, a timed
    section converts it, and the shared turn is held again afterwards."""
    import fcntl
    import os

    fd = os.open(fresh_turns, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    fcntl.flock(fd, fcntl.LOCK_SH)
    monkeypatch.setattr(turns, "_BOOT_FD", str(fd))
    blocked, release = threading.Event(), threading.Event()
    with turns.compile_turn():  # adopts the boot's descriptor, already shared
        assert turns._held.fd == fd and turns._held.mode == fcntl.LOCK_SH
    _holds(turns.gpu_turn, blocked, release)
    assert not blocked.wait(0.3)  # the main thread still holds the shared turn between turns
    with turns.compile_turn():
        pass
    release.set()
    os.close(fd)
    assert blocked.wait(5)


def test_parallel_runs_start_a_contexts_methods_together(monkeypatch):
    running, seen, lock = set(), [], threading.Lock()

    def isolated(args, context, method):
        with lock:
            running.add((context, method))
            seen.append(frozenset(running))
        time.sleep(0.05)
        with lock:
            running.discard((context, method))
        return [{"method": method, "context": context}]

    monkeypatch.setattr(e2e_parallel, "isolated", isolated)
    args = types.SimpleNamespace(parallel=2)
    rows = e2e_parallel.run_parallel(args, [1, 2, 3], ["hf-compiled", "attnopt-ro"])
    assert [(r["context"], r["method"]) for r in rows] == [(c, m) for c in (1, 2, 3)
                                                           for m in ("hf-compiled", "attnopt-ro")]
    assert all(len({c for c, _ in now}) == 1 and len(now) <= 2 for now in seen)  # one context at a time
    assert any(len(now) == 2 for now in seen)  # its two methods side by side
    assert {r["concurrent_compiles"] for r in rows} == {2}


@torch.no_grad()
@pytest.mark.parametrize("method", ["hf-eager", "attnopt-ro"])
def test_generate_row_reports_the_host_time_of_each_decode_call(monkeypatch, method):
    """One timed sample per decode forward of the eight timed generate() calls (the prefill is not one), and the
    model is left as it was."""
    monkeypatch.setitem(e2e.OPTIMIZE_OPTIONS, "attnopt-ro", {"mode": "reduce-overhead", "inner_backend": "eager"})
    model, _ = e2e.build_model("tiny", layers=None, dtype=torch.float32, device="cpu", max_positions=256)
    args = types.SimpleNamespace(device="cpu", cache="static", generate_tokens=4, generate_repeats=3, profile=True)
    row = e2e.generate_row(args, model, method, 24)
    assert row["generate_forward_calls"] == 3 * ((8 - 1) + (12 - 1))
    # ms/token: the periods between consecutive decode calls of each timed generate() (one fewer than its calls);
    # each spans a whole decode call, so none is shorter than the shortest call; the pairs' differences beside them
    assert row["generate_token_periods"] == 3 * ((8 - 2) + (12 - 2))
    assert row["generate_ms_per_token_min"] <= row["generate_ms_per_token"] <= row["generate_ms_per_token_max"]
    assert row["generate_ms_per_token_min"] >= row["generate_forward_host_ms_min"]
    low, high = row["generate_ms_per_token_p10_p90"]
    assert row["generate_ms_per_token_min"] <= low <= high <= row["generate_ms_per_token_max"]
    pairs = row["generate_ms_per_token_pairs"]
    assert len(pairs) == 3 and row["generate_ms_per_token_pairs_median"] == sorted(pairs)[1]
    assert 0 < row["generate_forward_host_ms_min"] <= row["generate_forward_host_ms"]
    assert 0 < row["generate_forward_host_ms"] < 1e3 * row["generate_first_call_s"]
    assert "__call__" not in vars(model)
    # the host profile of one more generate() call: HF's sampling loop is in it; attnopt's forward where it runs
    profile = row["generate_host_profile"]
    assert profile["own"] and all(r["own_us_per_token"] >= 0 for r in profile["own"])
    names = [r["function"] for r in profile["attnopt_cumulative"]]
    assert any(n.startswith("forward (attnopt/api.py") for n in names) == (method == "attnopt-ro")
    if method == "attnopt-ro":  # on the CPU the step graphs run their fallback (CUDA tensors only), and say why
        assert row["generate_step_graphs"]["fallbacks"] and row["generate_step_graphs"]["replays"] == 0


def test_token_periods_run_from_one_decode_call_to_the_next_within_each_generate_call():
    class Model:
        def __call__(self, work_s):
            time.sleep(work_s)

    model = Model()
    timer = turns.DecodeCallTimer(model, hf_compiles=False)
    for calls in (4, 3):  # two generate() calls: no period spans the gap between them
        with timer.record():
            for _ in range(calls):
                model.__call__(0.002)
        time.sleep(0.05)
    periods = timer.token_seconds()
    assert len(periods) == 3 + 2 and all(0.002 <= p < 0.05 for p in periods)
    timer.remove()


def test_decode_call_timer_needs_hfs_compiled_call_where_hf_compiles():
    model, _ = e2e.build_model("tiny", layers=None, dtype=torch.float32, device="cpu", max_positions=64)
    with pytest.raises(RuntimeError, match="_compiled_call"):
        turns.DecodeCallTimer(model, hf_compiles=True)
    opt = attnopt.optimize(model, inner_backend="eager")
    timer = turns.DecodeCallTimer(opt, hf_compiles=False)
    assert "__call__" in vars(opt)
    timer.remove()
    assert "__call__" not in vars(opt) and timer.median_ms() is None


def test_profile_kernel_classes():
    """The profile's classes name what a decode step's kernels are for: attnopt's attention and its mask scans apart
    from input copies, GEMMs, inductor's kernels and SDPA's."""
    from attnopt.bench.e2e_profile import _kernel_class

    assert _kernel_class("_split_kv_kernel") == "attnopt attention kernels"
    assert _kernel_class("_merge_states_kernel") == "attnopt attention kernels"
    assert _kernel_class("_valid_len_kernel").startswith("attnopt mask scans")
    assert _kernel_class("cudnn_generated_fort_native_sdpa_sm90_flash_fprop") == "SDPA kernels"
    assert _kernel_class("triton_poi_fused_add_0") == "inductor kernels"
    assert _kernel_class("triton_poi_fused_lt_valid_len_0") == "inductor kernels"
    # the RoPE-and-cache-write kernel inductor fuses ahead of the op carries its name: not attention work
    assert _kernel_class("triton_poi_fused__to_copy_cat_cos_decode_attention_index_copy_sin_3") == "inductor kernels"
    assert _kernel_class("nvjet_tst_64x8_64x16_4x1_v_bz_TNT") == "GEMMs"
    assert _kernel_class("void at::native::(anonymous namespace)::multi_tensor_apply_kernel").startswith("other")


def test_busy_and_exclusive_time_of_kernel_classes():
    """Busy: the union of a class's kernel intervals; exclusive: the part no other class overlaps (a PDL-launched
    kernel waiting on its predecessor overlaps it)."""
    from types import SimpleNamespace

    from attnopt.bench.e2e_profile import _busy_us_by_class

    def kernel(name, start, end):
        return SimpleNamespace(name=name, device_type="DeviceType.CUDA", time_range=SimpleNamespace(start=start,
                                                                                                    end=end))

    events = [kernel("nvjet_gemm", 0, 10), kernel("_split_kv_kernel", 8, 20), kernel("_merge_states_kernel", 18, 24),
              kernel("nvjet_gemm", 30, 40), kernel("_split_kv_kernel", 41, 45), kernel("cpu op", 0, 100)]
    events[-1].device_type = "DeviceType.CPU"
    busy = _busy_us_by_class(SimpleNamespace(events=lambda: events), n=2)
    assert busy["attnopt attention kernels"] == ((16 + 4) / 2, (14 + 4) / 2)
    assert busy["GEMMs"] == (20 / 2, 18 / 2)


def test_attention_in_step_per_layer_against_standalone():
    """Issue 16's check: the attention kernels and the mask scans made for them (exclusive µs a step) per rewritten
    site, against the same plan timed alone; other classes are not attention."""
    from attnopt.bench.e2e_profile import attention_in_step

    profile = {"gpu_by_class": {"attnopt attention kernels": {"exclusive_us_per_step": 300.0},
                                "attnopt mask scans (valid length, window start)": {"exclusive_us_per_step": 3.0},
                                "inductor kernels": {"exclusive_us_per_step": 270.0}}}
    got = attention_in_step(profile, 30, {"us": 10.0})
    assert got == {"attention_in_step_us_per_layer": 10.1, "attention_in_step_vs_standalone": 1.01}
    assert attention_in_step(profile, 0, None) == {}
    assert "attention_in_step_vs_standalone" not in attention_in_step(profile, 30, {"error": "x"})


def test_standalone_attention_goes_round_every_layers_cache(monkeypatch):
    """The yardstick of the in-step check reads each layer's cache in turn, as a step does (one layer's cache read
    again and again stays partly in L2): every call of a captured run uses the next layer's K/V."""
    from attnopt.bench import common, e2e_profile

    model, _ = e2e.build_model("tiny", layers=None, dtype=torch.float32, device="cpu", max_positions=64)
    cache = e2e.make_cache(model, "static", 40)
    with torch.no_grad():
        e2e.prefill(model, cache, torch.randint(0, model.config.vocab_size, (1, 8)), chunk=64)
    opt = attnopt.optimize(model, inner_backend="eager")
    with torch.no_grad():
        opt(input_ids=torch.tensor([[1]]), past_key_values=cache, use_cache=True)
    report = attnopt.last_plans(opt)
    seen = []

    def fake_time_us(fn, mode, *, min_calls):
        for _ in range(2 * min_calls):
            fn()
        return 1.0

    real = torch.ops.attnopt.decode_attention
    monkeypatch.setattr(torch.ops.attnopt, "decode_attention",
                        lambda q, k, *a: seen.append(k.data_ptr()) or real(q, k, *a), raising=False)
    monkeypatch.setattr(common, "time_us", fake_time_us)
    got = e2e_profile.standalone_attention_us(report, cache, 9)
    layers = [layer.keys.data_ptr() for layer in cache.layers]
    assert got["layers_rotated"] == len(layers) > 1
    assert seen == layers + layers


def test_parallel_workers_compile_together_and_time_one_after_another(fresh_turns):
    """Three worker processes booted as ``--parallel`` boots them, each preparing (1 s, shared) then timing (0.3 s,
    exclusive), as ``e2e.run_one`` does: their preparations overlap (not one after another, which made the H100 suite
    time out at 3f41936), and every timed section runs alone, after every preparation has ended."""
    import json
    import subprocess
    import sys

    worker = turns.WORKER_BOOT.split("from attnopt.cli")[0] + (
        "import json, time\n"
        "from attnopt.bench import turns\n"
        "t = {'c0': time.time()}\n"
        "with turns.compile_turn():\n"
        "    time.sleep(1.0)\n"
        "t['c1'] = time.time()\n"
        "with turns.gpu_turn():\n"
        "    t['g0'] = time.time()\n"
        "    time.sleep(0.3)\n"
        "    t['g1'] = time.time()\n"
        "print(json.dumps(t))\n")
    procs = [subprocess.Popen([sys.executable, "-c", worker], stdout=subprocess.PIPE, text=True) for _ in range(3)]
    runs = [json.loads(p.communicate(timeout=120)[0].strip().splitlines()[-1]) for p in procs]
    prepared_by = max(r["c1"] for r in runs)
    assert all(r["g0"] >= prepared_by - 0.05 for r in runs)  # no timed section beside a preparation
    timed = sorted((r["g0"], r["g1"]) for r in runs)
    assert all(a[1] <= b[0] + 0.05 for a, b in zip(timed, timed[1:]))  # nor beside another timed section
    overlaps = sum(1 for r in runs for o in runs if o is not r and r["c0"] < o["c1"] and o["c0"] < r["c1"])
    assert overlaps > 0  # the preparations ran side by side


def test_a_worker_prepares_all_of_its_row_before_its_one_timed_turn(monkeypatch):
    """``run_one``: the model, the decode steps' prefill and compile and generate()'s compiling calls all come before
    the one exclusive turn, in which every timed part runs (a timed turn between two compiles would wait for every
    other worker's compiles, twice)."""
    import contextlib

    events = []

    @contextlib.contextmanager
    def turn(name):
        events.append(f"{name} in")
        yield
        events.append(f"{name} out")

    def phases(kind):
        def gen(args, model, method, context):
            events.append(f"{kind} prepare")
            yield
            events.append(f"{kind} time")
            return {f"{kind}_row": True}
        return gen

    monkeypatch.setattr(e2e, "gpu_turn", lambda: turn("gpu"))
    monkeypatch.setattr(e2e, "compile_turn", lambda: turn("compile"))
    monkeypatch.setattr(e2e, "build_model", lambda *a, **k: events.append("build") or (None, ""))
    monkeypatch.setattr(e2e, "decode_phases", phases("decode"))
    monkeypatch.setattr(e2e, "generate_phases", phases("generate"))
    monkeypatch.setattr(e2e, "end_helper_processes", lambda: events.append("end helpers") or {"attnopt_workers": 0})
    args = types.SimpleNamespace(model="tiny", layers=None, dtype="float32", device="cpu", generate=True)
    rows = e2e.run_one(args, 64, "hf-eager")
    load = rows[0].pop("load_average_at_timing")
    assert load is None or len(load) == 3
    assert rows == [{"decode_row": True, "generate_row": True, "helpers_ended": {"attnopt_workers": 0}}]
    assert events == ["compile in", "build", "decode prepare", "generate prepare", "end helpers", "compile out",
                      "gpu in", "decode time", "generate time", "gpu out"]


def test_the_helper_processes_end_before_the_timed_turn():
    """attnopt's idle workers (a real one here) and inductor's compile pool end; later compiles start them again."""
    from attnopt import tuning_procs
    from attnopt.bench.turns import end_helper_processes

    tuning_procs.shutdown()
    tuning_procs.prestart(1)
    worker = tuning_procs._idle[0]
    ended = end_helper_processes()
    assert ended["attnopt_workers"] == 1 and worker.proc.poll() is not None and not tuning_procs._idle
    assert ended["inductor_compile_workers"] is True


def test_tuning_records_keep_what_a_host_aware_choice_weighed(tmp_path, monkeypatch):
    """The default mode (no CUDA graphs) weighs each candidate's host time: a dense plan whose op call costs less
    host time wins over a faster kernel, and the e2e record keeps every candidate's µs and its device and host
    medians by name (the H100 run at c88617a kept only the winner's)."""
    from attnopt.bench.e2e_profile import tuning_records
    from attnopt.config import OptimizeConfig
    from attnopt.hardware import builtin_profile
    from attnopt.passes.plan import rank_candidates
    from attnopt.runtime.strategies import PlanContext
    from attnopt.site import AttentionSite
    from attnopt.tuning import Tuner, TuningCache

    monkeypatch.setenv("ATTNOPT_CACHE_DIR", str(tmp_path))

    class HostBound:
        def __call__(self, plan, site):
            return 5.0 if plan.kind == "dense" else 4.0

        def host_us(self, plan, site):
            return 40.0 if plan.kind == "dense" else 90.0
    site = AttentionSite.canonical(kv_len=4096)
    ranked = rank_candidates(site, builtin_profile("h100-sxm"), PlanContext(device_type="cuda", triton_available=True),
                             OptimizeConfig())[0]
    env = {"device": "d", "driver": "1", "torch": "t", "triton": "t", "attnopt": "a", "tuning": "13"}
    Tuner(HostBound(), TuningCache(), env=env).choose(site, ranked, graphed=False)
    (record,) = tuning_records()
    assert record["winner"] == "dense" and record["measured_us"] == 40.0
    assert record["timings"] and all(n.split("(")[0] in ("dense", "split_kv", "stream_k") for n in record["timings"])
    assert set(record["host_us"]) == set(record["device_us"]) == set(record["timings"])
    assert min(v for n, v in record["host_us"].items() if n.startswith("split_kv")) == 90.0
