"""``attnopt.export_onnx``: the rewritten graph as ONNX, run in onnxruntime on the CPU against PyTorch (fp32, 1e-5).

The plan kinds that run on one device (dense, split_kv, stream_k) export as one standard ``Attention`` node or,
with ``attention="function"``, as an ``attnopt`` node whose function body onnxruntime runs; tree, ring, bucketed and
SAAP plans are in ``test_export_plans.py``.
"""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from attnopt import PlanReport, SplitKVPlan, TreePlan  # noqa: E402
from attnopt.export import StaticCacheDecodeStep, export_onnx  # noqa: E402
from attnopt.runtime import ops as _ops, reference  # noqa: E402,F401  (ops registers torch.ops.attnopt.*)

ATOL = 1e-5


def run_ort(path, *inputs):
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = {i.name: t.numpy() for i, t in zip(session.get_inputs(), inputs)}
    return session.run(None, feeds)


def nodes(path):
    model = onnx.load(str(path))
    onnx.checker.check_model(model, full_check=True)
    return model, [(n.domain, n.op_type) for n in model.graph.node]


def close(got, want, atol=ATOL):
    np.testing.assert_allclose(got, want.detach().numpy(), atol=atol, rtol=0)


# --------------------------------------------------------------------------------------------- hand-written decode
class DecodeLayer(torch.nn.Module):
    """A hand-written GQA decode step: project one token, append it to the past K/V, attend, project back."""

    def __init__(self, hidden=96, q_heads=6, kv_heads=2, head_dim=64):
        super().__init__()
        self.q_heads, self.kv_heads, self.head_dim = q_heads, kv_heads, head_dim
        self.q = torch.nn.Linear(hidden, q_heads * head_dim)
        self.kv = torch.nn.Linear(hidden, 2 * kv_heads * head_dim)
        self.o = torch.nn.Linear(q_heads * head_dim, hidden)

    def forward(self, x, past_k, past_v):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.q_heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(b, t, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        k, v = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
        a = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        return self.o(a.transpose(1, 2).reshape(b, t, -1)), k, v


@pytest.fixture(scope="module")
def decode_layer():
    torch.manual_seed(0)
    layer = DecodeLayer().eval()
    inputs = (torch.randn(2, 1, 96), torch.randn(2, 2, 37, 64), torch.randn(2, 2, 37, 64))
    with torch.no_grad():
        want = layer(*inputs)
    return layer, inputs, want


@pytest.mark.parametrize("plan,opset", [("dense", 24), ("split_kv", 24), ("stream_k", 23)])
def test_handwritten_decode_exports_one_standard_attention(tmp_path, decode_layer, plan, opset):
    layer, inputs, want = decode_layer
    path = tmp_path / "decode.onnx"
    log = tmp_path / "plans.jsonl"
    report = export_onnx(layer, inputs, path, opset=opset, force_plan=plan, plan_log=str(log))
    (site,) = report.sites
    assert site.rewritten and site.chosen.kind == plan and site.exported_as == f"onnx:Attention-{opset}"
    assert PlanReport.from_json(log.read_text()).sites[0].exported_as == site.exported_as
    _, ops = nodes(path)
    assert ops.count(("", "Attention")) == 1 and not any(d == "attnopt" for d, _ in ops), ops
    for got, ref in zip(run_ort(path, *inputs), want):
        close(got, ref)


@pytest.mark.parametrize("plan", ["dense", "split_kv", "stream_k"])
def test_function_form_runs_through_the_body_without_attnopt(tmp_path, decode_layer, plan):
    """``attention="function"``: an ``attnopt::decode_attention`` node carrying the plan, with its body in
    ``model.functions``; onnxruntime and onnx's reference evaluator (neither knows attnopt) run the body."""
    layer, inputs, want = decode_layer
    path = tmp_path / "decode_fn.onnx"
    report = export_onnx(layer, inputs, path, attention="function", force_plan=plan)
    assert [s.exported_as for s in report.sites] == ["attnopt:decode_attention (function body)"]
    model, ops = nodes(path)
    assert ("attnopt", "decode_attention") in ops and ("", "Attention") not in ops
    assert [(f.domain, f.name) for f in model.functions] == [("attnopt", "decode_attention")]
    node = next(n for n in model.graph.node if n.domain == "attnopt")
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert json.loads(attrs["plan"])["kind"] == plan and attrs["scale"] == pytest.approx(0.125)
    for got, ref in zip(run_ort(path, *inputs), want):
        close(got, ref)
    feeds = dict(zip([i.name for i in model.graph.input], [t.numpy() for t in inputs]))
    close(onnx.reference.ReferenceEvaluator(model).run(None, feeds)[0], want[0])


# --------------------------------------------------------------------------------------------- GQA static cache
def repeat_kv(x, n):
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, n, s, d).reshape(b, h * n, s, d)


def static_cache_attention(q, k_cache, v_cache, mask):
    """Hugging Face's static-cache form: repeat_kv copies of the whole cache and a bool valid-length mask."""
    g = q.shape[1] // k_cache.shape[1]
    return F.scaled_dot_product_attention(q, repeat_kv(k_cache, g), repeat_kv(v_cache, g), attn_mask=mask)


def valid_mask(lengths, n):
    return (torch.arange(n)[None, :] < torch.tensor(lengths)[:, None])[:, None, None, :]


@pytest.mark.parametrize("opset", [24, 23])
def test_gqa_static_cache_valid_length(tmp_path, opset):
    """A preallocated cache with a different valid length per batch row: one Attention node on the un-expanded
    cache; at opset 24 the valid length from the mask goes to ``nonpad_kv_seqlen``. The same file is right for
    other lengths (the mask is an input, not a constant)."""
    torch.manual_seed(1)
    q, k, v = torch.randn(2, 8, 1, 64), torch.randn(2, 2, 96, 64), torch.randn(2, 2, 96, 64)
    mask = valid_mask([5, 70], 96)
    path = tmp_path / "static.onnx"
    report = export_onnx(static_cache_attention, (q, k, v, mask), path, opset=opset, force_plan="split_kv")
    (site,) = report.sites
    # The mask is a graph input, so detect cannot prove its form ("arbitrary"); the valid length is taken from it.
    assert site.site.mask_kind == "arbitrary" and site.site.gqa_source == "repeat_kv"
    model, ops = nodes(path)
    (attention,) = [n for n in model.graph.node if n.op_type == "Attention"]
    assert list(attention.input[1:3]) == ["k_cache", "v_cache"], attention.input  # no repeat_kv copy in between
    assert ("", "Expand") not in ops, ops
    if opset == 24:
        assert site.exported_as == "onnx:Attention-24 (nonpad_kv_seqlen)" and attention.input[6], attention.input
    else:
        assert site.exported_as == "onnx:Attention-23" and len(attention.input) <= 4
    for lengths in ([5, 70], [96, 1], [33, 33]):
        m = valid_mask(lengths, 96)
        close(run_ort(path, q, k, v, m)[0], static_cache_attention(q, k, v, m))
        close(run_ort(path, q, k, v, m)[0], reference.decode_attention(q, k, v, valid_len=torch.tensor(lengths)))


def test_causal_with_valid_length_keeps_top_left_alignment(tmp_path):
    """``is_causal`` with a valid length: ``nonpad_kv_seqlen`` would shift ONNX's causal diagonal to bottom-right,
    so the length is folded into the mask and PyTorch's top-left alignment holds."""
    plan = SplitKVPlan(num_splits=2).runtime_key()

    def fn(q, k, v, lengths):
        return torch.ops.attnopt.decode_attention(q, k, v, None, lengths, 0.125, True, plan, "s0")

    q, k, v = torch.randn(2, 4, 3, 64), torch.randn(2, 2, 9, 64), torch.randn(2, 2, 9, 64)
    lengths = torch.tensor([2, 9], dtype=torch.int32)
    path = tmp_path / "causal.onnx"
    export_onnx(fn, (q, k, v, lengths), path)
    _, ops = nodes(path)
    assert ("", "Attention") in ops
    want = reference.decode_attention(q, k, v, valid_len=lengths, scale=0.125, is_causal=True)
    close(run_ort(path, q, k, v, lengths)[0], want)


# --------------------------------------------------------------------------------------------- no standard node
def test_softmax_states_and_merge_export_as_function_nodes(tmp_path):
    """``decode_attention_states`` and ``merge_states`` have no standard ONNX node: attnopt nodes with bodies,
    exact against the reference (the two halves of a cache merged equal attention over all of it)."""
    plan = SplitKVPlan(num_splits=1).runtime_key()

    def fn(q, k, v, mask):
        n = k.shape[2] // 2
        a = torch.ops.attnopt.decode_attention_states(q, k[:, :, :n], v[:, :, :n], mask[..., :n], None, 0.125, False,
                                                      plan, "a")
        b = torch.ops.attnopt.decode_attention_states(q, k[:, :, n:], v[:, :, n:], mask[..., n:], None, 0.125, False,
                                                      plan, "b")
        return torch.ops.attnopt.merge_states(torch.stack([a[0], b[0]]), torch.stack([a[1], b[1]]))

    q, k, v = torch.randn(1, 6, 2, 64), torch.randn(1, 3, 40, 64), torch.randn(1, 3, 40, 64)
    mask = torch.rand(1, 1, 2, 40) > 0.4
    mask[..., 20:] = False  # the second half is empty for every row: lse = -inf there, no NaN
    path = tmp_path / "states.onnx"
    export_onnx(fn, (q, k, v, mask), path)
    model, ops = nodes(path)
    assert ops.count(("attnopt", "decode_attention_states")) == 2 and ("attnopt", "merge_states") in ops
    assert {f.name for f in model.functions} == {"decode_attention_states", "merge_states"}
    o, lse = run_ort(path, q, k, v, mask)
    want_o, want_lse = reference.attention_states(q, k, v, attn_mask=mask, scale=0.125)
    close(o, want_o)
    close(lse, want_lse)
    with pytest.raises(ValueError, match="no standard ONNX node"):
        export_onnx(fn, (q, k, v, mask), tmp_path / "x.onnx", attention="standard")


def test_a_rank_of_a_sharded_cache_is_refused(tmp_path):
    """A graph rewritten on a rank of a sequence-sharded cache holds only that rank's keys: its single-device
    export would attend to a shard, so it is refused before exporting."""
    key = TreePlan(world=2).runtime_key()

    def fn(q, k, v, mask):
        local = torch.ops.attnopt.shard_mask_columns(mask, k.shape[2])
        return torch.ops.attnopt.decode_attention(q, k, v, local, None, 0.125, False, key, "s0")

    with pytest.raises(ValueError, match="sharded cache"):
        export_onnx(fn, (torch.randn(1, 2, 1, 64), torch.randn(1, 2, 8, 64), torch.randn(1, 2, 8, 64),
                         torch.ones(1, 1, 1, 16, dtype=torch.bool)), tmp_path / "x.onnx")


@pytest.mark.parametrize("kwargs,match", [({"opset": 20}, "valid: 23, 24"), ({"attention": "fast"}, "auto, standard"),
                                          ({"verify": True}, "verify"), ({"no_such_option": 1}, "valid options")])
def test_bad_arguments_fail_early(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        export_onnx(lambda x: x, (torch.ones(1),), tmp_path / "x.onnx", **kwargs)


def test_float64_function_body_is_refused(tmp_path, decode_layer):
    layer, inputs, _ = decode_layer
    with pytest.raises(ValueError, match="compute in float32"):
        export_onnx(copy.deepcopy(layer).double(), [t.double() for t in inputs], tmp_path / "x.onnx",
                    attention="function", force_plan="dense")


def test_exported_as_round_trips_and_old_reports_load():
    report = PlanReport.from_json(json.dumps({"version": 1, "sites": [{"site": {
        "node": "sdpa", "module_path": "m", "pattern": "sdpa", "batch": 1, "q_heads": 2, "kv_heads": 1, "head_dim": 64,
        "q_len": 1, "kv_len": 8, "dtype": "float32"}, "rewritten": True}]}))
    assert report.sites[0].exported_as == ""
    report.sites[0].exported_as = "onnx:Attention-24"
    assert PlanReport.from_json(report.to_json()).sites[0].exported_as == "onnx:Attention-24"


# --------------------------------------------------------------------------------------------- SmolLM2 decode step
def smollm2_shaped(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    from attnopt.commands.export_onnx import SHAPES

    fields = dict(SHAPES["smollm2-135m"], num_hidden_layers=layers)
    theta = fields.pop("rope_theta")
    cfg = LlamaConfig(**fields, rope_parameters={"rope_type": "default", "rope_theta": theta},
                      attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def check_decode_steps(path, step, inputs, atol=ATOL):
    """ORT against PyTorch on the example step and on the step after it (the valid length moves by one)."""
    for _ in range(2):
        got = run_ort(path, *inputs)
        with torch.no_grad():
            want = step(*[t.clone() for t in inputs])
        for g, w in zip(got, want):
            close(g, w, atol=atol)
        token = torch.from_numpy(got[0][:, -1]).argmax(-1, keepdim=True)
        assert torch.equal(token, want[0][:, -1].argmax(-1, keepdim=True))
        inputs = (token, inputs[1] + 1, *want[1:])


def export_decode_step(model, path, position=5, max_cache_len=48, **options):
    from attnopt.commands.export_onnx import example_step

    step = StaticCacheDecodeStep(model)
    inputs = example_step(step, batch=1, max_cache_len=max_cache_len, position=position, seed=0)
    names = step.cache_names()
    report = export_onnx(step, inputs, path, input_names=["input_ids", "cache_position", *names],
                         output_names=["logits", *[f"present_{n}" for n in names]], **options)
    return step, inputs, report


@pytest.mark.slow
def test_smollm2_shaped_decode_step(tmp_path):
    """A SmolLM2-135M-shaped Llama (9/3 heads of 64, hidden 576; 2 of its 30 layers, random weights) over a static
    cache, as planned here (dense on this CPU: the valid length then comes from the mask): every site exports as
    Attention-24 with ``nonpad_kv_seqlen`` and no repeat_kv copy, ORT matches PyTorch, same next token."""
    path = tmp_path / "smollm2.onnx"
    step, inputs, report = export_decode_step(smollm2_shaped(2), path)
    assert len(report.sites) == 2 and all(s.exported_as == "onnx:Attention-24 (nonpad_kv_seqlen)" for s in report.sites)
    assert "exported as" in report.format_table(width=200)
    _, ops = nodes(path)
    assert ops.count(("", "Attention")) == 2 and ("", "Expand") not in ops, ops
    check_decode_steps(path, step, inputs)


@pytest.mark.slow
def test_smollm2_real_gguf_decode_step(tmp_path):
    """The real SmolLM2-135M-Instruct (30 layers), exported as planned on this machine. ORT and PyTorch differ by
    3.6e-5 on its logits (measured at bbddf3c), exactly as much as a plain ``torch.onnx`` export of the same step
    without attnopt: fp32 rounding over 30 layers, hence 1e-4 here."""
    from attnopt.hf import ModelNotAvailableError, load_smollm2

    try:
        model, _ = load_smollm2(dtype=torch.float32, attn_implementation="sdpa")
    except ModelNotAvailableError as exc:
        pytest.skip(str(exc))
    path = tmp_path / "smollm2.onnx"
    step, inputs, report = export_decode_step(model, path, position=12, max_cache_len=64)
    assert len(report.sites) == 30 and all(s.exported_as.startswith("onnx:Attention-24") for s in report.sites)
    check_decode_steps(path, step, inputs, atol=1e-4)


def test_cli_export_onnx(tmp_path, capsys):
    from attnopt.cli import main

    path = tmp_path / "tiny.onnx"
    assert main(["export-onnx", "tiny-llama", str(path), "--plan", "stream_k", "--max-cache-len", "32",
                 "--position", "3", "--check", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["check"]["same_next_token"] and data["check"]["max_abs_diff_logits"] < ATOL
    sites = data["report"]["sites"]
    assert len(sites) == 2 and {s["exported_as"] for s in sites} == {"onnx:Attention-24 (nonpad_kv_seqlen)"}
    assert main(["export-onnx", "no-such-model", str(path)]) == 2
    assert "unknown model 'no-such-model'" in capsys.readouterr().err


def window_attention(q, k, v, pos):
    """SDPA over a cache with a sliding window of 8 keys built from the query position (HF's overlay)."""
    kv = torch.arange(k.shape[2])[None, None, None, :]
    qp = pos.view(1, 1, -1, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(kv <= qp) & (kv > qp - 8))


def test_window_site_exports_with_its_mask(tmp_path):
    """A sliding-window site (its kernels start at ``key_start_from_mask``) exports as the standard Attention node
    over its mask, which alone hides the keys before the window: the same result in onnxruntime at other positions."""
    torch.manual_seed(2)
    q, k, v = torch.randn(1, 4, 1, 64), torch.randn(1, 4, 40, 64), torch.randn(1, 4, 40, 64)
    path = tmp_path / "window.onnx"
    report = export_onnx(window_attention, (q, k, v, torch.tensor([30])), path, force_plan="split_kv")
    (site,) = report.sites
    assert site.site.window == 8 and site.rewritten
    for p in (30, 9, 39):
        pos = torch.tensor([p])
        close(run_ort(path, q, k, v, pos)[0], window_attention(q, k, v, pos))


def test_key_range_exports_as_the_reference(tmp_path):
    """``attnopt::key_range_from_mask`` (a window site's key start and valid length from one scan) exports as ONNX
    ops that give the reference's (2, B) int32 in onnxruntime: a band, one key, and a row without a visible key (the
    empty range's start 2**31 - 1)."""
    m = torch.zeros(3, 1, 2, 50, dtype=torch.bool)
    m[0, :, 0, 10:20] = True
    m[1, :, 1, 45] = True
    path = tmp_path / "range.onnx"
    export_onnx(lambda mask: torch.ops.attnopt.key_range_from_mask(mask, 3), (m,), path)
    for mask in (m, torch.where(m, 0.0, float("-inf"))[:, :, :1].contiguous()):
        if mask.dtype != torch.bool:  # an additive mask: export it as such
            export_onnx(lambda x: torch.ops.attnopt.key_range_from_mask(x, 3), (mask,), path)
        (got,) = run_ort(path, mask)
        np.testing.assert_array_equal(got, reference.key_range_from_mask(mask, 3).numpy())
