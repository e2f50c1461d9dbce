"""The shared memory of the decode kernels' configs, as Triton lays them out (``smem_bytes``), and what follows from it:
the deepest pipeline that fits a device and the programs resident per SM. ``runtime/strategies/split_kv.py`` plans
with these; the estimate is checked against compiled kernels (``tests/runtime/test_smem_estimate.py``)."""
from __future__ import annotations

import math

from attnopt.cost.traffic import padded_head_dim
from attnopt.hardware import HardwareProfile
from attnopt.site import AttentionSite

#: Shared memory per block of Hopper (H100, H200), bytes: what a profile's ``smem_per_block_bytes`` of 0 means.
HOPPER_SMEM_PER_BLOCK = 232448
#: What ``smem_bytes`` may leave out: a config plans for the device's shared memory per block less this.
SMEM_MARGIN = 5 * 1024
#: Shared memory a config may plan for on Hopper (``tests/runtime/test_smem_estimate.py`` checks the estimate
#: against the kernels compiled on an H100).
SMEM_BUDGET = HOPPER_SMEM_PER_BLOCK - SMEM_MARGIN


def smem_per_block(hw: HardwareProfile | None) -> int:
    """``hw``'s shared memory per block, bytes (Hopper's without a profile or where the profile says 0)."""
    return (hw.smem_per_block_bytes if hw is not None else 0) or HOPPER_SMEM_PER_BLOCK


def smem_budget(hw: HardwareProfile | None) -> int:
    """Shared memory one program may plan for on ``hw``."""
    return smem_per_block(hw) - SMEM_MARGIN


def on_hopper(hw: HardwareProfile | None) -> bool:
    """Whether ``hw`` lays the kernels out as the H100 measurements of ``smem_bytes`` did (Hopper's shared
    memory; wgmma at 64 rows)."""
    return smem_per_block(hw) == HOPPER_SMEM_PER_BLOCK


def smem_bytes(site: AttentionSite, block_n: int, num_stages: int, head_chunks: bool = False,
               hopper: bool = True, swap_ab: bool = False) -> int:
    """Shared memory of one program (bytes), as Triton lays out the decode kernels on Hopper, plus 1 KB of barriers.

    Head dims are padded to a power of two, or with ``head_chunks`` cut as the kernels cut them
    (``attnopt.cost.traffic.padded_head_dim``); the query tile has ``rows_per_tile`` rows:

    * 64 rows (wgmma, one warpgroup's M): the query tile and ``num_stages`` K/V buffers;
    * 16 or 32 rows (mma): the query tile, ``num_stages - 1`` K/V buffers and the fp32 score tile, staged
      through shared memory between the two products; in fp32 a K-sized tile instead of the scores (the TMA
      variant at b6fd6fb: D=128, 128-key tiles, 2 stages, 213,000 bytes = 131,072 K/V + 65,536 + 16,384 queries).

    Every split-KV and stream-K config compiled on the H100 at D=64-256, 32 and 64 rows, matched this to the
    byte (less the barriers) or stayed under it (``tests/runtime/test_smem_estimate.py``, bf50495). Not
    ``hopper`` (other GPUs, never measured): the larger of the two layouts, whatever the rows. E.g. 5/1
    heads, D=80, q_len 4, 256-key tiles, 3 stages, head-chunked: 2 x 256 x 192 x 2 (K/V) + 32 x 256 x 4 (scores)
    + 32 x 96 x 2 (queries) = 235,520 bytes, over the 227 KB limit, where a flat 8 KB for everything but the
    K/V tiles had planned 200 KB (a crash at the first launch, the CUDA suite at d1dae87).

    ``swap_ab`` where it applies (``swaps``: 16 or 32 rows, 16-bit): the products are wgmma's with the keys and head
    dim as M, so the 64-row layout's ``num_stages`` K/V buffers and query tile, plus the weights (block_n,
    rows_per_tile) staged as the second product's operand (sm_90 compiles of Triton 3.7 at 027ab0a, bf16, 16 rows:
    D=64 64/128/256-key tiles 53,272 / 104,472 / 206,872 bytes at 3 stages; D=96 padded, 128-key tiles, 204,824;
    D=80 in chunks 76,848 / 150,576 / 298,032, where no weights tile was staged: counted anyway, a bound)."""
    dv = site.v_head_dim or site.head_dim
    if head_chunks:
        qk_width = padded_head_dim(site.head_dim, dv)
        width = qk_width + padded_head_dim(dv, site.head_dim)
    else:
        qk_width = _pow2(site.head_dim)
        width = qk_width + _pow2(dv)
    block_m = rows_per_tile(site)[0]
    queries = block_m * qk_width * site.dtype_bytes
    wgmma = max(1, num_stages) * block_n * width * site.dtype_bytes + queries + 1024
    if site.dtype_bytes == 4:  # fp32 (tf32 products): a K-sized tile, the operand laid out again, and no scores
        staged = block_n * qk_width * 4
    else:
        staged = block_m * block_n * 4
    mma = max(1, num_stages - 1) * block_n * width * site.dtype_bytes + staged + queries + 1024
    if swap_ab and swaps(site):
        swapped = wgmma + block_n * block_m * site.dtype_bytes
        return swapped if hopper else max(swapped, mma)
    if not hopper:  # measured on Hopper only: elsewhere the larger of both layouts, at any row count
        return max(wgmma, mma)
    return wgmma if block_m >= WGMMA_ROWS else mma


#: Query rows from which the kernels' products compile to Hopper's wgmma (one warpgroup's M): its operands stay in
#: shared memory through the pipeline, one K/V buffer more than below it, and no score tile staged.
WGMMA_ROWS = 64


def swaps(site: AttentionSite) -> bool:
    """Whether a ``swap_ab`` plan runs its products swapped at ``site`` (``runtime/kernels/split_kv.py``): a packed
    query tile under WGMMA_ROWS rows and 16-bit K/V (the transposed V operand of wgmma is 16-bit only)."""
    return rows_per_tile(site)[0] < WGMMA_ROWS and site.dtype_bytes == 2


def _pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def fit_stages(site: AttentionSite, block_n: int, num_stages: int, head_chunks: bool = False,
               hw: HardwareProfile | None = None, swap_ab: bool = False) -> int | None:
    """The deepest pipeline <= ``num_stages`` whose tiles fit ``hw``'s shared-memory budget (None if none does)."""
    budget, hopper = smem_budget(hw), on_hopper(hw)
    while num_stages > 1 and smem_bytes(site, block_n, num_stages, head_chunks, hopper, swap_ab) > budget:
        num_stages -= 1
    return num_stages if smem_bytes(site, block_n, num_stages, head_chunks, hopper, swap_ab) <= budget else None


def occupancy(site: AttentionSite, block_n: int, num_warps: int, num_stages: int, head_chunks: bool = False,
              hw: HardwareProfile | None = None, swap_ab: bool = False) -> int:
    """Rough resident programs per SM for one config: the tighter of shared memory (``hw``'s per block, about an
    SM's) and registers (about 128 per thread for wide tiles, 96 otherwise)."""
    smem = smem_bytes(site, block_n, num_stages, head_chunks, on_hopper(hw), swap_ab)
    regs = 128 if (num_warps >= 8 or block_n * site.head_dim >= 128 * 128) else 96
    return max(1, min(smem_per_block(hw) // smem, 65536 // (regs * 32 * num_warps)))


def rows_per_tile(site: AttentionSite) -> tuple[int, int]:
    """(BLOCK_M, number of M blocks) of the packed GQA query tile, as the kernels cut it."""
    rows = site.group_size * (site.q_len or 1)
    block_m = max(16, min(64, 1 << max(0, math.ceil(math.log2(max(rows, 1))))))
    return block_m, -(-rows // block_m)
