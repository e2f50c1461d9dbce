"""Folded ALiBi slopes through ``attnopt.optimize`` with the inner backends that trace again (aot autograd and
inductor): the slopes' constant buffer must reach them as a known graph constant. Before the fix every call failed
with ``_attnopt_alibi_slopes_0 not found in param_name_to_source`` (found on an H100 with the window band's twin
buffers; the same on the CPU)."""
from __future__ import annotations

import pytest
import torch

import attnopt
from attnopt.bench.variants import eager_chain


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_folded_alibi_slopes_compile_through_aot_and_inductor(inner, monkeypatch):
    monkeypatch.setenv("ATTNOPT_CPU_KERNELS", "interpret")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, n, 64, generator=g) for n in (1, 300, 300))
    want = eager_chain(None, alibi=True)(q.double(), k.double(), v.double())
    opts = {} if inner == "inductor" else {"inner_backend": inner}
    ours = attnopt.optimize(eager_chain(None, alibi=True), force_plan="split_kv", **opts)
    torch.testing.assert_close(ours(q, k, v).double(), want, atol=1e-5, rtol=1e-5)
    sites = attnopt.last_plans(ours).sites
    assert [s.chosen.kind for s in sites if s.rewritten] == ["split_kv"], attnopt.last_plans(ours).format_table()
    assert "alibi" in sites[0].site.variant_str()
