"""``attnopt bench variants`` on the CPU, tiny shapes, the kernels in the Triton interpreter: the suite runs end to
end through ``optimize``, rewrites the window and softcap functions (no silent fallback) and is exact (the timing
itself needs a GPU: ``bash benchmarks/gpu.sh variants``)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")


def test_variants_smoke(tmp_path, monkeypatch, capsys):
    from attnopt.bench.variants import run
    from attnopt.runtime.kernels import interpreting

    if torch.cuda.is_available() or not interpreting():
        pytest.skip("the CPU smoke runs the kernels in the Triton interpreter")
    monkeypatch.setenv("ATTNOPT_CPU_KERNELS", "interpret")
    torch._dynamo.reset()
    out = tmp_path / "variants.json"
    assert run(SimpleNamespace(out=str(out), smoke=True)) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["case"], r["method"]) for r in rows] == [("window", "sdpa-mask"), ("window", "attnopt"),
                                                       ("plain", "attnopt"), ("softcap", "attnopt"), ("alibi", "attnopt")]
    for r in rows:
        assert r["rel_err"] < 1e-4, r
        if r["method"].startswith("attnopt"):
            assert r["plan"].startswith(("split_kv", "stream_k")), r
            want = {"window": "[window=64]", "softcap": "[softcap=50]", "alibi": "[alibi]"}.get(r["case"], "")
            assert r["plan"].endswith(want) and (want or "[" not in r["plan"]), r
    printed = capsys.readouterr().out
    assert "x SDPA with the window as a mask" in printed and "alibi:" in printed and "softcap:" in printed


def test_timed_call_runs_the_variant():
    """The tuner's timed call at a window / softcap / ALiBi site runs the plan as the lowered op does: the set's
    precomputed key start (the band's first key), the cap and slopes; its output equals the reference's."""
    from attnopt.plan import SplitKVPlan
    from attnopt.runtime.reference import decode_attention
    from attnopt.site import AttentionSite
    from attnopt.timer import site_call, synthetic_inputs

    base = dict(batch=1, q_heads=4, kv_heads=2, head_dim=64, q_len=1, kv_len=200, dtype="float32",
                mask_kind="arbitrary", scale=0.125)
    for extra in (dict(window=32), dict(softcap=20.0), dict(alibi=True)):
        site = AttentionSite.canonical(**base, **extra)
        s = synthetic_inputs(site, 0, device="cpu")
        if "window" in extra:
            keep = int(s["valid_len"][0])
            assert s["key_start"].tolist() == [keep - 32]
        out = site_call(SplitKVPlan(num_splits=2, block_n=32), site, s)()
        slopes = torch.tensor([2.0 ** -(8 * (h + 1) / 4) for h in range(4)]) if site.alibi else None
        ref = decode_attention(s["q"], s["k"], s["v"], attn_mask=s["mask"], scale=0.125, softcap=site.softcap or 0.0,
                               alibi_slopes=slopes)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
