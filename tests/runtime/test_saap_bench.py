"""``attnopt bench saap``: its budget arithmetic and command line on the CPU; a tiny case on a GPU."""
import argparse
import json
import os

import pytest
import torch

from attnopt.bench.saap import budget, speed_verdict
from attnopt.bench.saap_breakdown import SELECT_WARPS, STAGES, stage_of, unchained
from attnopt.bench.saap_options import PLANNED_FUSE, fuse_choices, saap_geometries, select_warps_choices, \
    stages_choices, window_splits_choices, window_stream_choices
from attnopt.cli import build_parser


def test_budget_hits_the_target_selectivity():
    for n, clusters in ((32768, 512), (131072, 2048), (524288, 2048)):
        for target in (0.02, 0.05, 0.10):
            window, probes = budget(target, n, clusters)
            attended = 1 + window + probes * n / clusters
            assert window <= 2047 and abs(attended / n - target) < 0.5 * n / clusters / n + 1e-9


def test_speed_verdict_compares_with_the_fastest_dense_method():
    rows = [{"case": "llama3-8b-128k", "method": "attnopt:saap", "target": 0.05, "selectivity": 0.051, "us": 20.0,
             "fastest_dense": "sdpa-cudnn", "fastest_dense_us": 110.0, "speedup_vs_fastest_dense": 5.5},
            {"case": "llama3-8b-512k", "method": "attnopt:saap", "target": 0.05, "selectivity": 0.05, "us": 60.0,
             "fastest_dense": "attnopt:split_kv", "fastest_dense_us": 420.0, "speedup_vs_fastest_dense": 7.0},
            {"case": "llama3-8b-512k", "method": "attnopt:saap", "target": 0.10, "selectivity": 0.1, "us": 90.0,
             "fastest_dense": "attnopt:split_kv", "fastest_dense_us": 420.0, "speedup_vs_fastest_dense": 4.7}]
    lines = speed_verdict(rows)
    assert len(lines) == 2  # the 10 % row is not a target
    assert "5.50x sdpa-cudnn" in lines[0] and lines[0].endswith("need 5x: PASS")
    assert "7.00x attnopt:split_kv" in lines[1] and lines[1].endswith("need 8x: FAIL")


def test_breakdown_sorts_each_kernel_into_its_launch():
    assert stage_of("_saap_rows_kernel") == "scoring_us"
    assert stage_of("_saap_select_kernel") == "selection_us"
    assert stage_of("_saap_kernel") == "attention_us"
    assert stage_of("_merge_states_kernel") == "merge_us"
    assert stage_of("void at::native::vectorized_elementwise_kernel<4, ...>") == "other_us"
    assert list(STAGES)[-1] == "other_us"


def test_unchained_turns_pdl_off_and_restores_the_setting(monkeypatch):
    from attnopt.runtime.kernels.common import pdl_supported

    monkeypatch.delenv("ATTNOPT_PDL", raising=False)
    with unchained():
        assert os.environ["ATTNOPT_PDL"] == "0" and not pdl_supported(torch.device("cpu"))
    assert "ATTNOPT_PDL" not in os.environ
    monkeypatch.setenv("ATTNOPT_PDL", "1")
    with unchained():
        assert os.environ["ATTNOPT_PDL"] == "0"
    assert os.environ["ATTNOPT_PDL"] == "1"


def test_geometry_sweep_options():
    assert saap_geometries("", "") == ([0], [0])
    assert saap_geometries("16,0,64", "32,64") == ([16, 0, 64], [32, 64])
    for splits, block_n in (("-1", ""), ("", "48"), ("x", "")):
        with pytest.raises(ValueError, match="--saap-block-n 0"):
            saap_geometries(splits, block_n)


def test_fuse_choice_option():
    assert fuse_choices("both,none") == ["both", "none"] and fuse_choices("merge,merge,select") == ["merge", "select"]
    for bad in ("1", "yes", ","):
        with pytest.raises(ValueError, match="--saap-fuse takes a comma-separated list of both, none, select, merge"):
            fuse_choices(bad)
    args = build_parser().parse_args(["bench", "saap"])
    assert fuse_choices(args.saap_fuse) == [PLANNED_FUSE, "none"]  # the planner's own plan first


def test_window_stream_option():
    assert window_stream_choices("off,late,on,off") == ["off", "late", "on"] and window_stream_choices("") == ["off"]
    for bad in ("1", "yes", ","):
        with pytest.raises(ValueError, match="--saap-window-stream takes a comma-separated list of off, on, late"):
            window_stream_choices(bad)
    args = build_parser().parse_args(["bench", "saap"])
    assert window_stream_choices(args.saap_window_stream) == ["off"]


@pytest.mark.parametrize("parse,option,given,want,bad", [
    (select_warps_choices, "--saap-select-warps", "0,8,8,16", [0, 8, 16], ("3", "x", ",", "64")),
    (stages_choices, "--saap-stages", "0,3,3,2", [0, 3, 2], ("1", "x", ",", "4")),
    (window_splits_choices, "--saap-window-splits", "0,8,12,8", [0, 8, 12], ("-1", "x", ","))])
def test_integer_list_options(parse, option, given, want, bad):
    assert parse(given) == want and parse("") == [0]
    for text in bad:
        with pytest.raises(ValueError, match=f"{option} takes a comma-separated list of 0"):
            parse(text)
    args = build_parser().parse_args(["bench", "saap"])
    assert parse(getattr(args, option[2:].replace("-", "_"))) == [0]


def test_bench_saap_is_registered():
    args = build_parser().parse_args(["bench", "saap", "--cases", "llama3-8b-128k", "--targets", "0.05"])
    assert args.cases == "llama3-8b-128k" and args.func.__module__ == "attnopt.bench.saap"


@pytest.mark.cuda
def test_bench_saap_tiny_case_on_the_gpu(tmp_path):
    from attnopt.bench.saap import run

    res = run(argparse.Namespace(cases="tiny-4k", targets="0.05", dtype="bf16", dense_candidates=1, no_mlp=False,
                                 commit=None, saap_fuse="both,none", saap_window_stream="off,on,late"))
    every = [r for r in res["rows"] if r["method"].startswith("attnopt:saap")]
    assert len(every) == 12 and all("us" in r and r["rel_err"] < 2e-2 for r in every), json.dumps(every)
    saap = [r for r in every if not r["method"].endswith(("-ws", "-wsl"))]
    # window_stream (forked first or after the scoring): the same launches and one more attention launch (the
    # window's, on the side stream)
    for suffix in ("-ws", "-wsl"):
        apart = {r["method"][:-len(suffix)]: r for r in every if r["method"].endswith(suffix)}
        assert sorted(apart) == sorted(r["method"] for r in saap) and all(
            apart[r["method"]]["kernels_per_call"] == r["kernels_per_call"] + 1 for r in saap), json.dumps(every)
    unfused = [r for r in saap if r["method"].endswith("-unfused")]
    fused = [r for r in saap if not r["method"].endswith("-unfused")]
    # four launches: scoring (2 with the MLP), selection, attention, merge, and no other kernel
    assert all(r["attention_us"] > 0 and r["selection_us"] > 0 and r["merge_us"] > 0 and r["scoring_us"] > 0
               and r["other_us"] == 0 and r["us_pdl"] > 0 and r["fuse"] == "none" for r in unfused), json.dumps(saap)
    assert sorted(r["kernels_per_call"] for r in unfused) == [4, 5], json.dumps(saap)
    # fused: the scoring launch selects, the attention launch merges
    assert all(r["attention_us"] > 0 and r["selection_us"] == 0 and r["merge_us"] == 0 and r["scoring_us"] > 0
               and r["other_us"] == 0 and r["fuse"] == "both" for r in fused), json.dumps(saap)
    assert sorted(r["kernels_per_call"] for r in fused) == [2, 3], json.dumps(saap)
    assert all(0.01 < r["selectivity"] < 0.3 for r in saap)
    # the selection alone at each width, beside the centroid-scored rows
    timed = [r["selection_us_by_warps"] for r in every if "-mlp" not in r["method"]]
    assert timed and all(sorted(t) == sorted(str(w) for w in SELECT_WARPS) and min(t.values()) > 0
                         for t in timed), json.dumps(every)


def test_smollm2_step_script_trains_the_default_index_and_times_saap_beside_dense(tmp_path, monkeypatch,
                                                                                 saap_tiny_llama):
    """benchmarks/saap_smollm2_step.py on a tiny Llama on the CPU (the eager inner backend instead of
    reduce-overhead): the index it trains is attnopt's default, the forced SAAP row runs SAAP at every covered layer
    with probing every cluster giving dense tokens, and the rows compare."""
    import importlib.util
    import types
    from pathlib import Path

    pytest.importorskip("faiss")
    from attnopt.runtime.saap import load_index, registry
    from attnopt.runtime.saap.train import DEFAULT_REFINE

    spec = importlib.util.spec_from_file_location(
        "saap_smollm2_step", Path(__file__).parents[2] / "benchmarks" / "saap_smollm2_step.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr(script, "MODE", {"inner_backend": "eager"})
    registry.reset()
    model = saap_tiny_llama
    tok = lambda text, return_tensors=None: types.SimpleNamespace(  # noqa: E731 - characters as token ids
        input_ids=torch.tensor([[ord(c) % 97 for c in text]]))
    path = tmp_path / "index.safetensors"
    info = script.train_default_index(model, tok, path, 160, 2, "cpu")
    index = load_index(path, model.config)
    assert (index.rotated, index.has_mlp, index.refine, sorted(index.layers)) == (True, False, DEFAULT_REFINE, [1, 2])
    assert info["clusters"] == index.num_clusters == 32 and info["decode"] == index.decode_defaults()
    ids = script.prompt_ids(tok, 150)
    rows = [script.measure(m, model, ids, str(path), steps=3, warmup=1, device="cpu")
            for m in ("attnopt-ro", "attnopt-ro+saap-forced")]
    dense, saap = rows
    assert dense["kinds"] and "saap" not in dense["kinds"] and saap["kinds"] == ["saap"]
    assert saap["saap_sites"] >= 1 and 0 < saap["selectivity_sparse_layers"] < 1  # 2 probes of 32 clusters
    assert len(saap["tokens"]) == len(dense["tokens"]) == 5 and dense["step_ms"] > 0
    script.compare(rows)
    assert saap["vs_attnopt_dense"] == dense["step_ms"] / saap["step_ms"] and saap["tokens_as_dense"].endswith("/5")
    assert (saap["first_token_difference"] is None) == (saap["tokens"] == dense["tokens"])
    assert (dense["prompt"], dense["context"]) == (150, 154)  # the last timed step attends to 154 keys
    with pytest.raises(ValueError, match="valid: hf-compiled"):
        script.measure("saap", model, ids, str(path), 1, 1, "cpu")
    registry.reset()
