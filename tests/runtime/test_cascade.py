"""The shared-prefix cascade: its reference, its kernels (Triton interpreter), its op and its plan, against the
float64 SDPA oracle over the concatenated K/V and against the plain split-KV plan."""
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import attnopt.runtime.ops  # noqa: F401  (registers torch.ops.attnopt.*)
from attnopt.hardware import builtin_profile
from attnopt.plan import CascadePlan, SplitKVPlan
from attnopt.runtime import reference, reference_cascade
from attnopt.runtime.strategies import PlanContext, get_strategy
from attnopt.site import AttentionSite


def _inputs(B, Hq, Hkv, L, P, S, D, dtype=torch.float32, mask=None):
    """q, the shared prefix, the suffixes, the concatenated K/V a plain plan reads, and a mask over P + S keys:
    ``None``, ``"bool"`` (random, with row 0 fully hidden), ``"min"`` (additive 0 / finfo.min, every key of row 0 at
    finfo.min) or ``"neginf"`` (additive 0 / -inf with row 0 fully hidden)."""
    q = torch.randn(B, Hq, L, D, dtype=dtype)
    kp, vp = torch.randn(1, Hkv, P, D, dtype=dtype), torch.randn(1, Hkv, P, D, dtype=dtype)
    ks, vs = torch.randn(B, Hkv, S, D, dtype=dtype), torch.randn(B, Hkv, S, D, dtype=dtype)
    k = torch.cat([kp.expand(B, -1, -1, -1), ks], dim=2)
    v = torch.cat([vp.expand(B, -1, -1, -1), vs], dim=2)
    m = None
    if mask is not None:
        keep = torch.rand(B, 1, L, P + S) > 0.3
        keep[0] = False
        if mask == "bool":
            m = keep
        else:
            fill = torch.finfo(dtype).min if mask == "min" else float("-inf")
            m = torch.zeros(B, 1, L, P + S, dtype=dtype).masked_fill(~keep, fill)
    return q, (kp, vp, ks, vs), k, v, m


def _oracle(q, k, v, m, scale):
    return reference.sdpa_float64(q, k, v, attn_mask=m, scale=scale)


def _op(q, parts, m, valid_len, scale, plan=None):
    plan = plan or CascadePlan(prefix_splits=3, suffix_splits=2, block_n=16)
    return torch.ops.attnopt.cascade_attention(q, *parts, m, valid_len, scale, False, plan.runtime_key(), "test")


# ------------------------------------------------------------------------------------------------ the reference
@pytest.mark.parametrize("B,Hq,Hkv,L,P,S", [(3, 4, 2, 1, 37, 5), (2, 6, 2, 3, 16, 1), (4, 3, 3, 2, 0, 9),
                                            (2, 8, 1, 1, 65, 0), (5, 4, 4, 4, 7, 7)])
@pytest.mark.parametrize("mask", [None, "bool", "min", "neginf"])
def test_reference_cascade_equals_attention_over_the_concatenation(B, Hq, Hkv, L, P, S, mask):
    q, parts, k, v, m = _inputs(B, Hq, Hkv, L, P, S, 64, mask=mask)
    if P + S == 0:
        pytest.skip("no keys")
    valid_len = reference.valid_len_from_mask(m, B) if m is not None else None
    o, lse = reference_cascade.cascade_attention_states(q, *parts, attn_mask=m, valid_len=valid_len, scale=0.2)
    torch.testing.assert_close(o.double(), _oracle(q, k, v, m, 0.2), atol=2e-6, rtol=2e-6)
    _, lse_plain = reference.attention_states(q, k, v, attn_mask=m, scale=0.2)
    torch.testing.assert_close(lse, lse_plain, atol=1e-4, rtol=1e-5)


def test_finfo_min_row_is_the_mean_of_v_weighted_by_key_counts():
    """A row whose every key carries finfo.min gives SDPA's mean of V over all P + S keys: the merge must weigh the
    prefix by P and the suffix by S (row max and log l kept apart), not equally."""
    q, parts, k, v, _ = _inputs(2, 2, 1, 1, 40, 3, 64)
    m = torch.full((2, 1, 1, 43), torch.finfo(torch.float32).min)
    o, _ = reference_cascade.cascade_attention_states(q, *parts, attn_mask=m, scale=0.1)
    mean_v = v.double().mean(dim=2, keepdim=True).expand(2, 2, 1, 64)
    torch.testing.assert_close(o.double(), mean_v, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------- kernels (interpreter)
@pytest.fixture
def interpret(monkeypatch):
    from attnopt.runtime.kernels import triton_usable

    if not triton_usable("cpu"):  # a GPU machine compiles Triton for the GPU: the cuda-marked tests cover it there
        pytest.skip("Triton interpreter unavailable")
    monkeypatch.setenv("ATTNOPT_CPU_KERNELS", "interpret")
    attnopt.runtime.ops.reset_runtime_state()
    yield
    attnopt.runtime.ops.reset_runtime_state()


@pytest.mark.parametrize("B,Hq,Hkv,L,P,S,dtype,mask,D", [
    (3, 4, 2, 1, 70, 5, torch.float16, None, 64),     # G = 2, the prefix over several tiles and splits
    (3, 3, 1, 2, 33, 9, torch.float32, "bool", 64),   # L > 1: the (Hq, B, L) workspace layout; row 0 fully hidden
    (2, 6, 2, 1, 40, 0, torch.float16, "min", 64),    # no suffix yet; finfo.min row
    (2, 4, 4, 1, 0, 7, torch.float32, "neginf", 64),  # no prefix
    (3, 4, 2, 1, 70, 5, torch.float16, "bool", 80),   # a head dim that is not a power of two
])
def test_kernel_cascade_matches_oracle_and_plain_split_kv(interpret, B, Hq, Hkv, L, P, S, dtype, mask, D):
    q, parts, k, v, m = _inputs(B, Hq, Hkv, L, P, S, D, dtype=dtype, mask=mask)
    valid_len = reference.valid_len_from_mask(m, B) if m is not None else None
    # TMA tiles (tensor descriptors; the interpreter runs them) on the permuted prefix and suffix views
    out = _op(q, parts, m, valid_len, 0.15, plan=CascadePlan(prefix_splits=3, suffix_splits=2, block_n=16, tma=True))
    tol = 2e-3 if dtype == torch.float16 else 1e-5
    ref = _oracle(q, k, v, m, 0.15)
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    plain = SplitKVPlan(num_splits=2, block_n=16)
    strategy = get_strategy("split_kv")
    plain_out = strategy.run(strategy.prepare(plain, q, k, v), plain, q, k, v, m, valid_len, 0.15, False)
    torch.testing.assert_close(out.float(), plain_out.float(), atol=tol, rtol=tol)


def test_non_cascade_bucket_runs_on_the_concatenation(interpret):
    """A bucketed plan (from the tuner) whose bucket for this length is not a cascade reads the concatenated K/V."""
    from attnopt.plan import BucketedPlan

    q, parts, k, v, m = _inputs(2, 4, 2, 1, 20, 4, 64, mask="bool")
    plan = BucketedPlan(bounds=(16, 1024), plans=(CascadePlan(block_n=16).runtime_key(),
                                                  SplitKVPlan(num_splits=2, block_n=16).runtime_key()))
    out = _op(q, parts, m, reference.valid_len_from_mask(m, 2), 0.1, plan=plan)
    torch.testing.assert_close(out.double(), _oracle(q, k, v, m, 0.1), atol=1e-5, rtol=1e-5)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(B=st.integers(1, 5), kv_heads=st.integers(1, 3), group=st.sampled_from([1, 2, 3]), L=st.integers(1, 4),
       P=st.integers(0, 80), S=st.integers(0, 20), D=st.sampled_from([64, 80]),
       mask=st.sampled_from([None, "bool", "min", "neginf"]), seed=st.integers(0, 2**16))
def test_fuzz_cascade_reference_and_op(B, kv_heads, group, L, P, S, D, mask, seed):
    """Random shapes and masks: the cascade op (CPU path: the reference's cascade) equals SDPA over the
    concatenated K/V in float64."""
    if P + S == 0:
        return
    torch.manual_seed(seed)
    q, parts, k, v, m = _inputs(B, kv_heads * group, kv_heads, L, P, S, D, mask=mask)
    valid_len = reference.valid_len_from_mask(m, B) if m is not None else None
    out = _op(q, parts, m, valid_len, 1 / math.sqrt(D))
    torch.testing.assert_close(out.double(), _oracle(q, k, v, m, 1 / math.sqrt(D)), atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------ op errors
@pytest.mark.parametrize("change,match", [
    (lambda a: {**a, "valid_len": torch.tensor([3, 3])}, "valid_len needs the attn_mask"),
    (lambda a: {**a, "is_causal": True}, "is_causal is not supported"),
    (lambda a: {**a, "kp": a["kp"].expand(2, -1, -1, -1)}, r"must be \(1, Hkv, P, D\)"),
    (lambda a: {**a, "ks": a["ks"][:, :1]}, "differ in heads"),
    (lambda a: {**a, "mask": torch.ones(2, 1, 1, 5, dtype=torch.bool)}, "does not broadcast"),
])
def test_cascade_op_rejects_bad_inputs(change, match):
    q, (kp, vp, ks, vs), *_ = _inputs(2, 4, 2, 1, 6, 2, 64)
    a = change(dict(q=q, kp=kp, vp=vp, ks=ks, vs=vs, mask=None, valid_len=None, is_causal=False))
    attnopt.runtime.ops.reset_runtime_state()
    with pytest.raises(ValueError, match=match):
        torch.ops.attnopt.cascade_attention(a["q"], a["kp"], a["vp"], a["ks"], a["vs"], a["mask"], a["valid_len"],
                                            0.1, a["is_causal"], CascadePlan().runtime_key(), "bad")


# ------------------------------------------------------------------------------------------------ the plan
def _site(**kw):
    base = dict(batch=16, kv_len=32768 + 64, shared_prefix=32768)
    base.update(kw)
    return AttentionSite.canonical(**base)


@pytest.mark.parametrize("site,reason", [
    (AttentionSite.canonical(batch=16), "not provably one prefix shared"),
    (_site(batch=1), "batch of 1"),
    (_site(batch=None), "symbolic batch"),
    (_site(is_causal=True), "is_causal"),
    (_site(head_dim=72), "head_dim 72"),
])
def test_cascade_check_reasons(site, reason):
    ctx = PlanContext(device_type="cuda", triton_available=True)
    assert reason in get_strategy("cascade").check(site, builtin_profile("h100-sxm"), ctx)


def test_cost_model_picks_the_cascade_when_rows_share_a_long_prefix():
    """16 rows over a 32k prefix: the cascade reads the prefix about once instead of 16 times, and the planner
    ranks it first, well ahead of the best plain plan; with 1 row's worth of sharing gone it does not apply."""
    from attnopt.config import OptimizeConfig
    from attnopt.passes.plan import rank_candidates

    ctx = PlanContext(device_type="cuda", triton_available=True)
    hw = builtin_profile("h100-sxm")
    ranked, _ = rank_candidates(_site(), hw, ctx, OptimizeConfig())
    assert ranked[0].kind == "cascade"
    best_plain = min(p.est_us for p in ranked if p.kind != "cascade")
    assert best_plain / ranked[0].est_us > 4
    # a short prefix with long suffixes: little to share, the plain plans stay competitive
    short, _ = rank_candidates(_site(kv_len=32768 + 64, shared_prefix=64), hw, ctx, OptimizeConfig())
    cascade = min(p.est_us for p in short if p.kind == "cascade")
    plain = min(p.est_us for p in short if p.kind != "cascade")
    assert cascade > 0.8 * plain


# ------------------------------------------------------------------------------------------------ on a GPU
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("L,mask", [(1, None), (1, "bool"), (2, "min")])
def test_cascade_compiled_on_gpu_and_under_graph_replay(dtype, L, mask):
    """16 rows over a 4k prefix, llama3-8b heads: compiled kernels against the float64 oracle, and a captured CUDA
    graph replayed after the inputs change in place gives the new inputs' result."""
    attnopt.runtime.ops.reset_runtime_state()
    torch.manual_seed(0)
    q, parts, k, v, m = (x.cuda() if isinstance(x, torch.Tensor) else x
                         for x in _inputs(16, 32, 8, L, 4096, 64, 128, dtype=dtype, mask=mask))
    parts = tuple(p.cuda() for p in parts)
    valid_len = reference.valid_len_from_mask(m, 16) if m is not None else None
    plan = CascadePlan(prefix_splits=16, suffix_splits=2, block_n=64, num_stages=3, tma=True)
    out = _op(q, parts, m, valid_len, 128 ** -0.5, plan=plan)
    torch.testing.assert_close(out.double(), _oracle(q, k, v, m, 128 ** -0.5), atol=2e-2, rtol=2e-2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _op(q, parts, m, valid_len, 128 ** -0.5, plan=plan)
    q.copy_(torch.randn_like(q))
    parts[0].copy_(torch.randn_like(parts[0]))
    graph.replay()
    k = torch.cat([parts[0].expand(16, -1, -1, -1), parts[2]], dim=2)
    torch.testing.assert_close(captured.double(), _oracle(q, k, v, m, 128 ** -0.5), atol=2e-2, rtol=2e-2)


def test_tuner_times_a_cascade_site_on_its_own_inputs_and_keys_it_apart():
    """``attnopt.tuning`` times a cascade candidate through ``Cascade.timed_call`` (row 0's first P keys as the
    prefix), and a shared-prefix site's measurements are cached under their own key."""
    import dataclasses

    from attnopt.tuning import ShapeKey, TuningCache, site_call, synthetic_inputs

    site = AttentionSite.canonical(batch=3, q_heads=4, kv_heads=2, head_dim=64, kv_len=50, dtype="float32",
                                   mask_kind="arbitrary", shared_prefix=40)
    plain = dataclasses.replace(site, shared_prefix=None)
    assert TuningCache.key({}, ShapeKey.of(site, 50, False)) != TuningCache.key({}, ShapeKey.of(plain, 50, False))
    assert "shared_prefix" not in TuningCache.key({}, ShapeKey.of(plain, 50, False))
    s = synthetic_inputs(site, 0, device="cpu")
    out = site_call(CascadePlan(prefix_splits=2, suffix_splits=2), site, s)()
    k = torch.cat([s["k"][:1, :, :40].expand(3, -1, -1, -1), s["k"][:, :, 40:]], dim=2)
    v = torch.cat([s["v"][:1, :, :40].expand(3, -1, -1, -1), s["v"][:, :, 40:]], dim=2)
    torch.testing.assert_close(out.double(), _oracle(s["q"], k, v, s["mask"], site.scale or 64 ** -0.5),
                               atol=1e-5, rtol=1e-5)
