import json

import pytest

from attnopt import OptimizeConfig


def test_defaults_round_trip_json():
    cfg = OptimizeConfig(strategies=("dense", "split_kv"), skip_sites=("model.layers.0.self_attn",), verify=True)
    again = OptimizeConfig.from_json(cfg.to_json())
    assert again == cfg
    assert json.loads(cfg.to_json())["version"] == 1


def test_frozen():
    cfg = OptimizeConfig()
    with pytest.raises(Exception):
        cfg.verify = True  # type: ignore[misc]


def test_unknown_option_lists_valid_ones():
    with pytest.raises(ValueError) as err:
        OptimizeConfig.from_options({"inner_backnd": "eager"})
    msg = str(err.value)
    assert "inner_backnd" in msg and "inner_backend" in msg and "verify" in msg


@pytest.mark.parametrize("bad,match", [({"inner_backend": "tvm"}, "valid choices: inductor, eager, aot_eager, cudagraphs"),
                                       ({"max_decode_q_len": 17}, "1..16"),
                                       ({"version": 99}, "version 99"),
                                       ({"verify_calls": 0}, "verify_calls")])
def test_bad_values(bad, match):
    with pytest.raises(ValueError, match=match):
        OptimizeConfig.from_options(bad)


def test_replace_and_lists_become_tuples():
    cfg = OptimizeConfig.from_options({"strategies": ["dense"]})
    assert cfg.strategies == ("dense",)
    assert cfg.replace(verify=True).verify and not cfg.verify


def test_plan_log_env(monkeypatch, tmp_path):
    monkeypatch.setenv("ATTNOPT_PLAN_LOG", str(tmp_path / "x.jsonl"))
    assert OptimizeConfig().resolved_plan_log() == str(tmp_path / "x.jsonl")
    assert OptimizeConfig(plan_log="a.jsonl").resolved_plan_log() == "a.jsonl"
