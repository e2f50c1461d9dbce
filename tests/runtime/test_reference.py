"""The pure-PyTorch reference: partition-and-merge equals the float64 oracle; merge edge cases."""
import math

import pytest
import torch
import torch.nn.functional as F

from attnopt.runtime import reference as ref


def _inputs(B, Hq, Hkv, L, N, D, dtype=torch.float32):
    q = torch.randn(B, Hq, L, D, dtype=dtype)
    k = torch.randn(B, Hkv, N, D, dtype=dtype)
    v = torch.randn(B, Hkv, N, D, dtype=dtype)
    return q, k, v


@pytest.mark.parametrize("B,Hq,Hkv,L,N,D", [(1, 1, 1, 1, 1, 64), (2, 6, 2, 1, 7, 80), (1, 9, 3, 2, 33, 64),
                                            (3, 8, 1, 4, 129, 128), (1, 4, 4, 3, 5, 96)])
@pytest.mark.parametrize("parts", [1, 2, 5, 64])
@pytest.mark.parametrize("masking", ["none", "bool", "additive", "causal", "valid_len"])
def test_partition_merge_matches_float64(B, Hq, Hkv, L, N, D, parts, masking):
    q, k, v = _inputs(B, Hq, Hkv, L, N, D)
    kw = {}
    if masking == "bool":
        m = torch.rand(B, 1, L, N) > 0.3
        m[..., 0] = True
        kw["attn_mask"] = m
    elif masking == "additive":
        kw["attn_mask"] = torch.randn(B, Hq, L, N)
    elif masking == "causal":
        kw["is_causal"] = True
    elif masking == "valid_len":
        kw["valid_len"] = torch.randint(1, N + 1, (B,), dtype=torch.int32)
    out = ref.decode_attention(q, k, v, num_partitions=parts, **kw)
    oracle = ref.sdpa_float64(q, k, v, **kw)
    torch.testing.assert_close(out.double(), oracle, atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("is_causal", [False, True])
def test_matches_pytorch_sdpa_semantics(is_causal):
    """Top-left causal alignment and GQA head mapping are PyTorch's."""
    q, k, v = _inputs(2, 6, 2, 3, 11, 64)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=True)
    got = ref.decode_attention(q, k, v, is_causal=is_causal, num_partitions=3)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_merge_empty_partitions_no_nan():
    o = torch.randn(3, 2, 4, 8)
    lse = torch.randn(3, 2, 4)
    lse[1] = float("-inf")
    o[1] = 0
    lse[:, 0, 0] = float("-inf")  # a row empty everywhere
    merged_o, merged_lse = ref.merge_states(o, lse)
    assert not torch.isnan(merged_o).any() and not torch.isnan(merged_lse).any()
    assert torch.isneginf(merged_lse[0, 0]) and (merged_o[0, 0] == 0).all()
    keep = torch.tensor([0, 2])
    o2, lse2 = ref.merge_states(o[keep], lse[keep])
    torch.testing.assert_close(merged_o[:, 1:], o2[:, 1:])
    torch.testing.assert_close(merged_lse[:, 1:], lse2[:, 1:])


def test_merge_is_associative_and_commutative():
    q, k, v = _inputs(1, 4, 2, 2, 40, 64)
    parts = [ref.attention_states(q, k, v, kv_start=s, kv_end=s + 10) for s in range(0, 40, 10)]
    o = torch.stack([p[0] for p in parts]); lse = torch.stack([p[1] for p in parts])
    a = ref.merge_states(o, lse)
    left = ref.merge_states(o[:2], lse[:2]); right = ref.merge_states(o[2:], lse[2:])
    b = ref.merge_states(torch.stack([left[0], right[0]]), torch.stack([left[1], right[1]]))
    perm = torch.tensor([3, 1, 0, 2])
    c = ref.merge_states(o[perm], lse[perm])
    whole = ref.attention_states(q, k, v)
    for got in (a, b, c):
        torch.testing.assert_close(got[0], whole[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got[1], whole[1], atol=1e-5, rtol=1e-5)


def test_lse_is_natural_log():
    q, k, v = _inputs(1, 1, 1, 1, 5, 64)
    _, lse = ref.attention_states(q, k, v, scale=0.5)
    s = (q[0, 0] @ k[0, 0].T * 0.5)
    assert math.isclose(lse.item(), torch.logsumexp(s, -1).item(), rel_tol=1e-5)


def test_fully_masked_row_gives_zero():
    q, k, v = _inputs(1, 2, 1, 2, 6, 64)
    mask = torch.ones(1, 1, 2, 6, dtype=torch.bool)
    mask[0, 0, 1] = False
    out = ref.decode_attention(q, k, v, attn_mask=mask, num_partitions=2)
    assert (out[0, :, 1] == 0).all() and not torch.isnan(out).any()


def test_valid_len_from_mask_is_last_visible_plus_one():
    mask = torch.zeros(2, 1, 2, 10, dtype=torch.bool)
    mask[0, 0, 0, :4] = True
    mask[0, 0, 1, 6] = True
    mask[1, 0, :, :9] = True
    assert ref.valid_len_from_mask(mask, 2).tolist() == [7, 9]
    add = torch.zeros(1, 1, 1, 10)
    add[..., 5:] = float("-inf")
    assert ref.valid_len_from_mask(add, 3).tolist() == [5, 5, 5]


def test_head_mismatch_raises():
    q, k, v = _inputs(1, 5, 2, 1, 4, 64)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        ref.attention_states(q, k, v)


@pytest.mark.parametrize("shape", [(19,), (2, 19), (6, 2, 19), (1, 6, 2, 19), (2, 1, 1, 19), (2, 6, 2, 19),
                                   (2, 1, 1, 1), (1, 1, 1, 1), (1,), (2, 1, 2, 1)])
@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_valid_len_from_mask_every_broadcastable_shape(shape, kind):
    """Any mask SDPA broadcasts to (B, Hq, L, N) = (2, 6, 2, 19): the valid length per batch row is exact, i.e.
    attention with it equals attention without it (a key-broadcast mask gives an unlimited length, or 0 when it
    hides every key)."""
    torch.manual_seed(3)
    B, Hq, Hkv, L, N, D = 2, 6, 2, 2, 19, 16
    q, k, v = torch.randn(B, Hq, L, D), torch.randn(B, Hkv, N, D), torch.randn(B, Hkv, N, D)
    keep = torch.rand(shape) > 0.4
    if keep.dim() and keep.shape[-1] > 1:
        keep[..., -6:] = False  # a tail that a valid length can cut
        keep[..., 0] = True
    mask = keep if kind == "bool" else torch.zeros(shape).masked_fill(~keep, float("-inf"))
    vl = ref.valid_len_from_mask(mask, B)
    assert vl.shape == (B,) and vl.dtype == torch.int32
    full = keep.reshape((1,) * (4 - keep.dim()) + tuple(keep.shape)).expand(B, Hq, L, N)
    last = torch.where(full.any(2).any(1), torch.arange(1, N + 1), 0).amax(-1)
    assert bool((vl.clamp(max=N) >= last).all()), (vl, last)
    want = ref.sdpa_float64(q, k, v, attn_mask=mask)
    got = ref.sdpa_float64(q, k, v, attn_mask=mask, valid_len=vl)
    torch.testing.assert_close(got, want)
    if shape[-1] > 1:
        assert vl.tolist() == last.tolist()
