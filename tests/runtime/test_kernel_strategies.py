"""The ``split_kv`` and ``stream_k`` strategies: checks, candidates, estimates, and runs through the op.

On CPU tensors the strategies run the pure-PyTorch partition-and-merge by default (fast, for model tests);
``ATTNOPT_CPU_KERNELS=interpret`` makes them launch the Triton kernels in the interpreter.
"""
from __future__ import annotations

import math

import pytest
import torch

from attnopt.hardware import builtin_profile
from attnopt.plan import SplitKVPlan, StreamKPlan, plan_from_json
from attnopt.runtime import ops  # noqa: F401  (registers torch.ops.attnopt)
from attnopt.runtime.reference import attention_states, sdpa_float64
from attnopt.runtime.strategies import PlanContext, get_strategy
from attnopt.site import AttentionSite

KINDS = ("split_kv", "stream_k")
H100 = builtin_profile("h100-sxm")
CUDA_CTX = PlanContext(device_type="cuda", triton_available=True)


@pytest.mark.parametrize("kind", KINDS)
def test_check_reasons(kind):
    s = get_strategy(kind)
    assert s.check(AttentionSite.canonical(), H100, CUDA_CTX) is None
    assert s.check(AttentionSite.canonical(head_dim=72), H100, CUDA_CTX) == (
        "head_dim 72 not supported by the kernels (64, 80, 96, 128, 256)")
    assert "q_len 17" in s.check(AttentionSite.canonical(q_len=17), H100, CUDA_CTX)
    assert "multiple" in s.check(AttentionSite.canonical(q_heads=30, kv_heads=8), H100, CUDA_CTX)
    assert "v_head_dim" in s.check(AttentionSite.canonical(v_head_dim=64), H100, CUDA_CTX)
    assert "Triton" in s.check(AttentionSite.canonical(), H100, PlanContext(device_type="cuda"))
    # CPU sites stay applicable: the strategy runs the reference partition-and-merge there
    assert s.check(AttentionSite.canonical(dtype="float32"), builtin_profile("cpu"), PlanContext()) is None


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("kv_len,hint", [(8192, None), (131072, None), (None, 2048), (37, None)])
def test_candidates_are_length_aware(kind, kv_len, hint):
    s = get_strategy(kind)
    site = AttentionSite.canonical(kv_len=kv_len, kv_len_hint=hint)
    plans = list(s.candidates(site, H100, CUDA_CTX))
    assert plans, "no candidate for a canonical site"
    assert len({p.runtime_key() for p in plans}) == len(plans), "duplicate candidates"
    for p in plans:
        assert plan_from_json(p.to_json()) == p
        est = s.estimate_us(p, site, H100, CUDA_CTX)
        assert math.isfinite(est) and est > 0
    n = kv_len or hint
    if kind == "split_kv":
        # never more splits than KV tiles
        assert all(p.splits_at(n) <= max(2, -(-n // p.block_n)) for p in plans)
    elif kv_len is not None:
        # a static length bounds the useful grid by the number of iterations
        assert all(p.grid <= 8 * -(-n // p.block_n) for p in plans)


def test_longer_context_prefers_more_parallelism():
    s = get_strategy("split_kv")
    best = {}
    for n in (256, 131072):
        site = AttentionSite.canonical(kv_len=n)
        plans = list(s.candidates(site, H100, CUDA_CTX))
        best[n] = min(plans, key=lambda p: s.estimate_us(p, site, H100, CUDA_CTX)).num_splits
    assert best[131072] > best[256]


def test_stream_k_candidates_share_split_kv_configs_and_offer_a_tile_aligned_grid():
    """Stream-K offers the kernel configs split-KV does (its 8-warp, 2-stage candidates ran 1.5x slower at 8k on
    the H100), with TMA tiles, and one grid that is a whole multiple of the output tiles (128 for 8 KV heads on
    132 SMs), whose shares stay inside one tile."""
    from attnopt.runtime.strategies.split_kv import kernel_configs

    site = AttentionSite.canonical(kv_len=131072, q_heads=32, kv_heads=8, head_dim=128)
    plans = list(get_strategy("stream_k").candidates(site, H100, CUDA_CTX))
    assert all(p.tma for p in plans)
    assert {p.block_n for p in plans} >= {bn for bn, _, _ in kernel_configs(128)}
    assert (64, 4, 3) in {(p.block_n, p.num_warps, p.num_stages) for p in plans}
    assert {p.grid for p in plans} >= {H100.sm_count, 2 * H100.sm_count, 8 * (H100.sm_count // 8)}


def test_split_kv_offers_small_splits_of_wide_tiles_for_many_heads():
    """At 56 MHA heads, D=64, 64k the fastest measured split-KV plan on the H100 was 64 splits of four 256-key
    tiles, 4 warps, 3 stages; the wave-sized split counts alone stopped at 6 splits (3 % slower)."""
    from attnopt.runtime.strategies import split_kv as skv

    site = AttentionSite.canonical(kv_len=65536, q_heads=56, kv_heads=56, head_dim=64)
    plans = list(get_strategy("split_kv").candidates(site, H100, CUDA_CTX))
    small = [p for p in plans if (p.block_n, p.num_warps, p.num_stages, p.tiles_per_split) == (256, 4, 3, 4)
             and not (p.swap_ab or p.l2_prefetch)]  # (their swap-AB and prefetching twins: test_tile_ops)
    assert [p.splits_at(65536) for p in small] == [64]
    assert max(p.splits_at(65536) for p in plans if p.block_n == 256) == 65536 // 256 // skv.TILES_PER_SMALL_SPLIT
    # with few KV rows the small-split candidate stays within the per-SM cap, at any length
    site = AttentionSite.canonical(kv_len=524288, q_heads=32, kv_heads=8, head_dim=128)
    plans = list(get_strategy("split_kv").candidates(site, H100, CUDA_CTX))
    assert max(p.num_splits for p in plans) * 8 <= skv.MAX_SMALL_PROGRAMS_PER_SM * H100.sm_count


def _op_call(plan, q, k, v, mask=None, valid=None, causal=False, states=False):
    fn = torch.ops.attnopt.decode_attention_states if states else torch.ops.attnopt.decode_attention
    return fn(q, k, v, mask, valid, 1.0 / math.sqrt(q.shape[-1]), causal, plan.runtime_key(), "test:site")


@pytest.mark.parametrize("plan", [SplitKVPlan(num_splits=3, block_n=16), StreamKPlan(grid=5, block_n=16),
                                  SplitKVPlan(num_splits=4, block_n=16, fused_merge=True),
                                  SplitKVPlan(num_splits=4, block_n=16, chain=True, merge_dv_split=0)],
                         ids=lambda p: p.describe())
@pytest.mark.parametrize("mode", ["reference", "interpret"])
def test_op_runs_strategy_on_cpu(plan, mode, monkeypatch):
    if mode == "interpret":
        pytest.importorskip("triton")
        from attnopt.runtime.kernels import interpreting

        if not interpreting():
            pytest.skip("the Triton interpreter is not on")
        monkeypatch.setenv("ATTNOPT_CPU_KERNELS", "interpret")
    else:
        monkeypatch.delenv("ATTNOPT_CPU_KERNELS", raising=False)
    ops.reset_runtime_state()
    B, Hkv, G, L, N, D = 2, 2, 3, 2, 45, 64
    q = torch.randn(B, Hkv * G, L, D)
    k = torch.randn(B, Hkv, N, D)
    v = torch.randn(B, Hkv, N, D)
    valid = torch.tensor([45, 20], dtype=torch.int32)
    mask = torch.rand(B, 1, L, N) > 0.2
    out = _op_call(plan, q, k, v, mask, valid)
    ref = sdpa_float64(q, k, v, attn_mask=mask, valid_len=valid)
    assert out.dtype == q.dtype and out.shape == (B, Hkv * G, L, D)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
    o, lse = _op_call(plan, q, k, v, mask, valid, states=True)
    assert o.dtype == torch.float32 and lse.dtype == torch.float32
    _, ref_lse = attention_states(q, k, v, attn_mask=mask, valid_len=valid, compute_dtype=torch.float64)
    torch.testing.assert_close(o.double(), ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=2e-5)
    ops.reset_runtime_state()


@pytest.mark.cuda
@pytest.mark.parametrize("kind", KINDS)
def test_candidates_run_on_cuda(kind):
    dev = torch.device("cuda")
    s = get_strategy(kind)
    for dtype, (B, Hq, Hkv, L, N, D) in ((torch.bfloat16, (1, 32, 8, 1, 8191, 128)),
                                         (torch.float16, (3, 9, 3, 4, 1000, 64)),
                                         (torch.bfloat16, (1, 6, 1, 1, 333, 256))):
        site = AttentionSite.canonical(batch=B, q_heads=Hq, kv_heads=Hkv, head_dim=D, q_len=L, kv_len=N,
                                       dtype=str(dtype).split(".")[-1])
        q = torch.randn(B, Hq, L, D, device=dev, dtype=dtype)
        k = torch.randn(B, Hkv, N, D, device=dev, dtype=dtype)
        v = torch.randn(B, Hkv, N, D, device=dev, dtype=dtype)
        ref = sdpa_float64(q, k, v)
        for plan in s.candidates(site, H100, CUDA_CTX):
            state = s.prepare(plan, q, k, v)
            out = s.run(state, plan, q, k, v, None, None, None, False)
            err = ((out.double() - ref).norm() / ref.norm()).item()
            assert err < 1e-2, f"{plan.describe()} rel err {err:.2e}"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_candidates_fit_shared_memory(kind, dtype, head_dim):
    """Every candidate's K/V pipeline fits the shared-memory budget (else the launch fails on the GPU)."""
    from attnopt.runtime.strategies.split_kv import SMEM_BUDGET, smem_bytes

    site = AttentionSite.canonical(head_dim=head_dim, dtype=dtype, kv_len=65536)
    plans = list(get_strategy(kind).candidates(site, H100, CUDA_CTX))
    assert plans
    for p in plans:
        assert smem_bytes(site, p.block_n, p.num_stages, getattr(p, "head_chunks", False)) <= SMEM_BUDGET, p.describe()
