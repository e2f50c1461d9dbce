"""``merge_states``: merge P softmax states (o, lse) per row, as in FlashInfer's attention-state algebra.

``o = sum_p exp(lse_p - lse) * o_p`` and ``lse = log(sum_p exp(lse_p))``, natural log. An empty partition
(lse = -inf) has weight 0; a row empty in every partition gives o = 0 and lse = -inf, never NaN. Used by the
split-KV stage 2, and reusable by the multi-GPU tree merge and SAAP.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
try:  # grid dependency control (programmatic dependent launch); absent from older Tritons
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - then pdl_supported() is False and the branch is never compiled
    gdc_launch_dependents = gdc_wait = None

from .common import next_pow2, pdl_supported
from .launch import KernelLauncher


# P unspecialised: a split-KV grid that follows the cache's length merges a different count at a new length, which
# must not compile another kernel in the middle of a generation (a count divisible by 16 would)
@triton.jit(do_not_specialize=["P"])
def _merge_states_kernel(
    o_parts_ptr,  # (P, R, Dv) fp32 partial outputs (normalised within each partition)
    lse_parts_ptr,  # (P, R) fp32 partial natural-log LSEs (HAS_LOG_L: row maxima); -inf marks an empty partition
    log_l_ptr,  # HAS_LOG_L: (P, R) fp32 natural log l of each partition (lse = m + log l); else unused
    o_ptr,  # (R, Dv) merged output, any float dtype
    lse_ptr,  # (R,) fp32 merged LSE (only written when WRITE_LSE); LSE_PLANES: its row max plane
    stride_op, stride_or, stride_od,  # o_parts strides (partition, row, dim)
    stride_lp, stride_lr,  # lse_parts strides (partition, row)
    stride_llp, stride_llr,  # log_l strides (partition, row)
    stride_outr, stride_outd,  # output strides (row, dim)
    stride_lse_out,  # merged LSE stride
    stride_lse_plane,  # LSE_PLANES: from the merged row max plane to the merged log l plane
    P,  # number of partitions
    DV: tl.constexpr,  # head dim of the output (constexpr: keeps loads vectorised)
    BLOCK_P: tl.constexpr,  # partitions handled per step
    BLOCK_DV: tl.constexpr,  # output dims a program merges (the padded Dv, or a share of it: the grid's second axis)
    WRITE_LSE: tl.constexpr,  # whether to store the merged LSE
    WAIT_PRIOR: tl.constexpr,  # launched as a programmatic dependent: wait for the producer grid first
    HAS_LOG_L: tl.constexpr,  # the partials' maxima and log l come apart (exact weights next to a huge maximum)
    LSE_PLANES: tl.constexpr,  # write the merged row max and log l apart (natural log) instead of their sum
    LAUNCH_NEXT: tl.constexpr = False,  # let the next kernel launch now (a programmatic dependent that waits itself)
):
    if LAUNCH_NEXT:
        # a dependent launched with PDL (the next step's split-KV stage 1 with ``chain``) becomes resident while this
        # grid merges and waits (griddepcontrol.wait) for it to finish before it reads anything
        gdc_launch_dependents()
    if WAIT_PRIOR:
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    offs_p = tl.arange(0, BLOCK_P)
    offs_d = tl.program_id(1) * BLOCK_DV + tl.arange(0, BLOCK_DV)
    d_ok = offs_d < DV
    # The maxima stay in natural-log units and only their differences are scaled by log2(e): the partials may come
    # from the reference (a row that finfo.min hides has m = -3.4e38, which times log2(e) overflows to -inf and
    # would drop the partition as if it were empty).
    m = tl.full([1], float("-inf"), dtype=tl.float32)  # running max of lse (natural log)
    den = tl.zeros([1], dtype=tl.float32)  # running sum of weights relative to m
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
    for p0 in range(0, P, BLOCK_P):
        p = p0 + offs_p
        p_ok = p < P
        lse = tl.load(lse_parts_ptr + p.to(tl.int64) * stride_lp + row * stride_lr, mask=p_ok, other=float("-inf"))
        o = tl.load(o_parts_ptr + p.to(tl.int64)[:, None] * stride_op + row * stride_or
                    + offs_d.to(tl.int64)[None, :] * stride_od, mask=p_ok[:, None] & d_ok[None, :], other=0.0)
        if HAS_LOG_L:
            log_l = tl.load(log_l_ptr + p.to(tl.int64) * stride_llp + row * stride_llr, mask=p_ok,
                            other=float("-inf"))
        else:
            log_l = tl.zeros([BLOCK_P], dtype=tl.float32)
        m_new = tl.maximum(m, tl.max(lse, axis=0))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2((m - m_use) * 1.4426950408889634)
        w = tl.exp2(((lse - m_use) + log_l) * 1.4426950408889634)  # (BLOCK_P,); 0 for empty partitions
        den = den * alpha + tl.sum(w, axis=0)
        acc = acc * alpha + tl.sum(w[:, None] * o, axis=0)
        m = m_new
    empty = den == 0.0
    out = acc / tl.where(empty, 1.0, den)
    tl.store(o_ptr + row * stride_outr + offs_d.to(tl.int64) * stride_outd, out.to(o_ptr.dtype.element_ty),
             mask=d_ok)
    if WRITE_LSE:
        if tl.program_id(1) == 0:  # one program of the row's Dv shares writes its LSE
            log_den = tl.where(empty, float("-inf"), tl.log(tl.where(empty, 1.0, den)))
            if LSE_PLANES:  # for a later merge (a multi-GPU combine); an empty row gets -inf in both planes
                tl.store(lse_ptr + row * stride_lse_out + tl.arange(0, 1), tl.where(empty, float("-inf"), m))
                tl.store(lse_ptr + stride_lse_plane + row * stride_lse_out + tl.arange(0, 1), log_den)
            else:
                tl.store(lse_ptr + row * stride_lse_out + tl.arange(0, 1), m + log_den)


_MERGE_LAUNCH = KernelLauncher(_merge_states_kernel)

#: Elements of partial outputs one merge step loads per program (fp32): ``BLOCK_P * BLOCK_DV`` stays within it.
STEP_ELEMENTS = 8192
#: Fewer merged rows than this leave most SMs idle with one program per row (a decode step's B x Hq rows at small
#: batch): ``auto_dv_split`` gives each row at least two programs. H100 (65ec530, SAAP at llama3-8b, 32 rows of 64
#: partials of 128 values): the merge alone 2.22 µs at 2 programs per row against 3.43 at 1 (2.32 at 4, 2.54 at 8).
FEW_ROWS = 256


def auto_dv_split(rows: int, parts: int, block_dv: int) -> int:
    """Programs per row for ``merge_states(dv_split="auto")``: the fewest (a power of two, at most ``block_dv //
    16``) whose share of the padded Dv ``block_dv`` takes all ``parts`` partitions in one step, and at least 2 for
    fewer than ``FEW_ROWS`` rows. A merge is latency-bound at decode sizes: each step is a round trip to L2."""
    split = 2 if rows < FEW_ROWS else 1
    while split < block_dv // 16 and next_pow2(parts) * (block_dv // split) > STEP_ELEMENTS:
        split *= 2
    return min(split, max(1, block_dv // 16))


def merge_states(o_parts: torch.Tensor, lse_parts: torch.Tensor, out: torch.Tensor | None = None,
                 lse_out: torch.Tensor | None = None, *, out_dtype: torch.dtype | None = None, pdl: bool = False,
                 log_l_parts: torch.Tensor | None = None, max_parts: int | None = None, dv_split: int | str = 1,
                 launch_next: bool = False):
    """Merge P softmax states along dim 0.

    Parameters
    ----------
    o_parts : (P, ..., Dv) fp32 partial outputs; lse_parts : (P, ...) fp32 natural-log LSEs (-inf = empty).
    out : (..., Dv) output to write (any float dtype; its rows must be viewable as (R, Dv)), or None to allocate
        one of ``out_dtype`` (default fp32).
    lse_out : (...) fp32 merged LSE to write, or None to allocate one. Pass ``lse_out=False`` to skip it. A
        (2, ...) tensor instead receives the merged row max (plane 0) and log l (plane 1) apart, natural log, for a
        later merge that must keep them apart (see ``log_l_parts``).
    pdl : launch as a programmatic dependent of the kernel before it in the stream (which must have called
        ``gdc_launch_dependents``); ignored where unsupported.
    log_l_parts : (P, ...) fp32 natural ``log l`` of each partition, with ``lse_parts`` then holding the row
        maxima ``m`` (lse = m + log l); see ``reference.merge_states``.
    max_parts : the most partitions this call site ever merges (default P): the kernel's partitions per step are
        sized by it, so that a count varying below it (a split-KV grid that follows the cache's length) launches
        the same compiled kernel.
    dv_split : programs per row, each merging an equal share of the padded Dv (a power of two): more programs in
        flight for few rows; each reads every partition's LSE. "auto" (:func:`auto_dv_split`): the fewest, at
        least 2 for fewer rows than ``FEW_ROWS``, whose share takes every partition in one step.
    launch_next : (with ``pdl``) let the kernel after this one in the stream launch as soon as this grid is
        resident (it must be launched with PDL and wait for this grid itself, as split-KV's ``chain`` does).

    Returns
    -------
    (out, lse_out): merged o (..., Dv) and lse (...) (lse_out is None when skipped).
    """
    P = o_parts.shape[0]
    Dv = o_parts.shape[-1]
    rest = o_parts.shape[1:-1]
    o3 = o_parts.reshape(P, -1, Dv)
    l2 = lse_parts.reshape(P, -1)
    ll2 = log_l_parts.reshape(P, -1) if log_l_parts is not None else l2
    R = o3.shape[1]
    if out is None:
        out = torch.empty(rest + (Dv,), device=o_parts.device, dtype=out_dtype or torch.float32)
    write_lse = lse_out is not False
    if lse_out is None:
        lse_out = torch.empty(rest, device=o_parts.device, dtype=torch.float32)
    planes = write_lse and lse_out.dim() == len(rest) + 1
    if planes and tuple(lse_out.shape) != (2,) + tuple(rest):
        raise ValueError(f"merge_states: lse_out of shape {tuple(lse_out.shape)}: expected {tuple(rest)} or the two "
                         f"planes {(2,) + tuple(rest)}")
    out2 = out.view(-1, Dv)
    l_out = (lse_out[0] if planes else lse_out).view(-1) if write_lse else out2
    if R == 0:
        return out, (lse_out if write_lse else None)
    block_dv = max(16, next_pow2(Dv))
    parts = max(P, max_parts or P)
    # "auto" sizes a step by the program's share of Dv (all partitions at once where that fits); a given count keeps
    # the steps sized by the whole padded Dv, as measured with it (SAAP's MERGE_DV_SPLIT)
    auto = dv_split == "auto"
    if auto:
        dv_split = auto_dv_split(R, parts, block_dv)
    if not isinstance(dv_split, int) or dv_split < 1 or dv_split & (dv_split - 1):
        raise ValueError(f"merge_states: dv_split must be a power of two >= 1 or 'auto'; got {dv_split!r}")
    dv_split = min(dv_split, block_dv // 16)
    # As many partitions per step as fit in about 8K fp32 values: few, independent, wide loads per row.
    block_p = max(2, min(next_pow2(parts), max(2, STEP_ELEMENTS * (dv_split if auto else 1) // block_dv)))
    block_dv //= dv_split
    _MERGE_LAUNCH(
        (R, dv_split), o3, l2, ll2, out2, l_out, *o3.stride(), *l2.stride(), *ll2.stride(), *out2.stride(),
        l_out.stride(0) if write_lse else 0, lse_out.stride(0) if planes else 0,
        P, DV=Dv, BLOCK_P=block_p, BLOCK_DV=block_dv, WRITE_LSE=write_lse, WAIT_PRIOR=pdl,
        HAS_LOG_L=log_l_parts is not None, LSE_PLANES=planes, LAUNCH_NEXT=bool(launch_next and pdl),
        num_warps=8 if block_p * block_dv >= 8192 else 4, **({"launch_pdl": True} if pdl else {}),
    )
    return out, (lse_out if write_lse else None)
