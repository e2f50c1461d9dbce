"""``export_onnx`` of the decode-op variants: logit softcapping (the standard ``Attention`` node's ``softcap``, or
the function body's), ALiBi (its ``slope[h] * j`` bias folded into the node's mask) and sliding windows (the mask
hides the keys before ``key_start``). Each runs in onnxruntime on the CPU against the optimized PyTorch graph and
the original (fp32, 1e-5), on direct graphs and on tiny Hugging Face models (Gemma 2, MPT, Mistral).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

import attnopt  # noqa: E402
from attnopt.bench.variants import alibi_slopes, eager_chain  # noqa: E402
from attnopt.export import export_onnx  # noqa: E402
from attnopt.runtime import ops as _ops, reference  # noqa: E402,F401  (ops registers torch.ops.attnopt.*)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_export import close, nodes as ops_of  # noqa: E402  (checker-validated (domain, op) list; fp32 compare)
from test_export_plans import run_ort  # noqa: E402

CAP = 50.0
SITE = "model.layers.0.attn"


def qkv(seed=0, B=2, Hq=6, Hkv=2, L=1, N=40, D=64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, Hq, L, D, generator=g) * 3, torch.randn(B, Hkv, N, D, generator=g),
            torch.randn(B, Hkv, N, D, generator=g))


def masked_chain(cap, alibi):
    """The eager chain (``repeat_interleave`` GQA) with an additive mask after the cap and ALiBi."""
    def attend(q, k, v, mask):
        group = q.shape[1] // k.shape[1]
        scores = q @ k.repeat_interleave(group, dim=1).transpose(-1, -2) / q.shape[-1] ** 0.5
        if cap is not None:
            scores = cap * torch.tanh(scores / cap)
        if alibi:
            positions = torch.arange(k.shape[2], device=q.device, dtype=q.dtype)
            scores = scores + alibi_slopes(q.shape[1], q.device)[:, None, None] * positions
        weights = torch.softmax(scores + mask, dim=-1)
        return weights @ v.repeat_interleave(group, dim=1)
    return attend


def band_mask(B, N, starts, ends):
    cols = torch.arange(N)
    keep = (cols >= torch.tensor(starts)[:, None]) & (cols < torch.tensor(ends)[:, None])
    return torch.zeros(B, 1, 1, N).masked_fill(~keep[:, None, None, :], float("-inf"))


VARIANTS = [(CAP, False), (None, True), (CAP, True)]


@pytest.mark.parametrize("attention,opset", [("auto", 24), ("function", 24), ("auto", 23)])
@pytest.mark.parametrize("cap,alibi", VARIANTS, ids=["softcap", "alibi", "softcap+alibi"])
def test_variant_sites_export(tmp_path, cap, alibi, attention, opset):
    """A split-KV site with a softcap and/or ALiBi: one standard Attention node (``softcap`` attribute, ALiBi in
    the mask) or the decode_attention body; onnxruntime matches the optimized graph, the original and the
    float64 reference."""
    q, k, v = qkv()
    fn = eager_chain(cap, alibi)
    path = tmp_path / "x.onnx"
    report = export_onnx(fn, (q, k, v), path, opset, force_plan="split_kv", attention=attention)
    (site,) = [s for s in report.sites if s.rewritten]
    model, ops = ops_of(path)
    if attention == "auto":
        assert ops.count(("", "Attention")) == 1 and not any(d == "attnopt" for d, _ in ops), ops
        (node,) = [n for n in model.graph.node if n.op_type == "Attention"]
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs.get("softcap", 0.0) == (cap or 0.0) and site.exported_as.startswith(f"onnx:Attention-{opset}")
    else:
        assert ("attnopt", "decode_attention") in ops
    assert ("softcap=50" in site.exported_as) == bool(cap) and ("alibi" in site.exported_as) == alibi
    (got,) = run_ort(path, {"q": q, "k": k, "v": v})
    optimized = attnopt.optimize(fn, inner_backend="eager", force_plan="split_kv")
    close(got, optimized(q, k, v))
    close(got, fn(q, k, v))
    close(got, reference.decode_attention(q.double(), k.double(), v.double(), scale=64 ** -0.5 / (cap or 1.0),
                                          softcap=cap or 0.0,
                                          alibi_slopes=alibi_slopes(6, "cpu").double() if alibi else None).float())


@pytest.mark.parametrize("attention", ["auto", "function"])
@pytest.mark.parametrize("cap,alibi", VARIANTS, ids=["softcap", "alibi", "softcap+alibi"])
def test_variant_sites_with_a_mask_export(tmp_path, cap, alibi, attention):
    """The mask combines with the cap (which comes first) and with ALiBi (added to it), per batch row."""
    q, k, v = qkv(seed=1, L=2)
    mask = band_mask(2, 40, (3, 10), (37, 40))
    fn = masked_chain(cap, alibi)
    path = tmp_path / "x.onnx"
    report = export_onnx(fn, (q, k, v, mask), path, force_plan="stream_k", attention=attention)
    (site,) = [s for s in report.sites if s.rewritten]
    assert ("softcap=50" in site.exported_as) == bool(cap) and ("alibi" in site.exported_as) == alibi
    (got,) = run_ort(path, {"q": q, "k": k, "v": v, "mask": mask})
    close(got, attnopt.optimize(fn, inner_backend="eager", force_plan="stream_k")(q, k, v, mask))
    close(got, fn(q, k, v, mask))


def test_negative_softcap_exports_as_the_function_body(tmp_path):
    """``Attention``'s softcap must be positive: a negative cap goes to the body under "auto" and is refused under
    "standard" before any export work."""
    q, k, v = qkv(seed=2)
    fn = eager_chain(-CAP, False)
    path = tmp_path / "x.onnx"
    report = export_onnx(fn, (q, k, v), path, force_plan="split_kv")
    _, ops = ops_of(path)
    assert ("attnopt", "decode_attention") in ops and "is negative" in report.sites[0].exported_as
    (got,) = run_ort(path, {"q": q, "k": k, "v": v})
    close(got, fn(q, k, v))
    with pytest.raises(ValueError, match="negative.*attention='auto' or 'function'"):
        export_onnx(fn, (q, k, v), tmp_path / "y.onnx", force_plan="split_kv", attention="standard")


# --------------------------------------------------------------------------------------------- tiny HF models
class DynamicCacheDecodeStep(torch.nn.Module):
    """One decode step over a full-length ``DynamicCache`` given as tensors (keys and values interleaved per layer):
    every layer keeps all keys, so a windowed layer's mask hides the ones before its window. MPT breaks its graph
    over a StaticCache (see tests/models/test_hf_coverage.py), and a windowed model's StaticCache keeps only the
    window."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, *caches):
        import transformers

        cache = transformers.DynamicCache()
        for layer, (keys, values) in enumerate(zip(caches[0::2], caches[1::2])):
            cache.update(keys, values, layer)
        return self.model(input_ids=input_ids, past_key_values=cache, use_cache=True).logits


def variant_decode_step(arch: str, device: str = "cpu"):
    """(step, inputs, expected variants per layer) of a tiny eager ``test_hf_coverage.VARIANTS`` model: a decode
    step after a 20-token prefill over a full-length DynamicCache."""
    transformers = pytest.importorskip("transformers")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    from test_hf_coverage import VARIANTS

    make, expect = VARIANTS[arch]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(make("eager")).eval().to(device)
    ids = torch.randint(3, model.config.vocab_size, (1, 21), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        prefill = model(input_ids=ids[:, :20], past_key_values=transformers.DynamicCache(), use_cache=True)
    inputs = (ids[:, 20:], *[t for layer in prefill.past_key_values.layers for t in (layer.keys, layer.values)])
    return DynamicCacheDecodeStep(model), inputs, expect


@pytest.mark.slow
@pytest.mark.parametrize("arch, variant", [("gemma2", "softcap=50"), ("mpt", "alibi"), ("mistral", "")])
def test_tiny_hf_variant_models_export(tmp_path, arch, variant):
    """Gemma 2 (softcap 50; windowed and full layers), MPT (ALiBi) and Mistral (every layer windowed, 8 keys of
    the 21): a decode step after a 20-token prefill, eager attention, every site rewritten (split-KV) and exported
    as one Attention-24 node with its variant; ORT matches the original step and the optimized one (fp32, 1e-5),
    same next token."""
    step, inputs, expect = variant_decode_step(arch)
    from test_hf_coverage import WINDOW  # on the path from variant_decode_step

    path = tmp_path / f"{arch}.onnx"
    report = export_onnx(step, inputs, path, force_plan="split_kv")
    assert len(report.sites) == 2 and all(s.rewritten for s in report.sites), report.format_table()
    for s in report.sites:
        window, softcap, alibi = expect[int(s.site.module_path.split(".")[-2])]
        assert (s.site.window, s.site.softcap, s.site.alibi) == (window, softcap, alibi)
        assert s.exported_as.startswith("onnx:Attention-24") and variant in s.exported_as, s.exported_as
    assert any(s.site.window == WINDOW for s in report.sites) == (arch != "mpt")
    _, ops = ops_of(path)
    assert ops.count(("", "Attention")) == 2 and not any(d == "attnopt" for d, _ in ops), ops
    names = [i.name for i in ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).get_inputs()]
    (got,) = run_ort(path, dict(zip(names, inputs)))
    with torch.no_grad():
        want = step(*inputs)
        optimized = attnopt.optimize(step, inner_backend="eager", force_plan="split_kv")(*inputs)
    close(got, want)
    close(got, optimized)
    assert got[0, -1].argmax() == want[0, -1].argmax()


def test_saap_site_with_a_variant_fails_before_the_export():
    """SAAP's body has no cap and no ALiBi: a SAAP call with either is refused by the check that runs before
    torch.onnx starts, naming the kinds that export the variant."""
    from attnopt.export import OnnxTranslator
    from attnopt.plan import SaapPlan

    plan = SaapPlan(index="i", layer=1).runtime_key()
    for kwargs in ({"softcap": CAP}, {"alibi_slopes": alibi_slopes(6, "cpu")}):
        graph = torch.fx.Graph()
        q, k, v = (graph.placeholder(n) for n in "qkv")
        out = graph.call_function(torch.ops.attnopt.decode_attention.default,
                                  (q, k, v, None, None, 0.125, False, plan, SITE), kwargs)
        graph.output(out)
        with pytest.raises(ValueError, match="saap plan has no logit softcapping or ALiBi.*split_kv, stream_k"):
            OnnxTranslator(24).check_graph(torch.fx.GraphModule(torch.nn.Module(), graph))


def test_softmax_states_with_softcap_and_alibi_export_as_the_body(tmp_path):
    """``decode_attention_states`` with a cap and ALiBi: the body's ``softcap`` attribute and ALiBi in its bias give
    the reference's (o, lse), a fully masked row included (o = 0, lse = -inf)."""
    from attnopt.plan import SplitKVPlan

    plan = SplitKVPlan(num_splits=2).runtime_key()
    slopes = alibi_slopes(6, "cpu")

    def fn(q, k, v, mask):
        return torch.ops.attnopt.decode_attention_states(q, k, v, mask, None, 0.125 / CAP, False, plan, SITE,
                                                         softcap=CAP, alibi_slopes=slopes)

    q, k, v = qkv(seed=4, L=2)
    mask = torch.rand(2, 1, 2, 40, generator=torch.Generator().manual_seed(5)) > 0.3
    mask[1, :, 1] = False
    path = tmp_path / "states.onnx"
    export_onnx(fn, (q, k, v, mask), path)
    model, ops = ops_of(path)
    assert ops.count(("attnopt", "decode_attention_states")) == 1
    o, lse = run_ort(path, {"q": q, "k": k, "v": v, "mask": mask})
    want_o, want_lse = reference.attention_states(q, k, v, attn_mask=mask, scale=0.125 / CAP, softcap=CAP,
                                                  alibi_slopes=slopes)
    close(o, want_o)
    close(lse, want_lse)
    assert torch.isinf(torch.from_numpy(lse[1, :, 1])).all()


def test_half_precision_alibi_exports_as_the_body(tmp_path):
    """In fp16 the standard node's mask would hold ALiBi's bias in fp16 (rounded by up to 8 at key 16k): the site
    becomes the body, which adds it in fp32 as the kernels do; attention="standard" refuses it before the export."""
    q, k, v = (t.half() for t in qkv(seed=6))
    fn = eager_chain(None, True)
    path = tmp_path / "x.onnx"
    report = export_onnx(fn, (q, k, v), path, force_plan="split_kv")
    _, ops = ops_of(path)
    assert ("attnopt", "decode_attention") in ops and "half-precision" in report.sites[0].exported_as
    (got,) = run_ort(path, {"q": q, "k": k, "v": v})
    want = reference.decode_attention(q.float(), k.float(), v.float(), scale=64 ** -0.5,
                                      alibi_slopes=alibi_slopes(6, "cpu"))
    close(got.astype("float32"), want, atol=1e-3)
    with pytest.raises(ValueError, match="half-precision.*attention='auto' or 'function'"):
        export_onnx(fn, (q, k, v), tmp_path / "y.onnx", force_plan="split_kv", attention="standard")


@pytest.mark.parametrize("attention,opset", [("auto", 24), ("function", 24), ("auto", 23)])
def test_pure_band_exports_its_key_start(tmp_path, attention, opset):
    """A window whose mask is a proven band (``passes/window.py``) reaches the op with no mask, only ``key_start``
    and ``valid_len``: the export folds the start back in, so onnxruntime still hides the keys before the window."""
    from attnopt.bench.variants import windowed_sdpa

    q, k, v = qkv(B=2, N=40)
    pos = torch.tensor([30])
    fn = windowed_sdpa(8)
    path = tmp_path / "x.onnx"
    report = export_onnx(fn, (q, k, v, pos), path, opset, force_plan="split_kv", attention=attention)
    assert [s.site.window for s in report.sites if s.rewritten] == [8]
    (got,) = run_ort(path, {"q": q, "k": k, "v": v, "pos": pos})
    close(got, fn(q, k, v, pos))
