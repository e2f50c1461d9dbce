"""``attnopt bench headroom`` on the CPU: its option parsing, the plans it sweeps and the summary it draws (the
timing itself needs a GPU: ``bash benchmarks/gpu.sh headroom``)."""
from __future__ import annotations

import pytest

from attnopt.bench.headroom import parse_configs, parse_ints, summarize, sweep_plans


def test_options_parse_and_bad_ones_name_the_option():
    assert parse_ints("16, 33,66", "--splits") == (16, 33, 66) and parse_ints("", "--stream-k-grids") == ()
    assert parse_configs("64x4x3,128x8x2", "--configs") == ((64, 4, 3), (128, 8, 2))
    with pytest.raises(ValueError, match="--splits.*whole numbers"):
        parse_ints("16,many", "--splits")
    with pytest.raises(ValueError, match="--splits.*>= 1"):
        parse_ints("0", "--splits")
    with pytest.raises(ValueError, match="--configs: '64x4' is not BLOCK_NxWARPSxSTAGES"):
        parse_configs("64x4", "--configs")


def test_sweep_caps_splits_at_one_per_32_keys_and_scales_stream_k_grids_by_sms():
    plans = sweep_plans(100, 132, (2, 4, 5), ((64, 4, 3),), (1, 2), ((32, 4, 2),))
    split = [p for p in plans if p.kind == "split_kv"]
    stream = [p for p in plans if p.kind == "stream_k"]
    assert [p.num_splits for p in split] == [2, 4]  # 100 keys: at most 4 splits
    assert [p.grid for p in stream] == [132, 264] and all(p.tma for p in plans)
    assert (stream[0].block_n, stream[0].num_warps, stream[0].num_stages) == (32, 4, 2)


def test_summary_leaves_out_failed_and_inexact_rows():
    rows = [dict(method="read-floor", us=10.0, rel_err=0.0),
            dict(method="sdpa-cudnn", us=20.0, rel_err=1e-3, peer=True),
            dict(method="sdpa-flash", us=25.0, rel_err=1e-3, peer=True),
            dict(method="split_kv fast but wrong", us=5.0, rel_err=0.5, peer=False),
            dict(method="split_kv out of smem", error="OutOfResources", peer=False),
            dict(method="split_kv good", us=16.0, rel_err=2e-3, peer=False)]
    s = summarize("c", rows, 10.0)
    assert (s["best_peer"], s["best_peer_us"], s["best"], s["best_us"]) == ("sdpa-cudnn", 20.0, "split_kv good", 16.0)
    assert s["peer_over_best"] == pytest.approx(1.25) and s["floor_over_best"] == pytest.approx(0.625)
    assert s["bad"] == ["split_kv fast but wrong", "split_kv out of smem"]


def test_cli_rejects_unknown_cases_and_runs_only_on_a_gpu(capsys):
    from attnopt.cli import main

    assert main(["bench", "headroom", "--cases", "nope"]) == 2
    assert "unknown case(s) nope; known:" in capsys.readouterr().out
    import torch

    if not torch.cuda.is_available():
        assert main(["bench", "headroom", "--cases", "llama3-8b-32k"]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().out
