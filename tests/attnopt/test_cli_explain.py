"""``attnopt explain`` and ``attnopt calibrate`` on a CPU machine: output, JSON, plots and every error path."""
import json

import pytest
import torch

from attnopt import hardware as H
from attnopt.cli import main

NO_CUDA = not torch.cuda.is_available()


def run(capsys, *argv):
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_explain_ranks_every_candidate(capsys):
    rc, out, err = run(capsys, "explain", "--batch", "1", "--heads", "32/8", "--head-dim", "128", "--context", "131072")
    assert rc == 0, err
    for text in ("candidates, fastest first", "predicted µs", "% of roofline", "(chosen)", "split_kv(", "stream_k(",
                 "dense(", "rejected", "tree: needs a process group", "device_type='cuda'"):
        assert text in out, text
    if NO_CUDA:
        assert "no GPU here: using the h100-sxm datasheet profile" in out


def test_explain_json_is_ranked_and_names_the_profile(capsys):
    rc, out, _ = run(capsys, "explain", "--heads", "9/3", "--head-dim", "64", "--context", "8k", "--profile", "h200",
                     "--json")
    assert rc == 0
    data = json.loads(out)
    ests = [c["est_us"] for c in data["candidates"]]
    assert ests == sorted(ests) and data["candidates"][0]["chosen"]
    assert data["profile"] == "h200 (uncalibrated)" and data["site"]["kv_len"] == 8192
    assert {c["kind"] for c in data["candidates"]} >= {"dense", "split_kv", "stream_k"}
    assert all(0 < c["frac_of_roofline"] <= 1 for c in data["candidates"])


def test_explain_symbolic_length_states_the_runtime_rule(capsys):
    rc, out, _ = run(capsys, "explain", "--context", "32k", "--symbolic", "--json")
    data = json.loads(out)
    assert rc == 0 and data["site"]["kv_len"] is None
    assert any("runtime rule" in n and "valid_len" in n for n in data["notes"])


def test_unsupported_head_dim_says_it_falls_back_to_dense(capsys):
    rc, out, _ = run(capsys, "explain", "--heads", "8/8", "--head-dim", "100", "--context", "4096")
    assert rc == 0
    assert "falls back to dense" in out and "dense(" in out


@pytest.mark.parametrize("argv,message", [
    (("--heads", "30/8"), "query heads (30) must be a multiple of KV heads (8)"),
    (("--heads", "abc"), "expected Hq/Hkv"),
    (("--context", "lots"), "expected a length"),
    (("--q-len", "64"), "at most 16 query tokens"),
    (("--profile", "h900"), "valid names: a100-80gb, cpu, h100-pcie, h100-sxm, h200, mi300x, rtx-4090"),
    (("--gpus", "256", "--topology", "dgx-h100x16"), "world size 256 is larger than topology 'dgx-h100x16'"),
    (("--gpus", "8", "--topology", "dgx-b200"), "unknown topology 'dgx-b200'; valid names: 2x-h200-nvlink"),
    (("--topology", "dgx-h100x1"), "only applies with --gpus > 1"),
])
def test_bad_input_is_a_clear_error(capsys, argv, message):
    rc, out, err = run(capsys, "explain", *argv)
    assert rc == 2 and message in err, err


def test_corrupt_profile_file_is_named(capsys, tmp_path):
    bad = tmp_path / "mine.json"
    bad.write_text("{not json")
    rc, _, err = run(capsys, "explain", "--profile", str(bad))
    assert rc == 2 and "mine.json is not a valid attnopt hardware profile" in err


def test_corrupt_calibrated_cache_is_ignored_with_a_warning(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv(H.CACHE_ENV, str(tmp_path))
    device = "NVIDIA H100 80GB HBM3"
    path = H.cached_profile_path(device)
    path.parent.mkdir(parents=True)
    path.write_text("garbage")
    monkeypatch.setattr(H, "local_device_name", lambda: device)
    monkeypatch.setattr(H, "detect_profile", lambda: H.profile_for_device_name(device))
    with pytest.warns(UserWarning, match="corrupt calibrated hardware profile"):
        rc, out, _ = run(capsys, "explain", "--profile", "local", "--json")
    assert rc == 0 and json.loads(out)["profile"] == "h100-sxm (uncalibrated)"


@pytest.mark.skipif(not NO_CUDA, reason="checks the error without a GPU")
def test_measure_without_cuda_is_an_error(capsys):
    rc, _, err = run(capsys, "explain", "--measure")
    assert rc == 2 and "--measure needs a CUDA GPU" in err


def test_plot_single_writes_a_png(capsys, tmp_path):
    png = tmp_path / "lat.png"
    rc, out, _ = run(capsys, "explain", "--context", "65536", "--plot", str(png))
    assert rc == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "wrote" in out


def test_multi_gpu_explain_prefers_tree(capsys):
    rc, out, err = run(capsys, "explain", "--heads", "16", "--head-dim", "128", "--context", "5120000", "--gpus", "128",
                       "--topology", "dgx-h100x16")
    assert rc == 0, err
    for text in ("128 GPUs (16 node(s))", "dgx-h100x16", "(chosen)", "ring(world=128, variant=pass_kv)",
                 "tree over the best ring"):
        assert text in out, text
    chosen = [ln for ln in out.splitlines() if "(chosen)" in ln]
    assert chosen and "tree(" in chosen[0]


def test_multi_gpu_simulation_plot_and_results_json(capsys, tmp_path):
    png, js = tmp_path / "sim.png", tmp_path / "sim.json"
    rc, out, err = run(capsys, "explain", "--heads", "16", "--head-dim", "128", "--context", "5120000", "--gpus", "64",
                       "--topology", "dgx-h100x16", "--plot", str(png), "--out", str(js))
    assert rc == 0, err
    assert png.read_bytes()[:4] == b"\x89PNG"
    data = json.loads(js.read_text())
    assert data["suite"] == "cost_model" and data["device"] == "simulation" and data["world_size"] == 64
    assert {"commit", "torch", "rows", "crossover_vs_best_ring"} <= set(data)
    assert data["gpu_counts"] == [8, 16, 32, 64, 128]  # the counts that fit the topology
    row = data["rows"][0]
    assert {"case", "B", "Hq", "Hkv", "D", "N", "dtype", "method", "tree_us", "ring_pass_kv_us"} <= set(row)


@pytest.mark.skipif(not NO_CUDA, reason="checks the error without a GPU")
def test_calibrate_without_cuda_is_an_error(capsys):
    rc, _, err = run(capsys, "calibrate")
    assert rc == 2 and "needs a CUDA GPU" in err


def test_calibrate_show_prints_the_profile_in_use(capsys):
    rc, out, _ = run(capsys, "calibrate", "--show")
    assert rc == 0 and "profile used on this machine" in out
    body = out[out.index("{"):]
    assert H.HardwareProfile.from_json(body).name


def test_measure_plumbing_with_a_stand_in_timer(capsys, tmp_path, monkeypatch):
    """``--measure --plot`` on a machine without a GPU, with the GPU measurement replaced by a stand-in that
    reports 1.1x each plan's prediction: the table gets a measured column and the plot measured points."""
    from attnopt import calibrate as cal

    seen = []

    def fake_measure(site, plans, valid=None, l2_bytes=None, device="cuda", timer=None):
        hw = H.builtin_profile("h100-sxm")
        seen.append(site.kv_len)
        return {p.describe(): 1.1 * cal.predict_us(site, p, hw) for p in plans}

    monkeypatch.setattr(cal, "require_cuda", lambda: None)
    monkeypatch.setattr(cal, "measure_site", fake_measure)
    png = tmp_path / "m.png"
    rc, out, err = run(capsys, "explain", "--context", "32768", "--profile", "h100-sxm", "--measure", "--plot", str(png))
    assert rc == 0, err
    assert "measured µs" in out and png.exists()
    assert 32768 in seen and {4096, 16384, 65536, 262144} <= set(seen)
    rc, out, _ = run(capsys, "explain", "--context", "4096", "--profile", "h100-sxm", "--measure", "--json")
    data = json.loads(out)
    assert set(data["measured_us"]) == {c["plan"] for c in data["candidates"]}


def test_calibrate_command_flow_with_cpu_stand_ins(capsys, tmp_path, monkeypatch):
    """``attnopt calibrate --validate`` end to end on the CPU: the GPU measurements are replaced by CPU
    stand-ins (wall-clock timer, tiny shapes); the profile lands in the cache and the results JSON is written."""
    import functools
    import statistics
    import time

    from attnopt import calibrate as cal

    def timer(fn):
        ts = []
        for _ in range(3):
            t = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t) * 1e6)
        return statistics.median(ts)

    monkeypatch.setenv(H.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(cal, "require_cuda", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU 1")
    monkeypatch.setattr(cal, "calibrate", functools.partial(cal.calibrate, shapes=((1, 4, 2, 64, 96, 1),),
                                                            dtype="float32", device="cpu", timer=timer,
                                                            probe=lambda: (20.0, 18.0, 9.0)))
    monkeypatch.setattr(cal, "validate", functools.partial(cal.validate, dtype="float32", device="cpu", timer=timer,
                                                           shapes=[("tiny", (1, 4, 2, 64, 96, 1), None)]))
    out_json = tmp_path / "cost_model.json"
    rc, out, err = run(capsys, "calibrate", "--validate", "--quiet", "--out", str(out_json))
    assert rc == 0, err
    assert "saved the calibrated profile" in out and H.cached_profile_path("Fake GPU 1").exists()
    data = json.loads(out_json.read_text())
    assert data["suite"] == "cost_model" and data["summary"]["shapes"] == 1
    assert data["profile_calibrated"]["calibrated"] and not data["profile_uncalibrated"]["calibrated"]
    assert {"case", "method", "us", "pred_us_calibrated", "chosen_calibrated", "frac_of_roofline"} <= set(data["rows"][0])
