"""The command line on the user's path: bad plan logs are one line naming the file and line (exit 2), a closed
pipe ends quietly, and the bench help and the multigpu refusal say what they do. (``python -m attnopt ... | head``
through a real pipe is replayed in test_user_path.py.)"""
import json
import math
import os

import pytest

from attnopt.cli import EXIT_BROKEN_PIPE
from attnopt.cli import main as cli_main
from attnopt.plan import DensePlan
from attnopt.report import PlanReport, SiteReport
from attnopt.site import AttentionSite


def _report(n_sites=1) -> PlanReport:
    sites = [SiteReport(site=AttentionSite.canonical(node=f"sdpa_{i}", module_path=f"model.layers.{i}.self_attn"),
                        chosen=DensePlan(reason="test").with_estimate(10.0), rewritten=True, key=f"g0:sdpa_{i}")
             for i in range(n_sites)]
    return PlanReport(sites=sites, profile="cpu", graph="g0")


def _log(tmp_path, *lines) -> str:
    path = tmp_path / "plans.jsonl"
    path.write_bytes(b"\n".join(line if isinstance(line, bytes) else line.encode() for line in lines) + b"\n")
    return str(path)


GOOD = _report().to_json()


@pytest.mark.parametrize("lines,message", [
    ((GOOD, "[1, 2]"), "plans.jsonl:2 is not a valid attnopt plan report: a JSON array, not an object"),
    (("nope",), "plans.jsonl:1 is not a valid attnopt plan report: Expecting value"),
    (('{"version": 1, "sites": 5}',), "plans.jsonl:1 is not a valid attnopt plan report: sites must be an array, got int 5"),
    (('{"version": 1, "sites": [7]}',), "plans.jsonl:1 is not a valid attnopt plan report: a site report must be an object"),
    (('{"version": 1, "profile": 3}',), "plans.jsonl:1 is not a valid attnopt plan report: profile must be a string"),
    ((GOOD.replace('"est_us": 10.0', '"est_us": "fast"'),), "plans.jsonl:1 is not a valid attnopt plan report"),
    ((json.dumps({"version": 1, "sites": [{"rewritten": True}]}),), "plans.jsonl:1 is not a valid attnopt plan report: "
                                                                     "missing field 'site'"),
    ((GOOD, b"\x89PNG\r\n\x1a\n\xff\xfe"), "plans.jsonl:2 is not text (bytes that are not UTF-8)"),
    (("",), "plans.jsonl holds no plan report"),
])
def test_bad_plan_logs_are_one_line_naming_file_and_line(tmp_path, capsys, lines, message):
    path = _log(tmp_path, *lines)
    assert cli_main(["plans", path]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and message in err, err


def _with(**changes) -> str:
    """GOOD with fields replaced: top-level keys, or ``site_<key>`` in the first site report, or ``attention_<key>`` in its
    AttentionSite."""
    data = json.loads(GOOD)
    for key, value in changes.items():
        if key.startswith("site_"):
            data["sites"][0][key.removeprefix("site_")] = value
        elif key.startswith("attention_"):
            data["sites"][0]["site"][key.removeprefix("attention_")] = value
        else:
            data[key] = value
    return json.dumps(data)


# Wrong types that got past the check and raised a traceback: int() of Infinity (OverflowError), a graph id that is no
# string (TypeError when the graphs' ids are joined), and names that rich cannot draw (NotRenderableError, --all).
@pytest.mark.parametrize("flags", [[], ["--all"]])
@pytest.mark.parametrize("line", [
    _with(calls_without_attnopt=math.inf), _with(graph=-1), _with(graph=True), _with(site_graph=7),
    _with(attention_node=[]), _with(attention_node={}), _with(attention_module_path=3),
])
def test_wrong_field_types_are_one_line_not_a_traceback(tmp_path, capsys, flags, line):
    assert cli_main(["plans", *flags, _log(tmp_path, line)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and "plans.jsonl:1 is not a valid attnopt plan report" in err, err


def test_plans_on_a_directory_or_a_missing_file(tmp_path, capsys):
    assert cli_main(["plans", str(tmp_path)]) == 2
    assert f"{tmp_path} is a directory, not a plan log" in capsys.readouterr().err
    assert cli_main(["plans", str(tmp_path / "none.jsonl")]) == 2
    assert "No such file or directory" in capsys.readouterr().err


def test_a_good_log_still_prints(tmp_path, capsys):
    assert cli_main(["plans", _log(tmp_path, GOOD, GOOD)]) == 0
    assert capsys.readouterr().out.startswith("2 attention site(s) in 1 graph(s): 2 rewritten (2 dense)")


def test_bench_help_describes_the_cases(capsys):
    with pytest.raises(SystemExit):
        cli_main(["bench", "kernels", "--help"])
    out = capsys.readouterr().out
    assert "issue 3" not in out and "Llama-3-8B" in out and "--cases" in out


def test_bench_multigpu_refuses_without_gpus_unless_asked(monkeypatch, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    monkeypatch.setenv("RANK", "0")  # as under torchrun
    assert cli_main(["bench", "multigpu"]) == 2
    err = capsys.readouterr().err
    assert "no CUDA GPU here" in err and "--allow-cpu" in err


def test_closed_pipe_ends_quietly(tmp_path, capsys, monkeypatch):
    """A reader that went away shows as BrokenPipeError at the flush: status 141, stdout pointed at /dev/null so
    that Python's flush at exit does not raise again, nothing on stderr."""
    import sys

    path = _log(tmp_path, GOOD)
    saved = os.dup(1)
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before anything is written
    os.dup2(write_end, 1)
    os.close(write_end)
    try:
        with monkeypatch.context() as m:
            m.setattr(sys, "stdout", open(1, "w", closefd=False))
            assert cli_main(["plans", "--json", path]) == EXIT_BROKEN_PIPE
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    assert capsys.readouterr().err == ""
