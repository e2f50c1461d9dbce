"""Replay of issue 18, the user's path: every bad input gets a clear one-line error at the right time, and every
route that should work does.

Each case is one finding of the issue, replayed as the user met it. An ``error`` case must raise at the named
moment with a one-line message holding the named text; a ``works`` case returns what it checked. Run as a
script to print one line per case (``python tests/attnopt/test_user_path.py``); under pytest each case is a test.
The distributed findings (``ATTNOPT_DIST_TIMEOUT_S``, tree_decode's cross-rank shape check) are replayed with the
distributed package's tests.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F

import attnopt
from attnopt import OptimizeConfig
from attnopt.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------------------------- models
class Root(torch.nn.Module):
    """Attention in the module's own forward, and a ``generate`` that calls the module like HF's."""

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    def generate(self, q, k, v):
        return self(q, k, v)


class Nested(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = Root()

    def forward(self, q, k, v):
        return self.attn(q, k, v)


def inputs(d=64, n=37):
    return torch.randn(1, 4, 1, d), torch.randn(1, 2, n, d), torch.randn(1, 2, n, d)


def fresh() -> None:
    torch._dynamo.reset()


# --------------------------------------------------------------------------------------------- cases
CASES: list[tuple[str, str, Callable[[Any], Any], str]] = []  # (name, kind, fn, expected text)


def error(name: str, match: str):
    """A case that must raise ``ValueError``/``TypeError`` with a one-line message matching ``match``."""

    def deco(fn):
        CASES.append((name, "error", fn, match))
        return fn

    return deco


def works(name: str):
    """A case that must run; it asserts what it checks and returns a short description."""

    def deco(fn):
        CASES.append((name, "works", fn, ""))
        return fn

    return deco


def optimize_only(**options):
    """``optimize()`` alone: the options must be rejected here, before any compile or call."""
    return lambda tmp: attnopt.optimize(Root(), inner_backend="eager", **options)


# validation: at optimize(), never at the first call
for _name, _opts, _match in [
    ("force_plan unknown", {"force_plan": "splitkv"}, "unknown force_plan 'splitkv'; valid: .*dense"),
    ("force_plan saap without an index", {"force_plan": "saap"}, "plan kind 'saap' needs an index: pass saap="),
    ("strategies unknown", {"strategies": ["split_kv", "bogus"]}, "strategies: unknown 'bogus'; valid: .*dense"),
    ("hardware unknown", {"hardware": "h900"}, "unknown hardware 'h900'; valid: a100-80gb"),
    ("hardware=123", {"hardware": 123}, "hardware must be a str, got int 123"),
    ("min_kv_len negative", {"min_kv_len": -5}, "min_kv_len must be >= 0, got -5"),
    ("verify_atol a string", {"verify_atol": "tight"}, "verify_atol must be a number >= 0"),
    ("plan_log a directory", {"plan_log": "."}, "plan_log='.' is a directory"),
    ("max_decode_q_len='16'", {"max_decode_q_len": "16"}, "max_decode_q_len must be an int in 1..16, got str '16'"),
    ("dynamic='yes'", {"dynamic": "yes"}, "dynamic must be True or False, got str 'yes'"),
    ("verify='no'", {"verify": "no"}, "verify must be True or False, got str 'no'"),
    ("mode='bogus'", {"mode": "bogus"}, "mode='bogus' is not valid; valid choices: None, default, reduce-overhead"),
    ("topology without a process group", {"topology": "dgx-h100x2"}, "only used to plan over a process group"),
    ("negative sliding window", {"sliding_windows": {"attn": -8}}, "the window of 'attn' must be an int > 0, got -8"),
]:
    error(_name, _match)(optimize_only(**_opts))


@error("plan_log under a file", "cannot be created: .* is a file, not a directory")
def _plan_log_under_a_file(tmp):
    (tmp / "f").write_text("")
    attnopt.optimize(Root(), plan_log=str(tmp / "f" / "plans.jsonl"))


@works("strings are names, never characters")
def _strings_are_names(tmp):
    cfg = OptimizeConfig(strategies="split_kv", skip_sites="attn")
    assert cfg.strategies == ("split_kv",) and cfg.skip_sites == ("attn",)
    fresh()
    opt = attnopt.optimize(Nested(), inner_backend="eager", skip_sites="attn")
    opt(*inputs())
    [site] = attnopt.last_plans(opt).sites
    assert not site.rewritten, "skip_sites='attn' skipped nothing"
    return "strategies='split_kv' -> ('split_kv',); skip_sites='attn' leaves the site alone"


@works("force_plan that cannot apply says so truthfully")
def _forced_plan_reason(tmp):
    fresh()
    opt = attnopt.optimize(Root(), inner_backend="eager", force_plan="split_kv")
    opt(*inputs(d=72))
    [site] = attnopt.last_plans(opt).sites
    assert not site.rewritten and "falls back to dense" not in site.reason_untouched
    assert site.reason_untouched.endswith("the site is left as the original attention")
    return site.reason_untouched


# the string backend
@works("last_plans(torch.compile(..., backend='attnopt'))")
def _last_plans_string_backend(tmp):
    fresh()
    compiled = torch.compile(Root(), backend="attnopt", options={"inner_backend": "eager", "min_kv_len": 2})
    compiled(*inputs())
    fn = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), backend="attnopt",
                       options={"inner_backend": "eager", "min_kv_len": 3})
    fn(*inputs())
    assert len(attnopt.last_plans(compiled).rewritten) == 1 and len(attnopt.last_plans(fn).rewritten) == 1
    return "a compiled module and a compiled function each report their site"


@error("last_plans of the original model", "this Root was not compiled by attnopt: pass what attnopt.optimize")
def _last_plans_of_the_original(tmp):
    model = Root()
    torch.compile(model, backend="attnopt")
    attnopt.last_plans(model)


@works("compiled.generate warns that it runs the uncompiled forward")
def _generate_warns(tmp):
    fresh()
    compiled = torch.compile(Root(), backend="attnopt", options={"inner_backend": "eager", "min_kv_len": 4})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled.generate(*inputs())
    [w] = [w for w in caught if "attnopt" in str(w.message)]
    assert "runs the uncompiled forward" in str(w.message) and "attnopt.optimize(model)" in str(w.message)
    return str(w.message)


@works("last_plans() in a fresh process")
def _last_plans_fresh(tmp):
    out = subprocess.run([sys.executable, "-c", "import attnopt; print(attnopt.last_plans().headline())"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.startswith("no graph compiled by attnopt yet"), out
    return out.stdout.strip()


# files
@works("corrupt cached profile")
def _corrupt_profile(tmp):
    from attnopt import hardware as H

    device = "NVIDIA H100 80GB HBM3"
    old = os.environ.get(H.CACHE_ENV)
    os.environ[H.CACHE_ENV] = str(tmp)
    try:
        path = H.cached_profile_path(device)
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = []
        for change in ({"occupancy": [1, 2]}, {"fitted": None}, {"sm_count": 1.5}, {"hbm_read_gbps": float("inf")}):
            path.write_text(json.dumps({**H.profile_for_device_name(device).to_dict(), **change}))
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                assert H.load_cached_profile(device) is None
            [w] = caught
            assert str(path) in str(w.message) and "\n" not in str(w.message)
            lines.append(str(w.message).split(": ", 1)[1].split(";")[0])
    finally:
        if old is None:
            os.environ.pop(H.CACHE_ENV)
        else:
            os.environ[H.CACHE_ENV] = old
    return "one warning each, built-in used: " + " | ".join(lines)


def _plans_error(tmp, content: bytes | None) -> str:
    path = tmp / "log.jsonl"
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = cli_main(["plans", str(path)])
    text = err.getvalue()
    assert rc == 2 and text.count("\n") == 1 and "Traceback" not in text, (rc, text)
    raise ValueError(text.strip())


for _name, _content, _match in [
    ("attnopt plans on a directory", None, "is a directory, not a plan log"),
    ("attnopt plans on a non-object line", b'{"version": 1}\n[1, 2]\n', r"log.jsonl:2 is not a valid .*: a JSON array"),
    ("attnopt plans on wrong field types", b'{"version": 1, "sites": 5}\n', r"log.jsonl:1 .*sites must be an array"),
    ("attnopt plans on a binary file", b"\x7fELF\x02\x01\x01\x00\xff\xfe\n", r"log.jsonl:1 is not text"),
]:
    error(_name, _match)(lambda tmp, c=_content: _plans_error(tmp, c))


# CLI
@works("attnopt plans --json log | head, through python -m attnopt")
def _broken_pipe(tmp):
    from attnopt.plan import DensePlan
    from attnopt.report import PlanReport, SiteReport
    from attnopt.site import AttentionSite

    sites = [SiteReport(site=AttentionSite.canonical(node=f"n{i}"), chosen=DensePlan(), rewritten=True)
             for i in range(600)]
    (tmp / "big.jsonl").write_text(PlanReport(sites=sites, profile="cpu", graph="g0").to_json() + "\n")
    out = subprocess.run(f"{sys.executable} -m attnopt plans --json {tmp / 'big.jsonl'} | head -1", shell=True,
                         capture_output=True, text=True, timeout=300)
    assert out.stdout == "{\n" and out.stderr == "", out
    return "one line printed, nothing on stderr"


@works("bench multigpu without GPUs")
def _multigpu_refuses(tmp):
    if torch.cuda.is_available():
        return "a GPU is present: nothing to refuse"
    from types import SimpleNamespace

    from attnopt.bench.multigpu import run_cli

    os.environ["RANK"] = "0"  # as under torchrun
    try:
        run_cli(SimpleNamespace(allow_cpu=False))
    except ValueError as exc:
        assert "no CUDA GPU here" in str(exc) and "--allow-cpu" in str(exc)
        return f"refused: {exc}"
    finally:
        del os.environ["RANK"]
    raise AssertionError("bench multigpu started on a machine without GPUs")


@works("bench kernels --help")
def _bench_help(tmp):
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        cli_main(["bench", "kernels", "--help"])
    assert "issue 3" not in out.getvalue() and "--cases" in out.getvalue()
    return "describes its cases"


@works("verify=True reports success")
def _verify_success(tmp):
    fresh()
    opt = attnopt.optimize(Root(), inner_backend="eager", verify=True, verify_calls=2)
    for _ in range(2):
        opt(*inputs())
    report = attnopt.last_plans(opt)
    assert report.rewritten[0].verified == 2 and "2 verified" in report.format_table()
    return report.headline().split("; ")[-1]


@works("a site in a root-level module has a name")
def _root_module_name(tmp):
    fresh()
    opt = attnopt.optimize(Root(), inner_backend="eager")
    opt(*inputs())
    table = attnopt.last_plans(opt).format_table()
    row = next(line for line in table.splitlines() if "dense" in line and "│" in line)
    module = row.split("│")[3].strip()
    assert module == "(top level)", row
    return f"module column: {module}"


# README and tests
@works("README lists every option")
def _readme_options(tmp):
    text = (ROOT / "README.md").read_text()
    missing = [f for f in OptimizeConfig.field_names() if f"`{f}`" not in text]
    assert not missing, f"README does not list {missing}"
    assert "download.pytorch.org/whl/cpu" in text and "pytest -m \"not slow\"" in text
    return f"{len(OptimizeConfig.field_names())} options; CPU index; quick subset"


@works("the slow marker selects tests")
def _slow_marker(tmp):
    marked = [p.relative_to(ROOT) for p in (ROOT / "tests").rglob("test_*.py")
              if re.search(r"pytest\.mark\.slow", p.read_text())]
    assert marked, "no test is marked slow"
    return f"{len(marked)} files hold slow tests"


# --------------------------------------------------------------------------------------------- running
def replay(name: str, kind: str, fn: Callable[[Any], Any], match: str, tmp: Path) -> str:
    """Run one case; return its one-line outcome, or raise AssertionError saying what went wrong."""
    if kind == "works":
        return f"works: {fn(tmp)}"
    try:
        fn(tmp)
    except (ValueError, TypeError) as exc:
        text = str(exc)
        assert "\n" not in text.strip(), f"{name}: the message is not one line: {text!r}"
        assert re.search(match, text), f"{name}: {text!r} does not match {match!r}"
        return f"{type(exc).__name__}: {text}"
    raise AssertionError(f"{name}: no error (expected one matching {match!r})")


@pytest.mark.parametrize("name,kind,fn,match", CASES, ids=[c[0] for c in CASES])
def test_user_path(name, kind, fn, match, tmp_path):
    replay(name, kind, fn, match, tmp_path)


def main() -> int:
    import tempfile

    failed = 0
    for i, (name, kind, fn, match) in enumerate(CASES):
        with tempfile.TemporaryDirectory() as tmp:
            try:
                line = replay(name, kind, fn, match, Path(tmp))
                print(f"ok    {name}: {line}")
            except Exception as exc:  # noqa: BLE001 - the replay reports every case
                failed += 1
                print(f"FAIL  {name}: {type(exc).__name__}: {' '.join(str(exc).split())}")
    print(f"{len(CASES) - failed} of {len(CASES)} cases as expected")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
