"""A bug inside attnopt's passes (injected here: a planner or lowering function that raises) leaves its site, or its
graph, as the original attention: the model still gives the original's answer, one ``PassErrorWarning`` names the
site and the exception, and the plan report says why. ``on_error="raise"`` and ``ATTNOPT_STRICT=1`` raise instead;
errors that are the user's (a SAAP index that does not fit) raise in every mode."""
from __future__ import annotations

import importlib
import warnings

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

import attnopt
from attnopt.config import OptimizeConfig
from attnopt.report import PassErrorWarning

# (the package ``attnopt.passes`` names its pass functions like their modules)
detect_pass, plan_pass, lower_pass = (importlib.import_module(f"attnopt.passes.{n}") for n in ("detect", "plan", "lower"))


class TwoLayers(torch.nn.Module):
    """Two decode attentions: (1, 4, 1, 64) queries against (1, 2, N, 64) keys, the second over the first's output."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(64, 64)

    def forward(self, q, k, v):
        a = F.scaled_dot_product_attention(self.proj(q), k, v, enable_gqa=True)
        return F.scaled_dot_product_attention(self.proj(a), k * 0.5, v, enable_gqa=True)


def _qkv(n=40):
    return torch.randn(1, 4, 1, 64), torch.randn(1, 2, n, 64), torch.randn(1, 2, n, 64)


class Injected(RuntimeError):
    pass


def _entry(name, model, **options):
    if name == "optimize":
        return attnopt.optimize(model, inner_backend="eager", **options)
    torch._dynamo.reset()
    return torch.compile(model, backend="attnopt", options={"inner_backend": "eager", **options})


def _first_call_raises(monkeypatch, module, name, before=None):
    """Make ``module.name`` raise ``Injected`` at its first call (after ``before(*args)``); later calls run it."""
    real, calls = getattr(module, name), []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            if before is not None:
                before(*args, **kwargs)
            raise Injected(f"injected into {name}")
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, failing)
    return calls


def _add_junk(gm, ctx, m, *rest):
    """A half-done lowering: a node inserted before the site's output, then the exception."""
    with gm.graph.inserting_before(m.output):
        gm.graph.call_function(torch.ops.aten.clone.default, (m.q,))


@torch.no_grad()
def test_every_site_that_raises_is_left_alone_with_one_warning(fallback_mode, monkeypatch):
    def failing(*args, **kwargs):
        raise Injected("injected into plan_site")

    monkeypatch.setattr(plan_pass, "plan_site", failing)
    report, caught = _whole_graph_left_alone("optimize")
    assert all(s.reason_untouched.startswith("attnopt error in plan: Injected") for s in report.sites)
    assert report.errors == [] and len(caught) == 1 and "2 site(s) of graph" in str(caught[0].message)


def _whole_graph_left_alone(entry):
    """Compile and call ``TwoLayers`` through ``entry``: the original's exact answer, no site rewritten; returns the
    report and the ``PassErrorWarning``s."""
    model, args = TwoLayers(), _qkv()
    opt = _entry(entry, model)
    out, caught = _run_with_warning(opt, args)
    assert torch.equal(out, model(*args))
    report = attnopt.last_plans(opt)
    assert len(report.sites) == 2 and not report.rewritten
    return report, caught


@pytest.fixture
def fallback_mode(monkeypatch):
    monkeypatch.delenv("ATTNOPT_STRICT", raising=False)


def _run_with_warning(opt, args):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = opt(*args)
    return out, [w for w in caught if issubclass(w.category, PassErrorWarning)]


@pytest.mark.parametrize("entry", ["optimize", "torch.compile"])
@pytest.mark.parametrize("where", ["detect", "plan", "lower"])
@torch.no_grad()
def test_one_site_that_raises_is_left_alone_and_the_other_rewritten(entry, where, fallback_mode, monkeypatch):
    module, name, before = {"detect": (detect_pass, "build_site", None), "plan": (plan_pass, "plan_site", None),
                            "lower": (lower_pass, "lower_site", _add_junk)}[where]
    calls = _first_call_raises(monkeypatch, module, name, before)
    model, args = TwoLayers(), _qkv()
    opt = _entry(entry, model)
    out, caught = _run_with_warning(opt, args)
    torch.testing.assert_close(out, model(*args), atol=1e-5, rtol=1e-5)
    assert len(calls) >= 2
    report = attnopt.last_plans(opt)
    assert len(report.sites) == 2 and len(report.rewritten) == 1, report.format_table()
    (alone,) = report.untouched
    assert alone.reason_untouched.startswith(f"attnopt error in {where}: Injected: injected into {name}")
    assert f"attnopt error in {where}" in report.format_table(width=400)
    assert len(caught) == 1
    assert f"1 site(s) of graph {alone.graph}: {alone.site.node} (top level)" in str(caught[0].message)
    assert f"{where} raised Injected: injected into {name}" in str(caught[0].message)
    assert report.rewritten[0].calls == 1
    if where == "lower":  # the half-done lowering was erased: the left-alone site reads q/k/v as before
        gm_clones = [n for n in _graph_nodes() if n.target is torch.ops.aten.clone.default]
        assert gm_clones == []


_GRAPHS: list[fx.GraphModule] = []


def _graph_nodes():
    """Every node of the graphs handed to the inner backend in this test."""
    return [n for gm in _GRAPHS for n in gm.graph.nodes]


@pytest.fixture(autouse=True)
def _record_graphs(monkeypatch):
    import attnopt.backend as backend_module

    _GRAPHS.clear()
    inner = backend_module._compile_inner

    def recording(name, gm, example_inputs, mode):
        _GRAPHS.append(gm)
        return inner(name, gm, example_inputs, mode)

    monkeypatch.setattr(backend_module, "_compile_inner", recording)


@pytest.mark.parametrize("entry", ["optimize", "torch.compile"])
@torch.no_grad()
def test_a_lowering_that_raised_after_changing_the_graph_restores_the_whole_graph(entry, fallback_mode, monkeypatch):
    """The site's original output was already replaced and erased: no undo of one site, so the graph before
    ``lower`` runs, exactly the original's answer."""
    real = lower_pass.lower_site

    def done_then_raise(*args, **kwargs):
        real(*args, **kwargs)
        raise Injected("after the rewrite")

    monkeypatch.setattr(lower_pass, "lower_site", done_then_raise)
    report, caught = _whole_graph_left_alone(entry)
    assert all("attnopt error in lower: Injected: after the rewrite" in s.reason_untouched for s in report.sites)
    assert len(report.errors) == 1 and "lower raised Injected" in report.errors[0]
    assert "graph left as the original" in report.headline()
    assert len(caught) == 1 and "graph " in str(caught[0].message)
    assert not any(str(n.target).startswith("attnopt.") for n in _graph_nodes())
    assert attnopt.PlanReport.from_json(report.to_json()).errors == report.errors


@torch.no_grad()
def test_detection_that_raises_before_any_site_leaves_the_graph(fallback_mode, monkeypatch):
    monkeypatch.setattr(detect_pass, "find_matches", lambda gm: (_ for _ in ()).throw(Injected("no matcher")))
    model, args = TwoLayers(), _qkv()
    opt = _entry("optimize", model)
    out, caught = _run_with_warning(opt, args)
    assert torch.equal(out, model(*args))
    report = attnopt.last_plans(opt)
    assert report.sites == [] and "detect raised Injected: no matcher" in report.errors[0]
    assert len(caught) == 1


@pytest.mark.parametrize("entry", ["optimize", "torch.compile"])
@pytest.mark.parametrize("how", ["on_error", "env"])
@torch.no_grad()
def test_strict_mode_raises(entry, how, monkeypatch):
    _first_call_raises(monkeypatch, plan_pass, "plan_site")
    if how == "on_error":
        monkeypatch.delenv("ATTNOPT_STRICT", raising=False)
        opt = _entry(entry, TwoLayers(), on_error="raise")
    else:
        monkeypatch.setenv("ATTNOPT_STRICT", "1")
        opt = _entry(entry, TwoLayers())
    with pytest.raises(Exception, match="injected into plan_site"):
        opt(*_qkv())


@torch.no_grad()
def test_a_users_error_raises_even_in_fallback_mode(fallback_mode, monkeypatch):
    from attnopt.runtime.saap.index import SaapIndexError

    def bad_index(*args, **kwargs):
        raise SaapIndexError("the index is for 8 query heads")

    monkeypatch.setattr(plan_pass, "plan_site", bad_index)
    opt = _entry("optimize", TwoLayers())
    with pytest.raises(Exception, match="the index is for 8 query heads"):
        opt(*_qkv())


def test_on_error_is_a_checked_config_field(monkeypatch):
    assert OptimizeConfig().on_error == "fallback"
    config = OptimizeConfig(on_error="raise")
    assert OptimizeConfig.from_json(config.to_json()) == config
    with pytest.raises(ValueError, match="on_error='ignore' is not valid; valid choices: fallback, raise"):
        OptimizeConfig(on_error="ignore")
    with pytest.raises(ValueError, match="on_error"):
        attnopt.optimize(TwoLayers(), on_error="skip")
    monkeypatch.setenv("ATTNOPT_STRICT", "yes")
    with pytest.raises(ValueError, match=r"\$ATTNOPT_STRICT='yes': valid values are 1"):
        OptimizeConfig().strict()
    with pytest.raises(ValueError, match=r"\$ATTNOPT_STRICT='yes'"):
        attnopt.optimize(TwoLayers())  # at once, not at the first call's compile
    monkeypatch.setenv("ATTNOPT_STRICT", "0")
    assert not OptimizeConfig().strict() and OptimizeConfig(on_error="raise").strict()


@pytest.mark.parametrize("entry", ["optimize", "torch.compile"])
@torch.no_grad()
def test_an_inner_compile_that_fails_on_the_rewrite_compiles_the_original(entry, fallback_mode, monkeypatch):
    import attnopt.backend as backend_module

    inner = backend_module._compile_inner

    def refusing_attnopt_ops(name, gm, example_inputs, mode):
        if any(str(n.target).startswith("attnopt.") for n in gm.graph.nodes):
            raise Injected("the inner backend cannot compile attnopt.decode_attention")
        return inner(name, gm, example_inputs, mode)

    monkeypatch.setattr(backend_module, "_compile_inner", refusing_attnopt_ops)
    report, caught = _whole_graph_left_alone(entry)
    assert "the eager compile of the rewritten graph raised Injected" in report.errors[0]
    assert len(caught) == 1
    monkeypatch.setenv("ATTNOPT_STRICT", "1")
    with pytest.raises(Exception, match="cannot compile attnopt.decode_attention"):
        _entry(entry, TwoLayers())(*_qkv())


def test_with_a_process_group_a_site_left_alone_by_an_error_still_raises():
    """Over a sequence-sharded cache the original attends to this rank's shard alone: the fallback must not make
    that silent. The backend's check names the site and the pass's exception."""
    from attnopt.backend import check_no_decode_left_over_shards
    from attnopt.passes.guard import site_reason
    from attnopt.report import PlanReport, SiteReport
    from attnopt.runtime.distributed import DistributedDecodeError
    from attnopt.site import AttentionSite

    site = AttentionSite(node="sdpa", module_path="layers.0", pattern="sdpa", batch=1, q_heads=4, kv_heads=2,
                         head_dim=64, q_len=1, kv_len=None, dtype="float32",
                         unsupported=site_reason("plan", Injected("injected into plan_site")))
    with pytest.raises(DistributedDecodeError, match="sdpa .layers.0.: attnopt error in plan: Injected"):
        check_no_decode_left_over_shards(PlanReport(sites=[SiteReport(site)]))


class TwoLayersOneMask(torch.nn.Module):
    """``TwoLayers`` with one boolean padding mask (1, 1, 1, N) read by both attentions."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(64, 64)

    def forward(self, q, k, v, mask):
        a = F.scaled_dot_product_attention(self.proj(q), k, v, attn_mask=mask, enable_gqa=True)
        return F.scaled_dot_product_attention(self.proj(a), k * 0.5, v, attn_mask=mask, enable_gqa=True)


@torch.no_grad()
def test_an_undone_site_takes_its_shared_valid_length_with_it(fallback_mode, monkeypatch):
    """The first site's lowering made the valid length that both sites share, then raised: the undo erases it and
    forgets it, so the second site makes its own (else it would read an erased node and the graph would fail)."""
    real_ops, calls = lower_pass._ops, []

    class Refusing:
        def __getattr__(self, name):
            raise Injected(f"no op {name}")

    def ops_once():
        calls.append(1)
        return Refusing() if len(calls) == 1 else real_ops()

    monkeypatch.setattr(lower_pass, "_ops", ops_once)
    model = TwoLayersOneMask()
    q, k, v = _qkv()
    mask = torch.ones(1, 1, 1, k.shape[2], dtype=torch.bool)
    mask[..., 31:] = False
    opt = _entry("optimize", model, force_plan="stream_k")
    out, caught = _run_with_warning(opt, (q, k, v, mask))
    torch.testing.assert_close(out, model(q, k, v, mask), atol=1e-5, rtol=1e-5)
    report = attnopt.last_plans(opt)
    assert [s.rewritten for s in report.sites] == [False, True] and report.errors == []
    assert "attnopt error in lower: Injected: no op decode_attention" in report.sites[0].reason_untouched
    valid_lens = [n for n in _graph_nodes() if "valid_len_from_mask" in str(n.target)]
    assert len(valid_lens) == 1 and len(caught) == 1
