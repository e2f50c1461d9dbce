"""Pure-PyTorch reference of the shared-prefix cascade (one prefix shared by every row, then each row's own suffix):
the split of a mask into its prefix and suffix columns, the stacking of the batch rows as query positions, and the
cascade's states. Conventions as in ``reference``, whose attention and merge it runs.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .reference import attention_states, merge_states


def prefix_mask_parts(attn_mask: Tensor | None, prefix_len: int) -> tuple[Tensor | None, Tensor | None]:
    """A mask over the P + S keys of a cascade -> (its prefix columns, its suffix columns): views, no copy. A mask
    broadcast along the keys (last dim 1) serves both parts as it is."""
    if attn_mask is None:
        return None, None
    if attn_mask.shape[-1] == 1:
        return attn_mask, attn_mask
    return attn_mask[..., :prefix_len], attn_mask[..., prefix_len:]


def stack_rows(x: Tensor, batch: int, heads: int, q_len: int) -> Tensor:
    """(B, H, L, n) (or anything broadcastable to it) -> (1, H, B * L, n): the batch rows stacked as query positions
    ``b * L + i``, so that one pass over a shared prefix serves every row. A view where the strides allow it (always
    for L = 1, or a mask broadcast over the heads), else a copy."""
    x = x.reshape((1,) * (4 - x.dim()) + tuple(x.shape))
    x = x.expand(batch, heads, q_len, x.shape[-1])
    return x.permute(1, 0, 2, 3).reshape(1, heads, batch * q_len, x.shape[-1])


def unstack_rows(x: Tensor, batch: int, q_len: int) -> Tensor:
    """Inverse of :func:`stack_rows` for a state: (1, H, B * L, ...) -> (B, H, L, ...) (a view)."""
    heads = x.shape[1]
    return x.reshape((heads, batch, q_len) + tuple(x.shape[3:])).transpose(0, 1)


def cascade_attention_states(
    q: Tensor,
    k_prefix: Tensor,
    v_prefix: Tensor,
    k_suffix: Tensor,
    v_suffix: Tensor,
    *,
    attn_mask: Tensor | None = None,
    valid_len: Tensor | None = None,
    scale: float | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Tensor]:
    """Attention of every row over one shared prefix plus its own suffix, as the cascade plan computes it: the
    prefix once with the B rows' queries stacked, each suffix per row, then an exact merge.

    Parameters
    ----------
    q : (B, Hq, L, D).
    k_prefix : (1, Hkv, P, D); v_prefix : (1, Hkv, P, Dv): keys [0, P) of every row.
    k_suffix : (B, Hkv, S, D); v_suffix : (B, Hkv, S, Dv): keys [P, P + S) of each row.
    attn_mask : bool or additive, broadcastable to (B, Hq, L, P + S) (absolute key positions), or None.
    valid_len : (B,) int: keys at positions >= valid_len[b] do not exist for row b. It must come with the mask it
        was read from (the prefix pass serves every row at once, so per-row limits inside the prefix are the mask's).

    Returns
    -------
    o : (B, Hq, L, Dv) and lse : (B, Hq, L) in ``compute_dtype``, equal to attention over the concatenated keys.
    """
    if valid_len is not None and attn_mask is None:
        raise ValueError("cascade_attention: valid_len needs the attn_mask it was read from (the shared prefix is "
                         "attended for all rows at once; per-row limits inside it must be in the mask)")
    B, Hq, L, D = q.shape
    P = k_prefix.shape[2]
    mask_p, mask_s = prefix_mask_parts(attn_mask, P)
    stacked = stack_rows(q, B, Hq, L)
    o_p, m_p, ll_p = attention_states(stacked, k_prefix, v_prefix, scale=scale, compute_dtype=compute_dtype,
                                      attn_mask=None if mask_p is None else stack_rows(mask_p, B, Hq, L),
                                      split_lse=True)
    o_s, m_s, ll_s = attention_states(q, k_suffix, v_suffix, attn_mask=mask_s, scale=scale, compute_dtype=compute_dtype,
                                      valid_len=None if valid_len is None else valid_len - P, split_lse=True)
    return merge_states(torch.stack([unstack_rows(o_p, B, L), o_s]), torch.stack([unstack_rows(m_p, B, L), m_s]),
                        torch.stack([unstack_rows(ll_p, B, L), ll_s]))
