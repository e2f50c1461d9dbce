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
