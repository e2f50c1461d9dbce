"""Many shapes, head dims and kernel plans in ONE process on the GPU, each checked against the float64 reference.

Why one process: the kernels' launch paths keep compiled kernels in caches keyed by what changes a compilation
(``runtime/kernels/launch.py``). A key that is too coarse returns a kernel compiled for another shape, which a test
running one shape per process cannot see: before 68981a5 the head dims 80, 96 and 128 (one padded width) shared a
kernel, and only the planner bench (many shapes in one process) showed it, as wrong answers. Hypothesis draws the
shapes, so head dims, query rows, lengths, masks and plans interleave in an order no hand-written list fixes.
GPU only: the interpreter takes Triton's own launch path.
"""
from __future__ import annotations

import math

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from attnopt.hardware import builtin_profile  # noqa: E402
from attnopt.runtime import ops  # noqa: E402,F401  (registers torch.ops.attnopt)
from attnopt.runtime.reference import sdpa_float64  # noqa: E402
from attnopt.runtime.strategies import PlanContext, get_strategy  # noqa: E402
from attnopt.site import AttentionSite  # noqa: E402

H100 = builtin_profile("h100-sxm")
CUDA_CTX = PlanContext(device_type="cuda", triton_available=True)
HEAD_DIMS = (64, 80, 96, 128, 256)
GROUPS = (1, 2, 3, 4, 5, 7, 8)


@st.composite
def cases(draw):
    d = draw(st.sampled_from(HEAD_DIMS))
    g = draw(st.sampled_from(GROUPS))
    hkv = draw(st.sampled_from((1, 2, 4, 8)))
    b = draw(st.integers(1, 4))
    q_len = draw(st.sampled_from((1, 2, 4)))
    n = draw(st.integers(1, 4100))
    mask = draw(st.sampled_from(("none", "valid_length", "arbitrary")))
    dtype = draw(st.sampled_from((torch.bfloat16, torch.float16)))
    kind = draw(st.sampled_from(("split_kv", "stream_k")))
    pick = draw(st.integers(0, 63))
    seed = draw(st.integers(0, 2 ** 16))
    return d, g, hkv, b, q_len, n, mask, dtype, kind, pick, seed


def _inputs(b, hq, hkv, q_len, n, d, dtype, mask_kind, seed):
    """q (B, Hq, L, D), k, v (B, Hkv, N, D) in ``dtype``; the mask (B, 1, L, N) bool or None; valid (B,) int32 or
    None. Every query row keeps at least one visible key (a fully masked row is another test's subject)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, hq, q_len, d, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(b, hkv, n, d, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(b, hkv, n, d, device="cuda", dtype=dtype, generator=gen)
    fill = torch.randint(1, n + 1, (b,), device="cuda", generator=gen, dtype=torch.int32)
    if mask_kind == "none":
        return q, k, v, None, None
    visible = torch.arange(n, device="cuda")[None, None, None, :] < fill[:, None, None, None]
    if mask_kind == "valid_length":
        # a static cache's prefix, given both as the mask and as the lengths the op may use instead of scanning it
        return q, k, v, visible.expand(b, 1, q_len, n).contiguous(), fill
    holes = torch.rand(b, 1, q_len, n, device="cuda", generator=gen) > 0.3
    holes[..., 0] = True
    return q, k, v, (visible & holes).contiguous(), None


@pytest.mark.cuda
@settings(max_examples=50, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(cases())
def test_kernel_plans_of_mixed_shapes_in_one_process_match_the_reference(case):
    d, g, hkv, b, q_len, n, mask_kind, dtype, kind, pick, seed = case
    hq = hkv * g
    site = AttentionSite.canonical(batch=b, q_heads=hq, kv_heads=hkv, head_dim=d, q_len=q_len, kv_len=n,
                                   dtype=str(dtype).split(".")[-1], mask_kind=mask_kind,
                                   gqa_source="enable_gqa" if g > 1 else "mha")
    strategy = get_strategy(kind)
    if strategy.check(site, H100, CUDA_CTX) is not None:
        return
    plans = list(strategy.candidates(site, H100, CUDA_CTX))
    assert plans, f"no {kind} candidate for an applicable site {site}"
    plan = plans[pick % len(plans)]
    q, k, v, mask, valid = _inputs(b, hq, hkv, q_len, n, d, dtype, mask_kind, seed)
    scale = 1.0 / math.sqrt(d)
    state = strategy.prepare(plan, q, k, v)
    out = strategy.run(state, plan, q, k, v, mask, valid, scale, False)
    ref = sdpa_float64(q, k, v, attn_mask=mask, valid_len=valid, scale=scale)
    assert out.shape == ref.shape and out.dtype == dtype
    assert torch.isfinite(out).all(), f"{plan.describe()} non-finite output at {site}"
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < 1e-2, f"{plan.describe()} rel err {err:.2e} at D={d} G={g} Hkv={hkv} B={b} L={q_len} N={n} {mask_kind}"
