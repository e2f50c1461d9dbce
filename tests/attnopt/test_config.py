import json

import pytest
import torch

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
                                       ({"version": 99}, "version 99 is not supported"),
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


# ------------------------------------------------------------------------------- every field is checked early
def test_every_field_has_a_check():
    from attnopt.config import FIELD_CHECKS

    assert set(FIELD_CHECKS) == set(OptimizeConfig.field_names())


@pytest.mark.parametrize("field,value,normalised", [
    ("strategies", "split_kv", ("split_kv",)),  # one name, never its characters
    ("strategies", ["dense", "split_kv"], ("dense", "split_kv")),
    ("skip_sites", "model.layers.0.self_attn", ("model.layers.0.self_attn",)),
    ("verify_atol", 1, 1.0),
    ("sliding_windows", {"layers.1": 6}, (("layers.1", 6),)),
    ("hardware", "h200", "h200"),
    ("topology", "dgx-h100x2", "dgx-h100x2"),
    ("min_kv_len", 0, 0),
])
def test_values_are_normalised(field, value, normalised):
    assert getattr(OptimizeConfig(**{field: value}), field) == normalised


@pytest.mark.parametrize("field,value,error,match", [
    ("max_decode_q_len", "16", TypeError, "max_decode_q_len must be an int in 1..16, got str '16'"),
    ("max_decode_q_len", True, TypeError, "max_decode_q_len must be an int"),
    ("dynamic", "yes", TypeError, "dynamic must be True or False, got str 'yes'"),
    ("verify", "no", TypeError, "verify must be True or False, got str 'no'"),
    ("verify", 1, TypeError, "verify must be True or False"),
    ("hardware", 123, TypeError, "hardware must be a str, got int 123; valid: .*h100-sxm.*local, or a path to a .json"),
    ("hardware", "h900", ValueError, "unknown hardware 'h900'; valid: a100-80gb, cpu, h100-pcie, h100-sxm, h200"),
    ("hardware", "missing.json", ValueError, "hardware='missing.json': no such file"),
    ("topology", "dgx-z", ValueError, "unknown topology 'dgx-z'; valid: .*dgx-h100x2"),
    ("force_plan", "bogus", ValueError, "unknown force_plan 'bogus'; valid: .*dense, ring, saap, split_kv, stream_k, .*tree"),
    ("strategies", ["split_kv", "splitkv"], ValueError, "strategies: unknown 'splitkv'; valid: .*dense, ring"),
    ("strategies", 3, TypeError, "strategies must be a string or a list of strings"),
    ("skip_sites", ["a", 1], TypeError, "skip_sites must hold strings"),
    ("inner_backend", "tvm", ValueError, "valid choices: inductor, eager, aot_eager, cudagraphs"),
    ("min_kv_len", -1, ValueError, "min_kv_len must be >= 0, got -1"),
    ("min_kv_len", "64", TypeError, "min_kv_len must be an int"),
    ("verify_calls", 0, ValueError, "verify_calls must be >= 1"),
    ("verify_atol", "1e-3", TypeError, "verify_atol must be a number"),
    ("verify_atol", -1.0, ValueError, "verify_atol must be a finite number >= 0"),
    ("verify_atol", float("inf"), ValueError, "verify_atol must be a finite number >= 0"),
    ("sliding_windows", {"layers.1": -4}, ValueError, "the window of 'layers.1' must be an int > 0, got -4"),
    ("sliding_windows", [("layers.1",)], ValueError, "must be \\(module path, window\\) pairs"),
    ("sliding_windows", "layers.1", TypeError, "sliding_windows must be"),
    ("plan_log", "", ValueError, "plan_log must be a file path"),
    ("plan_log", 5, TypeError, "plan_log must be a file path"),
])
def test_bad_field_values_name_the_field(field, value, error, match):
    with pytest.raises(error, match=match):
        OptimizeConfig(**{field: value})


def test_plan_log_is_checked_at_construction(tmp_path):
    with pytest.raises(ValueError, match="is a directory"):
        OptimizeConfig(plan_log=str(tmp_path))
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match=f"cannot be created: {blocker} is a file, not a directory"):
        OptimizeConfig(plan_log=str(blocker / "sub" / "plans.jsonl"))
    deep = tmp_path / "a" / "b" / "plans.jsonl"  # a parent that can be created is fine; nothing is created yet
    assert OptimizeConfig(plan_log=deep).plan_log == str(deep) and not (tmp_path / "a").exists()


def test_plan_log_env_is_checked_when_read(monkeypatch, tmp_path):
    monkeypatch.setenv("ATTNOPT_PLAN_LOG", str(tmp_path))
    with pytest.raises(ValueError, match=r"\$ATTNOPT_PLAN_LOG=.* is a directory"):
        OptimizeConfig().resolved_plan_log()


def test_force_plan_of_a_registered_plan_type_passes_the_config():
    """The config knows plan types (attnopt.plan), not strategies (runtime): a kind whose type exists passes here,
    and ``check_call`` (run by optimize and the string backend) says when no strategy implements it."""
    from attnopt.config import check_call
    from attnopt.passes.plan import check_strategies
    from attnopt.runtime.strategies import STRATEGIES

    if "saap" in STRATEGIES:
        pytest.skip("a SAAP strategy is registered in this build")
    cfg = OptimizeConfig(force_plan="saap")
    for call in (lambda: check_call(cfg), lambda: check_strategies(cfg)):
        with pytest.raises(ValueError, match="force_plan: plan kind 'saap' has a plan type but no strategy implements it"):
            call()


@pytest.mark.parametrize("mode", [None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"])
def test_valid_modes(mode):
    from attnopt.config import check_call

    check_call(OptimizeConfig(), mode=mode)


def test_bad_mode_and_topology_without_a_group():
    from attnopt.config import check_call

    with pytest.raises(ValueError, match="mode='bogus' is not valid; valid choices: None, default, reduce-overhead"):
        check_call(OptimizeConfig(), mode="bogus")
    with pytest.raises(ValueError, match="topology='dgx-h100x2' is only used to plan over a process group"):
        check_call(OptimizeConfig(topology="dgx-h100x2"))
    import torch.distributed as dist

    check_call(OptimizeConfig(topology="dgx-h100x2"), process_group=dist.ProcessGroup(dist.HashStore(), 0, 1))


@pytest.mark.parametrize("bad", ["gloo", 0, [0, 1], object()])
def test_process_group_of_another_type_is_refused_at_optimize(bad):
    """``optimize(model, process_group=...)`` with something that is not a ProcessGroup raises at once, naming what
    is accepted (it used to pass until the first call, failing inside dynamo's compile)."""
    import attnopt

    with pytest.raises(TypeError, match="process_group must be a torch.distributed.ProcessGroup .* or None"):
        attnopt.optimize(torch.nn.Linear(2, 2), process_group=bad)


def test_a_dist_group_is_named_for_its_pg():
    import torch.distributed as dist

    from attnopt.config import check_call
    from attnopt.runtime.distributed.groups import DistGroup

    fields = {f: None for f in DistGroup.__dataclass_fields__}
    group = DistGroup(**dict(fields, pg=dist.ProcessGroup(dist.HashStore(), 0, 1)))
    with pytest.raises(TypeError, match=r"attnopt DistGroup: pass its \.pg"):
        check_call(OptimizeConfig(), process_group=group)


def test_options_must_be_a_mapping():
    with pytest.raises(TypeError, match="attnopt options must be an OptimizeConfig or a dict, got str"):
        OptimizeConfig.from_options("eager")


def test_round_trip_of_every_normalised_field(tmp_path):
    cfg = OptimizeConfig(strategies="split_kv", skip_sites="a", sliding_windows={"l.1": 4}, verify_atol=1,
                         hardware="h200", plan_log=tmp_path / "p.jsonl", dynamic=False, min_kv_len=0)
    assert OptimizeConfig.from_json(cfg.to_json()) == cfg


@pytest.mark.parametrize("options, match", [
    ({"strategies": ()}, "names no plan kind"),
    ({"strategies": ["dense"], "force_plan": "split_kv"}, "not among strategies"),
    ({"saap_probes": 4}, "saap_probes only apply with a SAAP index"),
    ({"saap_window": 16, "saap_sink": 2}, "saap_sink, saap_window only apply"),
])
def test_options_that_contradict_each_other(options, match):
    """Options that could never take effect together are an error when the config is made (they were silently
    ignored: no strategy meant dense anyway, a force_plan outside strategies left every site alone)."""
    with pytest.raises(ValueError, match=match):
        OptimizeConfig(**options)


def test_corrupt_hardware_and_saap_files_are_named_by_optimize(tmp_path):
    """A hardware profile that does not parse, or a SAAP index that is not safetensors, is reported by
    ``attnopt.optimize`` itself, not at the first compile wrapped in dynamo's BackendCompilerFailed."""
    import attnopt

    profile = tmp_path / "profile.json"
    profile.write_text("{not json")
    index = tmp_path / "index.safetensors"
    index.write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match="not a valid attnopt hardware profile"):
        attnopt.optimize(lambda x: x, hardware=str(profile))
    with pytest.raises(ValueError, match="not a readable SAAP index"):
        attnopt.optimize(lambda x: x, saap=str(index))
