"""Fully masked rows across ranks (gloo, 4 processes on 127.0.0.1, under a deadline): every tree and ring variant
against single-device float64 attention.

A row hidden whole by ``finfo.min`` gives the mean of V over its keys in eager attention and SDPA: fp32 absorbs the
scores into the bias, so every key ties. Each rank's state then has a row max near -3.4e38, where ``m + log l``
rounds to ``m``: a merge of whole LSEs weighed every rank alike instead of by its key count. The states crossing
ranks keep ``m`` and ``log l`` apart. Shards here are deliberately unequal (2, 7, 0 and 14 keys), one rank holds no
key at all, and some rows have their only visible keys on one rank.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_distributed import ok_payloads, run_ranks  # noqa: E402  (the gloo harness)

ATOL = 2e-5  # fp32 inputs against the float64 oracle
#: Global key ranges of the four ranks: unequal, and rank 2 holds none.
BOUNDS = [(0, 2), (2, 9), (9, 9), (9, 23)]
N = BOUNDS[-1][1]


def _masks() -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """name -> (global mask (B, Hm, L, N), valid_len or None); B = 2, Hq = 6, L = 3."""
    g = torch.Generator().manual_seed(17)
    low = torch.finfo(torch.float32).min
    additive = torch.rand(2, 1, 3, N, generator=g) * -2.0
    additive[0, :, 0] = low  # every key at finfo.min: the mean of V over all 23 keys
    additive[1, :, 1] = float("-inf")  # every key -inf: 0
    additive[1, :, 0, :12] = low  # partly finfo.min: an ordinary row
    additive[0, :, 2] = low
    additive[0, :, 2, 3:5] = 0.0  # visible keys on rank 1 only; the others hold finfo.min or nothing
    boolean = torch.rand(2, 1, 3, N, generator=g) > 0.3
    boolean[0, :, 1] = False  # every key hidden: 0
    boolean[1, :, 2] = False
    boolean[1, :, 2, 10:12] = True  # visible keys on rank 3 only
    per_head = torch.zeros(2, 6, 3, N)
    per_head[:, :2] = low  # heads 0 and 1 hidden by finfo.min, the others see everything
    per_head[1, 4, :, ::2] = float("-inf")
    bias_minus_inf = torch.where(boolean, 0.0, float("-inf"))
    return {
        "finfo_min_fp32": (additive, None),
        "bool": (boolean, None),
        "minus_inf_additive": (bias_minus_inf, None),
        "finfo_min_per_head": (per_head, None),
        # valid lengths on top: row 0 keeps 20 keys (rank 3 holds 11 of them), row 1 keeps 5 (rank 3 none)
        "finfo_min_fp32_valid_len": (additive, torch.tensor([20, 5])),
    }


def _inputs():
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 6, 3, 16, generator=g)
    k = torch.randn(2, 2, N, 16, generator=g)
    v = torch.randn(2, 2, N, 16, generator=g)
    return q, k, v


def _variants():
    """(kind, collective or variant, hierarchical, local attention)."""
    out = [("tree", c, h, "auto") for h in (False, True) for c in ("all_gather", "all_reduce", "all_reduce3")]
    # the dense strategy's run_states as the local attention (the single-device kinds' split states)
    out += [("tree", "all_gather", False, "dense"), ("ring", "pass_q", False, "dense")]
    return out + [("ring", "pass_kv", False, "auto"), ("ring", "pass_q", False, "auto")]


def _masked_battery(rank, world):
    from attnopt.runtime import distributed as D
    from attnopt.runtime.reference import sdpa_float64

    group = D.register_group(timeout=20, ranks_per_node=2, name="masked")
    lo, hi = BOUNDS[rank]
    q, k, v = _inputs()
    results = {}
    for name, (mask, valid) in _masks().items():
        ref = sdpa_float64(q, k, v, attn_mask=mask, valid_len=valid)
        local_mask = mask[..., lo:hi]
        local_valid = None if valid is None else (valid - lo).clamp(0, hi - lo)
        for kind, variant, hier, local in _variants():
            if kind == "tree":
                out = D.tree_decode(q, k[:, :, lo:hi], v[:, :, lo:hi], group, collective=variant, hierarchical=hier,
                                    attn_mask=local_mask, valid_len=local_valid, local=local)
            else:
                out = D.ring_decode(q, k[:, :, lo:hi], v[:, :, lo:hi], group, variant=variant, attn_mask=local_mask,
                                    valid_len=local_valid, local=local)
            results[(name, kind, variant, hier, local)] = (out.double() - ref).abs().max().item()
    return results


@pytest.mark.timeout(240)
def test_fully_masked_rows_across_unequal_shards_match_single_device():
    res = ok_payloads(run_ranks(_masked_battery, 4, deadline=200))
    bad = {(r, key): err for r in res for key, err in res[r].items() if not err <= ATOL}
    assert len(res[0]) == len(_masks()) * len(_variants())
    assert not bad, f"off the float64 reference (atol {ATOL}): {bad}"


def test_whole_lse_states_would_weigh_ranks_alike():
    """The failure the split states fix, shown without processes: merging whole LSEs of a finfo.min row weighs the
    partitions equally (far from the mean of V), merging (m, log l) weighs them by their key counts."""
    from attnopt.runtime.distributed import merge_packed
    from attnopt.runtime.reference import attention_states, sdpa_float64

    q, k, v = _inputs()
    mask = torch.full((1, 1, 1, N), torch.finfo(torch.float32).min)
    ref = sdpa_float64(q[:1, :, :1], k[:1], v[:1], attn_mask=mask)
    states = [attention_states(q[:1, :, :1], k[:1, :, lo:hi], v[:1, :, lo:hi], attn_mask=mask[..., lo:hi],
                               split_lse=True) for lo, hi in BOUNDS]
    packed = torch.stack([torch.cat([o, m[..., None], ll[..., None]], -1) for o, m, ll in states])
    o, _ = merge_packed(packed)
    assert (o.double() - ref).abs().max().item() < ATOL
    whole = packed.clone()
    whole[..., -2] += whole[..., -1]  # lse = m + log l rounds to m
    whole[..., -1] = torch.where(torch.isneginf(whole[..., -2]), float("-inf"), 0.0)
    o_whole, _ = merge_packed(whole)
    assert (o_whole.double() - ref).abs().max().item() > 0.05
