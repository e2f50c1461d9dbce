"""Split-KV over a static cache's mask where the query tile is 32 rows wide and the head dim is padded (80 and 96 to
128): the two planner-bench shapes that came out wrong on the H100 (main 6c52fb6, full grid, first (eager) call).
Alone they are right on the H100 too: the cause was the direct launcher, which served one head dim's compiled kernel
to another in one process (``runtime/kernels/launch.py``; the last test here runs several in a row).

* lhs17: B=38, 10/2 heads, D=80, a cache of 4160 slots holding 520, q_len 4 (20 query rows per KV head):
  S=1/256/8 warps/2 stages gave rel err 0.677 (the cost model's pick), S=3/128/4/2 0.0066 (the tuner's);
* lhs07: B=4, 32/4 heads, D=96, 8768 slots holding 1096, q_len 4 (32 rows): S=8/128/4/3 gave rel err 1.04 (the
  tuner's pick), while S=4/256/8/2 was right (0.0022).

The mask is the bench's: bool (B, 1, q_len, N), contiguous, the prefix visible (so the tile holding the 520th or
1096th key is the one that crosses the valid keys). Each runs by pointer loads (an eager call) and by the copy
engine (``ATTNOPT_TMA_EAGER=1``, as a captured graph runs it), in bf16 on a GPU; in the Triton interpreter (fp16)
at one batch row. The other static q_len-4 cases of the grid (16-row query tiles, or D=64/128) were right.
"""
from __future__ import annotations

import pytest
import torch

from attnopt.runtime.reference import sdpa_float64

triton = pytest.importorskip("triton")

from attnopt.runtime.kernels.split_kv import split_kv_decode, split_kv_workspace  # noqa: E402

#: (name, B, Hq, Hkv, D, N, q_len, valid, [(splits, block_n, warps, stages), ...])
CASES = [
    ("lhs17", 38, 10, 2, 80, 4160, 4, 520, [(1, 256, 8, 2), (3, 128, 4, 2)]),
    ("lhs07", 4, 32, 4, 96, 8768, 4, 1096, [(8, 128, 4, 3), (4, 256, 8, 2)]),
]


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_wide_query_tiles_over_a_static_prefix(kernel_device, monkeypatch, case, tma):
    name, B, Hq, Hkv, D, N, L, valid, configs = case
    dev = kernel_device
    if dev.type == "cpu":
        B = 1  # the interpreter: one batch row
    monkeypatch.setenv("ATTNOPT_TMA_EAGER", "1" if tma else "0")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float16
    g = torch.Generator(device="cpu").manual_seed(1234)
    q = torch.randn(B, Hq, L, D, generator=g).to(dev, dtype)
    k = torch.randn(B, Hkv, N, D, generator=g).to(dev, dtype)
    v = torch.randn(B, Hkv, N, D, generator=g).to(dev, dtype)
    mask = (torch.arange(N, device=dev) < valid)[None, None, None, :].expand(B, 1, L, N).contiguous()
    ref = sdpa_float64(q, k, v, attn_mask=mask)
    errors = {}
    for splits, block_n, warps, stages in configs:
        out = torch.full((B, Hq, L, D), float("nan"), device=dev, dtype=dtype)
        split_kv_decode(q, k, v, out, None, workspace=split_kv_workspace(splits, q, k, v) if splits > 1 else None,
                        attn_mask=mask, num_splits=splits, block_n=block_n, num_warps=warps, num_stages=stages,
                        tma=True)
        errors[f"S{splits}/{block_n}/{warps}/{stages}"] = ((out.double() - ref).norm() / ref.norm()).item()
    assert all(e < 5e-3 for e in errors.values()), f"{name}: relative errors {errors}"


def test_head_dims_of_one_padded_width_in_one_process(kernel_device):
    """What the planner bench's process did: the same launch at D=80, then 96, then 128 (all padded to 128, the
    rest of the launch alike) and again at 80. The direct launcher keyed the head dim (a positional constexpr) by
    Triton's specialisation of an int, so all three ran the kernel compiled for the first (H100, 6c52fb6: every
    D=128 row of ``benchmarks/mask_tiles_bisect.py`` wrong after its D=80 rows). Each against the reference."""
    dev = kernel_device
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float16
    B, Hkv, G, L, N, valid = (2, 2, 5, 4, 1040, 520) if dev.type == "cuda" else (1, 1, 5, 4, 300, 130)
    errors = {}
    for D in (80, 96, 128, 80):
        g = torch.Generator(device="cpu").manual_seed(D)
        q = torch.randn(B, Hkv * G, L, D, generator=g).to(dev, dtype)
        k = torch.randn(B, Hkv, N, D, generator=g).to(dev, dtype)
        v = torch.randn(B, Hkv, N, D, generator=g).to(dev, dtype)
        mask = (torch.arange(N, device=dev) < valid)[None, None, None, :].expand(B, 1, L, N).contiguous()
        for splits in (1, 4):
            out = torch.full_like(q, float("nan"))
            split_kv_decode(q, k, v, out, None, attn_mask=mask, num_splits=splits, block_n=64, num_warps=4,
                            num_stages=2, workspace=split_kv_workspace(splits, q, k, v) if splits > 1 else None)
            ref = sdpa_float64(q, k, v, attn_mask=mask)
            errors[(D, splits)] = ((out.double() - ref).norm() / ref.norm()).item()
    assert all(e < 5e-3 for e in errors.values()), errors
