"""Shared-prefix cascade: one split-KV pass over a prefix that every batch row shares, with the B rows' queries
stacked into the packed query tile (so the prefix bytes are read once per KV head, not once per row), one split-KV
pass over each row's suffix, and one ``merge_states`` over all the partial states.

Both passes are ``split_kv_decode`` launches with ``merge=False``: they write their partial states (o, row max,
log l) into two views of one workspace, and a single merge reads them all, keeping the row max and ``log l`` apart
(exact for rows that ``finfo.min`` hides whole; see ``merge.merge_states``).

Workspace layout: with L = 1 the partials are (S, B, Hq, 1, ...) and the merge writes the (B, Hq, 1, Dv) output in
place; the prefix pass sees them as (S_p, 1, Hq, B, ...) through a permuted view (its query position is the batch
row). With L > 1 they are (S, Hq, B, L, ...) so that the stacked rows ``b * L + i`` have one stride; the merge then
writes a (Hq, B, L, Dv) buffer that is copied into the output.
"""
from __future__ import annotations

import torch

from ..reference_cascade import prefix_mask_parts, stack_rows
from .merge import merge_states
from .split_kv import split_kv_decode


def cascade_workspace(prefix_splits: int, suffix_splits: int, q: torch.Tensor, v: torch.Tensor):
    """(partial o fp32, partial (row max, log l) fp32 (2, ...), int32 dummy counters) for ``prefix_splits`` +
    ``suffix_splits`` partial states of q (B, Hq, L, D) with value dim ``v.shape[-1]``; layout in the module
    docstring."""
    B, Hq, L, _ = q.shape
    Dv = v.shape[-1]
    splits = prefix_splits + suffix_splits
    rows = (B, Hq, L) if L == 1 else (Hq, B, L)
    return (torch.empty((splits,) + rows + (Dv,), device=q.device, dtype=torch.float32),
            torch.empty((2, splits) + rows, device=q.device, dtype=torch.float32),
            torch.zeros((1,), device=q.device, dtype=torch.int32))


def cascade_decode(q, k_prefix, v_prefix, k_suffix, v_suffix, out, *, workspace, attn_mask=None, valid_len=None,
                   scale=None, prefix_splits=64, suffix_splits=2, block_n=64, num_warps=4, num_stages=2, tma=False):
    """Launch the cascade into ``out``.

    Parameters
    ----------
    q : (B, Hq, L, D) fp16/bf16/fp32.
    k_prefix : (1, Hkv, P, D); v_prefix : (1, Hkv, P, Dv): the keys every row shares, any strides.
    k_suffix : (B, Hkv, S, D); v_suffix : (B, Hkv, S, Dv): each row's own keys, any strides.
    out : (B, Hq, L, Dv) contiguous, any float dtype, written in full.
    workspace : from ``cascade_workspace`` with the same split counts.
    attn_mask : bool or additive, broadcastable to (B, Hq, L, P + S); valid_len : (B,) int over P + S keys (it must
        come with the mask it was read from: the suffix pass skips the tiles past it, the prefix pass obeys the mask).
    """
    if prefix_splits < 2 or suffix_splits < 2:
        raise ValueError(f"cascade_decode: prefix_splits and suffix_splits must be >= 2; got {prefix_splits}, "
                         f"{suffix_splits}")
    B, Hq, L, D = q.shape
    P = k_prefix.shape[2]
    ws_o, ws_lse, counters = workspace
    if L == 1:
        pre = (ws_o[:prefix_splits].permute(0, 3, 2, 1, 4), ws_lse[:, :prefix_splits].permute(0, 1, 4, 3, 2))
        suf = (ws_o[prefix_splits:], ws_lse[:, prefix_splits:])
    else:
        Dv = ws_o.shape[-1]
        pre = (ws_o[:prefix_splits].reshape(prefix_splits, 1, Hq, B * L, Dv),
               ws_lse[:, :prefix_splits].reshape(2, prefix_splits, 1, Hq, B * L))
        suf = (ws_o[prefix_splits:].permute(0, 2, 1, 3, 4), ws_lse[:, prefix_splits:].permute(0, 1, 3, 2, 4))
    mask_p, mask_s = prefix_mask_parts(attn_mask, P)
    kw = dict(scale=scale, block_n=block_n, num_warps=num_warps, num_stages=num_stages, tma=tma, merge=False)
    split_kv_decode(stack_rows(q, B, Hq, L), k_prefix, v_prefix, out, workspace=(*pre, counters),
                    attn_mask=None if mask_p is None else stack_rows(mask_p, B, Hq, L), num_splits=prefix_splits, **kw)
    split_kv_decode(q, k_suffix, v_suffix, out, workspace=(*suf, counters), attn_mask=mask_s,
                    valid_len=None if valid_len is None else valid_len - P, num_splits=suffix_splits, **kw)
    if L == 1:
        merge_states(ws_o, ws_lse[0], out=out, lse_out=False, log_l_parts=ws_lse[1])
    else:
        rows_first = torch.empty((Hq, B, L, out.shape[-1]), device=out.device, dtype=out.dtype)
        merge_states(ws_o, ws_lse[0], out=rows_first, lse_out=False, log_l_parts=ws_lse[1])
        out.copy_(rows_first.transpose(0, 1))
    return out
