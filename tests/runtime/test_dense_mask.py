"""The dense plan hands SDPA a bool mask already made additive, in one kernel (runtime/strategies/dense.py): the
outputs equal SDPA's with the bool mask itself, rows with no visible key included, on the CPU and, compiled, on a
GPU's cuDNN and auto backends."""
import pytest
import torch
import torch.nn.functional as F

from attnopt.plan import DensePlan
from attnopt.runtime.strategies import dense, get_strategy


def _backend(name):
    """SDPA restricted to the backend ``name``; ``auto``: SDPA's own pick."""
    import contextlib

    return contextlib.nullcontext() if name == "auto" else torch.nn.attention.sdpa_kernel([dense._sdpa_backend(name)])


def _case(device="cpu", dtype=torch.float32, B=3, Hq=8, Hkv=2, L=2, N=37, D=64):
    g = torch.Generator(device=device).manual_seed(7)
    q = torch.randn(B, Hq, L, D, device=device, dtype=dtype, generator=g)
    k = torch.randn(B, Hkv, N, D, device=device, dtype=dtype, generator=g)
    v = torch.randn(B, Hkv, N, D, device=device, dtype=dtype, generator=g)
    keep = torch.arange(N, device=device)[None, :] < torch.tensor([N, 5, 20], device=device)[:, None]
    mask = keep[:, None, None, :].expand(B, 1, L, N).clone()
    mask[2, 0, 1] = False  # a query row with no visible key
    return q, k, v, mask


def test_a_bool_mask_becomes_zero_and_minus_inf_in_qs_dtype_once_prepared():
    q, k, v, mask = _case(dtype=torch.float64)  # a dtype no other test prepared
    dense._MASK_VALUES.pop((q.device, q.dtype), None)
    assert dense.additive_mask(mask, q.dtype) is mask  # not prepared: SDPA converts it, nothing is made here
    get_strategy("dense").prepare(DensePlan(), q, k, v)
    out = dense.additive_mask(mask, q.dtype)
    assert out.dtype == torch.float64 and out.shape == mask.shape
    assert torch.equal(out == 0, mask) and bool(torch.isneginf(out[~mask]).all())
    additive = torch.zeros(mask.shape, dtype=q.dtype)
    assert dense.additive_mask(additive, q.dtype) is additive and dense.additive_mask(None, q.dtype) is None


def _check_equal_to_sdpa(backend, tol=0.0, **case):
    q, k, v, mask = _case(**case)
    plan = DensePlan(backend=backend)
    strategy = get_strategy("dense")
    state = strategy.prepare(plan, q, k, v)
    out = strategy.run(state, plan, q, k, v, mask, None, 0.125, False)
    with _backend(backend):
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125, enable_gqa=True)
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol, equal_nan=True)
    assert bool(torch.isnan(out[2, :, 1]).all()) == bool(torch.isnan(ref[2, :, 1]).all())  # the row with no key


@pytest.mark.parametrize("backend", ["auto", "math"])
def test_the_dense_run_equals_sdpa_with_the_bool_mask(backend):
    _check_equal_to_sdpa(backend)


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["cudnn", "auto"])
def test_the_dense_run_equals_sdpa_with_the_bool_mask_on_a_gpu(backend):
    # one bf16 rounding apart at most, should SDPA's own conversion pick another kernel variant
    _check_equal_to_sdpa(backend, tol=1e-2, device="cuda", dtype=torch.bfloat16, N=4096)
