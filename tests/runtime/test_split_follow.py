"""Split-KV grids that follow the cache's length (``SplitKVPlan.tiles_per_split``): the rule, the candidates it
gives a growing cache, and the kernels run through one prepared workspace at lengths of several grids."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from attnopt.hardware import builtin_profile
from attnopt.plan import SplitKVPlan, plan_from_dict, plan_from_json
from attnopt.runtime.reference import sdpa_float64
from attnopt.runtime.strategies import get_strategy
from attnopt.runtime.strategies.base import PlanContext
from attnopt.runtime.strategies import split_kv as skv
from attnopt.site import AttentionSite

H100 = builtin_profile("h100-sxm")
CUDA_CTX = PlanContext(device_type="cuda", triton_available=True)
#: lhs33 of the planner grid: B=8, 4/2 heads, D=80, a growing cache.
LHS33 = AttentionSite.canonical(batch=8, q_heads=4, kv_heads=2, head_dim=80, kv_len=1472)


def test_splits_follow_the_length_within_the_workspace():
    fixed = SplitKVPlan(num_splits=12, block_n=128)
    assert [fixed.splits_at(n) for n in (100, 1472, 2048, 10 ** 6)] == [12] * 4
    one = dataclasses.replace(fixed, tiles_per_split=1)
    # one split per 128-key tile, at least 2 (one split is another kernel), at most the workspace's 12
    assert [one.splits_at(n) for n in (1, 128, 129, 1472, 1536, 1537, 10 ** 6)] == [2, 2, 2, 12, 12, 12, 12]
    assert dataclasses.replace(one, num_splits=40).splits_at(2048) == 16
    four = SplitKVPlan(num_splits=64, block_n=256, tiles_per_split=4)
    assert [four.splits_at(n) for n in (1024, 65536, 65536 + 1024, 1 << 20)] == [2, 64, 64, 64]
    assert four.splits_at(16384) == 16
    assert SplitKVPlan(num_splits=1, block_n=64, tiles_per_split=1).splits_at(4096) == 1
    with pytest.raises(ValueError, match="tiles_per_split"):
        SplitKVPlan(tiles_per_split=-1)


def test_the_field_round_trips_and_older_plans_load_fixed():
    plan = SplitKVPlan(num_splits=33, block_n=128, tiles_per_split=1)
    assert plan_from_json(plan.to_json()) == plan
    old = plan.to_dict()
    del old["data"]["tiles_per_split"]
    assert plan_from_dict(old).tiles_per_split == 0


def _effective(plans, n):
    return {(p.splits_at(n), p.block_n, p.num_warps, p.num_stages, p.head_chunks) for p in plans}


@pytest.mark.parametrize("site", [LHS33, AttentionSite.canonical(batch=2, q_heads=24, kv_heads=8, head_dim=80,
                                                                   kv_len=185344),
                                  AttentionSite.canonical(batch=1, q_heads=14, kv_heads=2, head_dim=80, kv_len=370752)],
                         ids=["B8-4/2-d80", "B2-24/8-d80", "B1-14/2-d80"])
def test_a_bucket_runs_at_each_length_as_the_candidates_planned_there(site):
    """A bucket is tuned at its middle and run over (low, high], within sqrt(2) of it: every candidate planned at
    the middle runs, at each length of the bucket, a grid that the candidates planned at that length hold too (the
    wave-sized grids capped by the tiles there, the small splits at four tiles each). With fixed split counts this
    failed where the middle's tiles capped a grid (B=8 4/2 D=80: 12 splits at 1472 keys stayed 12 at 2048)."""
    s = get_strategy("split_kv")
    middle = list(s.candidates(site, H100, CUDA_CTX))
    for n in (site.kv_len * 3 // 4, site.kv_len + 1, site.kv_len * 4 // 3, site.kv_len * 141 // 100):
        there = list(s.candidates(dataclasses.replace(site, kv_len=n), H100, CUDA_CTX))
        mine = {c for c in _effective(middle, n) if c[0] > 2}  # (a grid of 2 is the floor of a tiny length)
        model = {(p.num_splits, p.block_n, p.num_warps) for p in there if p.tiles_per_split == 0}
        assert mine <= _effective(there, n) | {c for c in mine if c[:3] in model}, n


def test_the_one_tile_grid_of_lhs33_keeps_one_tile_per_split():
    """The H100 case (e052280): tuned at 1472 keys, run at 2048 with 12 splits of 128 keys, 4 of them two tiles.
    The 128-key candidates of one tile per split at 1472 keep one at 2048 (16 splits), where no fixed grid of the
    middle's candidates could (12 was the most): of the wave-sized grids that 12 tiles cap alike (12, 25 and 50 for
    4 warps and 2 stages), the largest is planned."""
    plans = [p for p in get_strategy("split_kv").candidates(LHS33, H100, CUDA_CTX) if p.block_n == 128]
    widest = [p for p in plans if p.splits_at(1472) == 12]
    assert widest and all(p.splits_at(2048) == 16 for p in widest)
    assert all(p.num_splits <= 12 for p in plans if p.tiles_per_split == 0)  # (the cost model's own, fixed)


@pytest.mark.parametrize("kw,keys", [({"window": 4096}, 4096), ({"mask_kind": "valid_length"}, 32768),
                                     ({"mask_kind": "arbitrary"}, 32768)], ids=["window", "static", "mask"])
def test_masked_sites_keep_fixed_grids(kw, keys):
    """A window's band does not grow with the cache; a static cache's valid keys are timed as a shorter cache (its
    low fill), where a grid sized by the length would not be the run's: fixed grids, capped by the tiles."""
    site = AttentionSite.canonical(kv_len=32768, **kw)
    plans = list(get_strategy("split_kv").candidates(site, H100, CUDA_CTX))
    assert plans and all(p.tiles_per_split == 0 for p in plans)
    assert all(p.num_splits <= -(-keys // p.block_n) for p in plans)


def test_estimates_count_the_grid_of_the_length():
    s = get_strategy("split_kv")
    follow = SplitKVPlan(num_splits=64, block_n=128, num_warps=4, num_stages=3, tma=True, tiles_per_split=1)
    fixed = dataclasses.replace(follow, num_splits=16, tiles_per_split=0)
    site = dataclasses.replace(LHS33, kv_len=2048)  # 16 tiles: the two run 16 splits alike
    assert s.estimate_us(follow, site, H100, CUDA_CTX) == pytest.approx(s.estimate_us(fixed, site, H100, CUDA_CTX))


# ----------------------------------------------------------------------------------------- kernels (interpreter)
def test_one_workspace_runs_every_length(kernel_device, monkeypatch):
    """A plan prepared once (its workspace sized for ``num_splits``) runs lengths of 1 to ``num_splits`` + 3 tiles,
    each with its own grid, exactly; the unused rows of the workspace (filled with NaN) are never merged."""
    dev = kernel_device
    monkeypatch.setenv("ATTNOPT_CPU_KERNELS", "interpret")
    torch.manual_seed(0)
    B, Hkv, G, D, bn = 1, 2, 2, 64, 16
    plan = SplitKVPlan(num_splits=5, block_n=bn, num_warps=4, num_stages=2, tiles_per_split=1)
    strategy = get_strategy("split_kv")
    n_max = (plan.num_splits + 3) * bn
    q = torch.randn(B, Hkv * G, 1, D, device=dev, dtype=torch.float32)
    k_all = torch.randn(B, Hkv, n_max, D, device=dev, dtype=torch.float32)
    v_all = torch.randn(B, Hkv, n_max, D, device=dev, dtype=torch.float32)
    state = strategy.prepare(plan, q, k_all[:, :, :bn], v_all[:, :, :bn])
    o_ws, lse_ws, _ = state.workspace
    assert o_ws.shape[0] == plan.num_splits
    o_ws.fill_(math.nan)
    lse_ws.fill_(math.nan)
    seen = set()
    for n in (1, bn, bn + 1, 3 * bn - 1, 5 * bn, 5 * bn + 1, n_max):
        k, v = k_all[:, :, :n], v_all[:, :, :n]
        seen.add(plan.splits_at(n))
        out = strategy.run(state, plan, q, k, v, None, None, None, False)
        ref = sdpa_float64(q, k, v)
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
    assert seen == {2, 3, 5}


def test_merge_sized_for_more_parts_merges_the_same(kernel_device):
    """``merge_states(max_parts=)`` sizes the partitions per step for the most a call site merges; the result of
    fewer is unchanged."""
    from attnopt.runtime.kernels.merge import merge_states

    dev = kernel_device
    torch.manual_seed(1)
    o = torch.randn(3, 4, 32, device=dev)
    lse = torch.randn(3, 4, device=dev)
    lse[1, 2] = -math.inf
    a, la = merge_states(o, lse)
    b, lb = merge_states(o, lse, max_parts=40)
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(la, lb)


def test_the_split_count_is_not_specialised():
    """A grid that follows the length changes the split count (and so the merge's count) between steps: neither
    may compile another kernel where it is divisible by 16 (Triton specialises other int arguments on it)."""
    from attnopt.runtime.kernels.merge import _merge_states_kernel
    from attnopt.runtime.kernels.split_kv import _split_kv_kernel

    def unspecialised(fn, name):
        if hasattr(fn, "kwargs"):  # the interpreter's function keeps the decorator's arguments
            return name in (fn.kwargs.get("do_not_specialize") or ())
        return {p.name: p for p in fn.params}[name].do_not_specialize

    assert unspecialised(_split_kv_kernel, "NUM_SPLITS") and unspecialised(_merge_states_kernel, "P")


@pytest.mark.parametrize("site", [AttentionSite.canonical(kv_len=8192),
                                  AttentionSite.canonical(batch=1, q_heads=8, kv_heads=1, head_dim=256, q_len=16,
                                                          kv_len=2048)], ids=["canonical", "one-kv-head-q16"])
def test_split_counts_stay_within_the_tiles_and_a_bounded_workspace(site):
    """At the planned length a grid is at most the tiles there; its workspace (``num_splits``) at most
    ``FOLLOW_RANGE`` times that, however many programs an SM could hold (one KV row of q_len 16, D=256: a wave-sized
    grid of thousands of splits would be a workspace of hundreds of MB)."""
    n = site.kv_len
    for bn, w, st in skv.fitting_configs(site):
        T = -(-n // bn)
        for splits, per_split in skv.split_counts(site, H100, bn, w, st):
            plan = SplitKVPlan(num_splits=splits, block_n=bn, tiles_per_split=per_split)
            assert 1 <= plan.splits_at(n) <= max(2, T)
            assert splits <= max(2, skv.FOLLOW_RANGE * T)
