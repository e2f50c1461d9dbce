"""The backend and the public API: inner backends, optimize() on modules and functions, verify mode,
the plan log and ``attnopt plans``, last_plans()."""
import json

import pytest
import torch
import torch.nn.functional as F

import attnopt
from attnopt import OptimizeConfig
from attnopt.cli import main as cli_main
from attnopt.plan import DensePlan, register_plan_kind
from attnopt.runtime import ops
from attnopt.runtime.strategies import STRATEGIES
from attnopt.runtime.strategies.dense import Dense


class TinyDecoder(torch.nn.Module):
    """One attention layer over an explicit KV cache: q_len new tokens against N cached ones."""

    def __init__(self, hq=6, hkv=2, d=64):
        super().__init__()
        self.hq, self.hkv, self.d = hq, hkv, d
        self.proj = torch.nn.Linear(d, d)

    def forward(self, q, k_cache, v_cache):
        out = F.scaled_dot_product_attention(q, k_cache, v_cache, enable_gqa=True)
        return self.proj(out)


def _inputs(N=37, L=1):
    return torch.randn(2, 6, L, 64), torch.randn(2, 2, N, 64), torch.randn(2, 2, N, 64)


@pytest.mark.parametrize("inner", ["eager", "aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_optimize_module_each_inner_backend(inner):
    torch._dynamo.reset()
    model = TinyDecoder().eval()
    opt = attnopt.optimize(model, inner_backend=inner)
    args = _inputs()
    with torch.no_grad():
        torch.testing.assert_close(opt(*args), model(*args), atol=1e-5, rtol=1e-5)
    report = attnopt.last_plans(opt)
    assert len(report.rewritten) == 1
    assert report.rewritten[0].calls == 1
    assert opt is not model and opt.proj is model.proj  # a shallow copy sharing the weights
    assert model.forward.__func__ is TinyDecoder.forward  # the user's model is left as it was


def test_torch_compile_string_backend_with_options(tmp_path):
    torch._dynamo.reset()
    log = tmp_path / "plans.jsonl"
    model = TinyDecoder().eval()
    compiled = torch.compile(model, backend="attnopt", options={"inner_backend": "eager", "plan_log": str(log)})
    args = _inputs()
    with torch.no_grad():
        torch.testing.assert_close(compiled(*args), model(*args), atol=1e-5, rtol=1e-5)
    lines = log.read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["sites"][0]["rewritten"] is True


def test_unknown_option_through_torch_compile_is_an_error():
    torch._dynamo.reset()
    compiled = torch.compile(TinyDecoder(), backend="attnopt", options={"inner_backed": "eager"})
    with pytest.raises(Exception, match="valid options"):
        compiled(*_inputs())


def test_optimize_plain_function_and_last_plans_without_argument():
    torch._dynamo.reset()

    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True) * 2

    fn = attnopt.optimize(attend, inner_backend="eager")
    args = _inputs(N=5)
    torch.testing.assert_close(fn(*args), attend(*args), atol=1e-5, rtol=1e-5)
    assert attnopt.last_plans().rewritten[0].site.kv_len == 5
    assert attnopt.last_plans(fn).rewritten[0].calls == 1


def test_last_plans_of_foreign_object_is_a_clear_error():
    with pytest.raises(ValueError, match="Linear was not compiled by attnopt: pass what attnopt.optimize"):
        attnopt.last_plans(torch.nn.Linear(2, 2))


def test_prefill_is_left_alone_and_reported():
    torch._dynamo.reset()
    opt = attnopt.optimize(TinyDecoder().eval(), inner_backend="eager")
    q, k, v = _inputs(N=4, L=4)
    opt(q, k, v)
    report = attnopt.last_plans(opt)
    assert not report.rewritten and "prefill" in report.sites[0].reason_untouched


# ---------------------------------------------------------------------------------------- verify mode
@register_plan_kind
class _BrokenPlan(DensePlan):
    kind = "test_broken"


class _Broken(Dense):
    """A deliberately wrong strategy: verify mode must catch it and name the site."""

    def candidates(self, site, hw, ctx):
        yield _BrokenPlan(reason="adds 0.01")

    def run(self, state, plan, q, k, v, attn_mask, valid_len, scale, is_causal):
        return super().run(state, plan, q, k, v, attn_mask, valid_len, scale, is_causal) + 0.01


@pytest.fixture
def broken_strategy():
    STRATEGIES["test_broken"] = _Broken()
    _Broken.plan_type = _BrokenPlan
    yield
    del STRATEGIES["test_broken"]


def test_verify_catches_a_wrong_plan(broken_strategy):
    torch._dynamo.reset()
    opt = attnopt.optimize(TinyDecoder().eval(), inner_backend="eager", force_plan="test_broken", verify=True)
    with pytest.raises(ops.VerificationError, match=r"site g\d+:\w+ differs .* max abs error 1\.0\d*e-02 > tolerance"):
        with torch.no_grad():
            opt(*_inputs())


def test_verify_passes_on_exact_plans():
    torch._dynamo.reset()
    model = TinyDecoder().eval()
    opt = attnopt.optimize(model, OptimizeConfig(inner_backend="eager", verify=True, verify_calls=3))
    with torch.no_grad():
        for _ in range(4):
            args = _inputs()
            torch.testing.assert_close(opt(*args), model(*args), atol=1e-5, rtol=1e-5)
    key = attnopt.last_plans(opt).rewritten[0].key
    assert ops.CALL_COUNTS["verify:" + key] == 4


# ---------------------------------------------------------------------------------------- attnopt plans
def test_plans_cli_prints_the_table(tmp_path, capsys, monkeypatch):
    torch._dynamo.reset()
    log = tmp_path / "p.jsonl"
    monkeypatch.setenv("ATTNOPT_PLAN_LOG", str(log))
    opt = attnopt.optimize(TinyDecoder().eval(), inner_backend="eager")
    opt(*_inputs())
    opt(*_inputs(N=4, L=4))  # a prefill graph too: one line per graph
    assert len(log.read_text().splitlines()) == 2
    assert cli_main(["plans", str(log)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == ("2 attention site(s) in 2 graph(s): 1 rewritten (1 dense), 1 left alone "
                                   "(1 prefill); profile cpu")
    assert "dense" in out and "why: prefill: symbolic q_len" in out
    # Both sites show their shapes; the recompiled prefill graph has a symbolic q_len and KV length (hint 4).
    assert "B=2 H=6/2 q=1 N=37 D=64" in out and "B=2 H=6/2 q=? N~4 D=64" in out
    assert max(len(line) for line in out.splitlines()) <= 160  # not a terminal, no $COLUMNS: 160 wide
    assert cli_main(["plans"]) == 0  # from the environment variable
    capsys.readouterr()
    assert cli_main(["plans", "--json", str(log)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [s["rewritten"] for s in data["sites"]] == [True, False]
    graphs = [s["graph"] for s in data["sites"]]
    assert graphs[0] == data["sites"][0]["key"].split(":")[0] and graphs[1] and graphs[1] != graphs[0]


def _two_layer_log(tmp_path):
    """A plan log of two graphs (decode, then prefill) of a two-layer decoder: 4 sites, 2 groups."""
    class TwoLayers(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([TinyDecoder(), TinyDecoder()])

        def forward(self, q, k, v):
            return self.layers[1](self.layers[0](q, k, v), k, v)

    torch._dynamo.reset()
    log = tmp_path / "two.jsonl"
    opt = attnopt.optimize(TwoLayers().eval(), inner_backend="eager", plan_log=str(log))
    with torch.no_grad():
        opt(*_inputs())
        opt(*_inputs(N=4, L=4))
    return log


def test_plans_cli_groups_like_sites_and_all_lists_every_site(tmp_path, capsys):
    log = _two_layer_log(tmp_path)
    assert cli_main(["plans", str(log)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("4 attention site(s) in 2 graph(s): 2 rewritten (2 dense), 2 left alone")
    assert out.count("│ layers.{0,1} ") == 2, out  # one row per graph: 2 layers each
    assert "out_1" not in out  # grouped rows name no node
    assert cli_main(["plans", "--all", str(log)]) == 0
    full = capsys.readouterr().out
    assert "layers.{0,1}" not in full and full.count("out_1") == 2
    assert full.count("layers.0") == 2 and full.count("layers.1") == 2, full  # one row per site, in each graph
    assert cli_main(["plans", "--width", "70", str(log)]) == 0
    narrow = capsys.readouterr().out
    assert max(len(line) for line in narrow.splitlines()) <= 70, narrow
    assert cli_main(["plans", "--width", "10", str(log)]) == 2
    assert "too narrow" in capsys.readouterr().err


def test_plans_cli_corrupt_log_is_a_clear_error(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    assert cli_main(["plans", str(bad)]) == 2
    assert "is not a valid attnopt plan report" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------- the string backend
class _Root(torch.nn.Module):
    """Attention in the compiled module's own forward (no submodule), with a ``generate`` like HF's."""

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    def generate(self, q, k, v):
        return self(q, k, v)


def test_last_plans_of_a_string_backend_module_and_function():
    torch._dynamo.reset()
    compiled = torch.compile(_Root(), backend="attnopt", options={"inner_backend": "eager", "min_kv_len": 3})
    assert attnopt.last_plans(compiled).headline().startswith("no graph compiled by attnopt yet")
    compiled(*_inputs())
    report = attnopt.last_plans(compiled)
    assert len(report.rewritten) == 1 and report.rewritten[0].calls == 1 and report.profile == "cpu"
    assert "(top level)" in report.format_table()  # a site in the root module has a name, not "?"

    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True) + 1

    fn = torch.compile(attend, backend="attnopt", options={"inner_backend": "eager", "min_kv_len": 3})
    fn(*_inputs(N=9))
    # equal options, separate wrappers: each reports its own graphs
    assert [s.site.kv_len for s in attnopt.last_plans(fn).rewritten] == [9]
    assert [s.site.kv_len for s in attnopt.last_plans(compiled).rewritten] == [37]
    with pytest.raises(ValueError, match="compiled with backend 'eager', not attnopt"):
        attnopt.last_plans(torch.compile(_Root(), backend="eager"))


def test_generate_of_a_string_backend_wrapper_warns_once_that_it_runs_uncompiled():
    torch._dynamo.reset()
    compiled = torch.compile(_Root(), backend="attnopt", options={"inner_backend": "eager", "min_kv_len": 5})
    with pytest.warns(UserWarning, match=r"_Root.generate through torch.compile\(model, backend=\"attnopt\"\) runs the "
                                         r"uncompiled forward.*attnopt.optimize\(model\)"):
        compiled.generate(*_inputs())
    assert attnopt.last_plans(compiled).sites == []  # generate really ran no attnopt graph
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compiled.generate(*_inputs())  # once per wrapper
        opt = attnopt.optimize(_Root(), inner_backend="eager")
        opt.generate(*_inputs())  # optimize() reaches generate, and says nothing
    assert len(attnopt.last_plans(opt).rewritten) == 1


@pytest.mark.parametrize("options,error,match", [
    ({"mode": "bogus"}, ValueError, "mode='bogus' is not valid; valid choices: None, default"),
    ({"topology": "dgx-h100x2"}, ValueError, "topology='dgx-h100x2' is only used to plan over a process group"),
    ({"force_plan": "splitkv"}, ValueError, "unknown force_plan 'splitkv'; valid: .*dense"),
    ({"hardware": 123}, TypeError, "hardware must be a str"),
    ({"plan_log": "."}, ValueError, "plan_log='.' is a directory"),
])
def test_optimize_rejects_bad_options_before_compiling(options, error, match):
    with pytest.raises(error, match=match):
        attnopt.optimize(TinyDecoder(), inner_backend="eager", **options)


def test_forced_plan_that_cannot_apply_says_the_site_is_left_as_it_was():
    torch._dynamo.reset()
    model = _Root()
    opt = attnopt.optimize(model, inner_backend="eager", force_plan="split_kv")
    q, k, v = torch.randn(2, 6, 1, 72), torch.randn(2, 2, 37, 72), torch.randn(2, 2, 37, 72)
    torch.testing.assert_close(opt(q, k, v), model(q, k, v))
    [site] = attnopt.last_plans(opt).sites
    assert not site.rewritten and site.chosen is None
    assert site.reason_untouched == ("force_plan='split_kv' does not apply: head_dim 72 not supported by the kernels "
                                     "(64, 80, 96, 128, 256); the site is left as the original attention")
    assert "falls back to dense" not in attnopt.last_plans(opt).format_table()


def test_verify_reports_the_calls_it_checked():
    torch._dynamo.reset()
    opt = attnopt.optimize(TinyDecoder().eval(), inner_backend="eager", verify=True, verify_calls=2)
    with torch.no_grad():
        for _ in range(3):
            opt(*_inputs())
    report = attnopt.last_plans(opt)
    assert report.rewritten[0].verified == 2 and report.rewritten[0].calls == 3
    assert report.headline().endswith("verify passed: 2 call(s) of 1 site(s) matched the original attention")
    assert "2 verified" in report.format_table()
