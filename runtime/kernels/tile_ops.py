"""Two ways to run a KV tile of the decode loop (``attend.py``) that change its speed, never its result: the
products in swap-AB form, and an L2 prefetch of the tiles ahead.

**Swap-AB** (``SWAP_AB``). A decode tile has few query rows (G * q_len, padded to BLOCK_M = 16 or 32) and many keys.
``Q @ K^T`` puts the query rows in the product's M dimension, and on Hopper an M under 64 compiles to mma.sync: K and
V go from shared memory through registers (ldmatrix), and the weights through shared memory again between the two
products. Swapped, ``S^T = K @ Q^T`` (BLOCK_N, BLOCK_M) and ``O^T = V^T @ P^T`` (Dv, BLOCK_M) put the keys and the
head dim in M (64 or more: wgmma, its K/V operands read from shared memory where the copy engine left them) and the
query rows in N (16 or 32). The query tile is loaded transposed, and the scores, the softmax state's updates and the
accumulator stay transposed, (BLOCK_N, BLOCK_M) and (Dv, BLOCK_M), to the transposed store of the output: no
``tl.trans`` of a register tensor that a product wrote. (The first version turned S^T and the accumulator back with
``tl.trans``: compiled on the H100 at 027ab0a, B2 2/2 D80, 2 splits, a valid length, it was wrong by up to 5.5e-2;
a transposed MMA-layout register tensor is a known Triton miscompile on Hopper, flash-linear-attention PR 826.)
``_per_row`` / ``_per_key`` broadcast the per-row and per-key vectors either way.

**L2 prefetch** (``PREFETCH`` tiles ahead). The pipelined loop keeps ``num_stages - 1`` K/V tiles in flight per
program, bounded by shared memory. One thread of the program also asks the L2 for the K and V rows ``PREFETCH`` tiles
ahead (``cp.async.bulk.prefetch.L2``, one bulk request per tensor and tile, no shared memory), so that more of the
stream is in flight per SM and each DRAM request is a long contiguous run. Only compiled on Hopper or newer, and only
where a tile's rows are one contiguous run (``stride_kn == D`` and ``stride_kd == 1``, likewise V; the launcher
checks: ``common.prefetch_applies``); the interpreter has no such instruction and the launcher passes 0 there.
"""
from __future__ import annotations

import triton
import triton.language as tl

#: Query rows from which Triton compiles the tile products to wgmma on Hopper (one warpgroup's M): swap-AB is for
#: tiles below it.
WGMMA_ROWS = 64


@triton.jit
def _per_row(x, T: tl.constexpr):
    """A (BLOCK_M,) per-query-row vector broadcast against a score tile: (BLOCK_M, 1), or with T (1, BLOCK_M)."""
    if T:
        r = x[None, :]
    else:
        r = x[:, None]
    return r


@triton.jit
def _per_key(x, T: tl.constexpr):
    """A (BLOCK_N,) per-key vector broadcast against a score tile: (1, BLOCK_N), or with T (BLOCK_N, 1)."""
    if T:
        r = x[:, None]
    else:
        r = x[None, :]
    return r


@triton.jit
def _qk_dot(q, k, q_hi, k_hi, TWO: tl.constexpr, PRECISION: tl.constexpr, SWAP_AB: tl.constexpr):
    """The dot products (BLOCK_M, BLOCK_N) of the query rows ``q`` (BLOCK_M, d) with the keys ``k`` (BLOCK_N, d),
    plus those of the second head-dim chunk (``q_hi``, ``k_hi``) when TWO. SWAP_AB: ``q``/``q_hi`` come transposed,
    (d, BLOCK_M), and the products ``K @ Q^T`` stay transposed, (BLOCK_N, BLOCK_M)."""
    if SWAP_AB:
        qk = tl.dot(k, q, input_precision=PRECISION)
        if TWO:
            qk = tl.dot(k_hi, q_hi, acc=qk, input_precision=PRECISION)
    else:
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if TWO:
            qk = qk + tl.dot(q_hi, tl.trans(k_hi), input_precision=PRECISION)
    return qk


@triton.jit
def _pv_update(acc, alpha, p, v, UPCAST: tl.constexpr, PRECISION: tl.constexpr, SWAP_AB: tl.constexpr):
    """``acc * alpha + P @ V`` for the weights ``p`` (BLOCK_M, BLOCK_N) fp32 and values ``v`` (BLOCK_N, dv): acc is
    (BLOCK_M, dv); with SWAP_AB ``p`` is P^T (BLOCK_N, BLOCK_M), acc (dv, BLOCK_M), updated as
    ``acc * alpha + V^T @ P^T`` (V^T: the copy engine's tile read transposed from shared memory)."""
    if not UPCAST:
        p = p.to(v.dtype)
    if SWAP_AB:  # one return: the compiler visits statements after a taken constexpr branch's return
        acc = acc * alpha[None, :] + tl.dot(tl.trans(v), p, input_precision=PRECISION)
    else:
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
    return acc


@triton.jit
def _prefetch_rows_l2(base, first, end, stride_n, BLOCK_N: tl.constexpr, BULK: tl.constexpr):
    """Ask the L2 for rows [first, min(first + BLOCK_N, end)) of one (batch row, KV head)'s K or V at ``base`` (rows
    contiguous, ``stride_n`` elements apart, 16-byte aligned, at most 512 bytes each); none where the range is empty.
    BULK: one bulk prefetch by the program's first thread (``cp.async.bulk.prefetch.L2``); else one
    ``prefetch.global.L2`` per 128-byte line, spread over the threads. A hint: nothing is read into registers or
    shared memory, so no result depends on it."""
    item = base.dtype.element_ty.primitive_bitwidth // 8
    nbytes = tl.maximum(tl.minimum(end - first, BLOCK_N), 0) * stride_n * item
    # never an address past the rows that exist, even for an empty range
    start = base.to(tl.pointer_type(tl.int8)) + tl.minimum(first, end).to(tl.int64) * stride_n * item
    if BULK:
        tl.inline_asm_elementwise(
            """{
            .reg .pred pf_first, pf_some;
            .reg .b32 pf_tid;
            mov.u32 pf_tid, %tid.x;
            setp.eq.u32 pf_first, pf_tid, 0;
            setp.gt.s32 pf_some, $2, 0;
            and.pred pf_first, pf_first, pf_some;
            @pf_first cp.async.bulk.prefetch.L2.global [$1], $2;
            mov.u32 $0, 0;
            }""",
            "=r,l,r", [start, nbytes.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
    else:
        lines = tl.arange(0, BLOCK_N * 4) * 128
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }", "=r,l,r",
            [start + lines.to(tl.int64), (lines < nbytes).to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_tile_l2(k_base, v_base, first, end, stride_kn, stride_vn, BLOCK_N: tl.constexpr,
                      BULK: tl.constexpr = True):
    """Prefetch the K and V rows of the tile at key ``first`` (those below ``end``) into L2."""
    _prefetch_rows_l2(k_base, first, end, stride_kn, BLOCK_N, BULK)
    _prefetch_rows_l2(v_base, first, end, stride_vn, BLOCK_N, BULK)
