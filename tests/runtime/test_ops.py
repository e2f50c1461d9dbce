"""torch.ops.attnopt.*: eager calls, fake implementations under torch.compile / export, verification errors."""
import pytest
import torch

import attnopt.runtime.ops as ops
from attnopt.plan import DensePlan
from attnopt.runtime import reference

DENSE = DensePlan().runtime_key()


def _qkv(B=2, Hq=6, Hkv=2, L=2, N=19, D=64):
    return torch.randn(B, Hq, L, D), torch.randn(B, Hkv, N, D), torch.randn(B, Hkv, N, D)


def test_decode_attention_counts_calls_and_matches_reference():
    ops.reset_runtime_state()
    q, k, v = _qkv()
    vl = torch.tensor([5, 19], dtype=torch.int32)
    for _ in range(3):
        out = torch.ops.attnopt.decode_attention(q, k, v, None, vl, 0.1, False, DENSE, "t:site")
    torch.testing.assert_close(out.double(), reference.sdpa_float64(q, k, v, valid_len=vl, scale=0.1),
                               atol=1e-5, rtol=1e-5)
    assert ops.CALL_COUNTS["t:site"] == 3


def test_fake_impls_trace_under_compile_and_export():
    q, k, v = _qkv()

    def f(q, k, v, mask):
        vl = torch.ops.attnopt.valid_len_from_mask(mask, q.shape[0])
        o = torch.ops.attnopt.decode_attention(q, k, v, mask, vl, 0.125, False, DENSE, "t:compiled")
        o2, lse = torch.ops.attnopt.decode_attention_states(q, k, v, mask, vl, 0.125, False, DENSE, "t:states")
        return o + 1, o2, lse

    mask = torch.rand(2, 1, 2, 19) > 0.3
    mask[..., 0] = True
    eager = f(q, k, v, mask)
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v, mask)
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b)


def test_merge_states_op_matches_reference():
    o = torch.randn(4, 2, 3, 1, 8)
    lse = torch.randn(4, 2, 3, 1)
    lse[2] = float("-inf")
    got = torch.ops.attnopt.merge_states(o, lse)
    want = reference.merge_states(o, lse)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])


def test_check_close_raises_with_site_and_error():
    ops.reset_runtime_state()
    ref = torch.zeros(4)
    new = ref.clone()
    new[1] = 0.5
    with pytest.raises(ops.VerificationError, match=r"site g0:sdpa_3 .* max abs error 5\.000e-01 > tolerance atol=0\.001"):
        torch.ops.attnopt.check_close(new, ref, "g0:sdpa_3", 1e-3, 0.0, 2)


def test_check_close_stops_checking_after_n_calls():
    ops.reset_runtime_state()
    ref = torch.zeros(3)
    ok = torch.ops.attnopt.check_close(ref + 1e-6, ref, "s", 1e-3, 0.0, 1)
    assert torch.equal(ok, ref + 1e-6)
    torch.ops.attnopt.check_close(ref + 1.0, ref, "s", 1e-3, 0.0, 1)  # second call: no longer verified


def test_unknown_plan_kind_is_a_clear_error():
    q, k, v = _qkv()
    bad = '{"data": {}, "kind": "warp", "version": 1}'
    with pytest.raises(ValueError, match="registered kinds"):
        torch.ops.attnopt.decode_attention(q, k, v, None, None, 0.1, False, bad, "s")


@pytest.mark.parametrize("bad, match", [
    (dict(k=torch.randn(2, 4, 19, 64), v=torch.randn(2, 4, 19, 64)), "multiple of KV heads"),
    (dict(k=torch.randn(1, 2, 19, 64), v=torch.randn(1, 2, 19, 64)), "batch sizes differ"),
    (dict(v=torch.randn(2, 2, 18, 64)), "differ in batch, heads or length"),
    (dict(k=torch.randn(2, 2, 19, 32)), "head dims differ"),
    (dict(valid_len=torch.tensor([5, 6, 7], dtype=torch.int32)), r"shape \(B,\)"),
    (dict(valid_len=torch.tensor([5.0, 6.0])), "int32 or int64"),
    (dict(attn_mask=torch.ones(2, 1, 2, 19, dtype=torch.int64)), "bool .* or floating"),
    (dict(attn_mask=torch.ones(3, 1, 2, 19, dtype=torch.bool)), "does not broadcast"),
    (dict(attn_mask=torch.ones(2, 1, 2, 7, dtype=torch.bool)), "does not broadcast"),
])
@pytest.mark.parametrize("plan", ["dense", "split_kv", "stream_k"])
def test_bad_inputs_raise_clear_errors(bad, match, plan):
    from attnopt.plan import SplitKVPlan, StreamKPlan

    ops.reset_runtime_state()
    key = {"dense": DENSE, "split_kv": SplitKVPlan(num_splits=2, block_n=16).runtime_key(),
           "stream_k": StreamKPlan(grid=3, block_n=16).runtime_key()}[plan]
    q, k, v = _qkv()
    args = dict(q=q, k=k, v=v, attn_mask=None, valid_len=None) | bad
    with pytest.raises(ValueError, match=match):
        torch.ops.attnopt.decode_attention(args["q"], args["k"], args["v"], args["attn_mask"], args["valid_len"],
                                           0.125, False, key, "t:bad")


def test_zero_splits_or_grid_is_a_clear_error():
    from attnopt.plan import SplitKVPlan, StreamKPlan

    q, k, v = _qkv()
    for plan, match in ((SplitKVPlan(num_splits=0, block_n=16), "num_splits"), (StreamKPlan(grid=0, block_n=16), "grid")):
        ops.reset_runtime_state()
        with pytest.raises(ValueError, match=match):
            torch.ops.attnopt.decode_attention(q, k, v, None, None, 0.125, False, plan.runtime_key(), "t:zero")
    with pytest.raises(ValueError, match="num_partitions"):
        reference.decode_attention(q, k, v, num_partitions=0)


@pytest.mark.parametrize("q_len", [1, 7])
def test_outputs_have_the_strides_the_fake_declares(monkeypatch, q_len):
    """SDPA's flash and cuDNN kernels return a transposed view of (B, L, H, D) memory; the op must still hand back
    the layout its fake declares, or inductor (which trusts the fake) fails on a multi-token prompt (H100: a
    7-token prompt over a static cache, 'expected stride 448, got 64')."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from attnopt.runtime.strategies import dense

    real = dense._sdpa

    def flash_layout(*args, **kwargs):
        return real(*args, **kwargs).transpose(1, 2).contiguous().transpose(1, 2)

    monkeypatch.setattr(dense, "_sdpa", flash_layout)
    ops.reset_runtime_state()
    q, k, v = _qkv(L=q_len)
    out = torch.ops.attnopt.decode_attention(q, k, v, None, None, 0.1, False, DENSE, "t:layout")
    with FakeTensorMode() as mode:
        fake = torch.ops.attnopt.decode_attention(mode.from_tensor(q), mode.from_tensor(k), mode.from_tensor(v),
                                                  None, None, 0.1, False, DENSE, "t:layout")
    assert out.stride() == fake.stride()
    torch.testing.assert_close(out.double(), reference.sdpa_float64(q, k, v, scale=0.1), atol=1e-5, rtol=1e-5)
