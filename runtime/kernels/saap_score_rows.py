"""The SAAP scoring launch's row helpers: load a KV head's group of query rows (and, to remove RoPE, each element's
rotation partner and inverse frequency), de-rope them at their positions with an fp64 range reduction, and multiply
rows by a chunk of weights to fp32 accuracy. The scoring kernel itself and its launcher are in ``saap_select``.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _load_query_rows(q_ptr, inv_freq_ptr, b, kvh, offs_r, offs_d, stride_qb, stride_qh, stride_ql, stride_qd, L, G, D,
                     DEROPE: tl.constexpr):
    """The group's G x L query rows (BLOCK_R, BLOCK_D) fp32, packed r = g * L + i, as stored; when DEROPE also each
    element's RoPE partner (d +- D/2) and inverse frequency, for ``_derope_rows`` (else those two are ``x``)."""
    g = offs_r // L
    i = offs_r % L
    row_ok = offs_r < G * L
    d_ok = offs_d < D
    base = (q_ptr + b.to(tl.int64) * stride_qb + (kvh * G + g).to(tl.int64)[:, None] * stride_qh
            + i.to(tl.int64)[:, None] * stride_ql)
    ok = row_ok[:, None] & d_ok[None, :]
    x = tl.load(base + offs_d.to(tl.int64)[None, :] * stride_qd, mask=ok, other=0.0).to(tl.float32)
    xp = x
    inv_freq = x
    if DEROPE:
        half = D // 2
        partner = tl.where(offs_d < half, offs_d + half, offs_d - half)
        xp = tl.load(base + partner.to(tl.int64)[None, :] * stride_qd, mask=ok, other=0.0).to(tl.float32)
        inv_freq = tl.load(inv_freq_ptr + tl.where(offs_d < half, offs_d, offs_d - half), mask=d_ok, other=0.0)
    return x, xp, inv_freq


@triton.jit
def _derope_rows(x, xp, inv_freq, kv_len, offs_r, offs_d, L, D, DEROPE: tl.constexpr):
    """``_load_query_rows``' rows with RoPE removed at each token's position ``kv_len - L + i`` when DEROPE
    (``x cos + sign * x[partner] sin``)."""
    if DEROPE:
        i = offs_r % L
        half = D // 2
        pos = (kv_len - L + i).to(tl.float32)
        angle = pos[:, None] * inv_freq[None, :]  # rounded as the reference rounds it, in fp32
        # range reduction in fp64: the fp32 cosine of an angle of 5e5 radians is accurate only after it
        turns = (angle.to(tl.float64) * 0.15915494309189535).to(tl.int64).to(tl.float64)
        reduced = (angle.to(tl.float64) - turns * 6.283185307179586).to(tl.float32)
        sign = tl.where(offs_d < half, 1.0, -1.0)
        x = x * tl.cos(reduced) + sign[None, :] * xp * tl.sin(reduced)
    return x


@triton.jit
def _round_bf16(x):
    """fp32 x rounded to bf16's nearest even, as fp32 (finite values): integer ops, since the interpreter's fp32 to
    bf16 cast truncates."""
    u = x.to(tl.uint32, bitcast=True)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.to(tl.float32, bitcast=True)


@triton.jit
def _rows_product(x, w, acc, PRECISION: tl.constexpr):
    """``acc + x @ w^T`` for fp32 rows x (BLOCK_R, BLOCK_K) and weights w (BLOCK_O, BLOCK_K): ``tl.dot`` at
    PRECISION, or ("fma") fp32 products summed in registers, exact fp32 with the rows unpadded (no tensor-core
    operand layouts: w stays in the registers it was loaded into). The query MLP's rule (``saap_rule.mlp_logits``):
    bf16 weights, rows rounded to bf16 (nearest even), exact products summed in fp32: "bf16" on the tensor cores,
    "bf16-ieee" in fp32 arithmetic (the interpreter, whose bf16 arithmetic is wrong)."""
    if PRECISION == "bf16":
        acc = tl.dot(x.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)), acc)
    elif PRECISION == "bf16-ieee":
        acc = tl.dot(_round_bf16(x), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
    elif PRECISION == "fma":  # row by row: each product reduces along w's rows as loaded (in-thread, then the lanes)
        wf = w.to(tl.float32)
        rows = tl.arange(0, x.shape[0])
        for r in tl.static_range(x.shape[0]):
            xr = tl.sum(tl.where(rows[:, None] == r, x, 0.0), axis=0)
            acc += tl.where(rows[:, None] == r, tl.sum(wf * xr[None, :], axis=1)[None, :], 0.0)
    else:
        acc = tl.dot(x, tl.trans(w.to(tl.float32)), acc, input_precision=PRECISION)
    return acc
