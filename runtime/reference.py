"""Pure-PyTorch references for every attnopt op: the CPU fallback and the test oracle.

Conventions (shared with the Triton kernels):

* Q is (B, Hq, L, D); K is (B, Hkv, N, D); V is (B, Hkv, N, Dv); Hq = G * Hkv. Query head ``h`` reads KV
  head ``h // G`` (the ``repeat_kv`` / ``enable_gqa`` convention).
* ``attn_mask`` is boolean (True = attend) or additive, broadcastable to (B, Hq, L, N), as in SDPA.
* ``valid_len`` (B,) int: keys at positions ``>= valid_len[b]`` do not exist for row ``b``.
* ``is_causal`` is PyTorch's *top-left* alignment: query ``i`` sees key ``j`` iff ``j <= i``.
* ``key_start`` (B,) int: keys at positions ``< key_start[b]`` do not exist for row ``b`` (a sliding window's
  first key, from ``key_start_from_mask``); with ``valid_len`` a row reads keys ``[key_start, valid_len)``.
* ``softcap`` c != 0: the scaled scores ``s`` become ``c * tanh(s)`` before any mask or bias is added (Gemma 2's
  logit softcapping ``tanh(x / cap) * cap`` with the ``1 / cap`` folded into the scale).
* ``alibi_slopes`` (Hq,) float: ALiBi, the scores of query head h get ``slope[h] * j`` for key position j (after
  the cap, with the mask).
* A softmax state is (o, lse): the normalised output and the natural-log sum of exp of the scaled scores.
  A partition with no visible key has lse = -inf and o = 0; merging it changes nothing and makes no NaN.
* Fully masked rows follow PyTorch's SDPA: a row whose every key is hidden (False, or -inf) gives 0; a row whose
  keys all carry the same huge finite bias (``finfo.min``, where fp32 absorbs the scores) gives the mean of V
  over them. Partial states for a merge keep the row max ``m`` and ``log l`` apart (``lse = m + log l``): with
  ``m`` near -3.4e38, ``lse`` would absorb ``log l`` and the merge would weigh partitions equally instead of by
  their key counts. So ``merge_states`` takes an optional ``log_l_parts``, and the strategies' workspaces hold
  both parts.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def _bias(
    q_len: int,
    kv_start: int,
    kv_end: int,
    attn_mask: Tensor | None,
    valid_len: Tensor | None,
    is_causal: bool,
    device: torch.device,
    dtype: torch.dtype,
    key_start: Tensor | None = None,
    alibi_slopes: Tensor | None = None,
) -> Tensor | None:
    """Additive bias for keys [kv_start, kv_end): shape broadcastable to (B, Hq, L, n), or None."""
    bias = None
    n = kv_end - kv_start
    if attn_mask is not None:
        m = attn_mask[..., kv_start:kv_end] if attn_mask.shape[-1] != 1 else attn_mask  # size 1: every key alike
        if m.dtype == torch.bool:
            bias = torch.zeros(m.shape, device=device, dtype=dtype).masked_fill(~m, float("-inf"))
        else:
            bias = m.to(dtype)
    if is_causal:
        rows = torch.arange(q_len, device=device)[:, None]
        cols = torch.arange(kv_start, kv_end, device=device)[None, :]
        causal = torch.zeros(q_len, n, device=device, dtype=dtype).masked_fill(cols > rows, float("-inf"))
        bias = causal if bias is None else bias + causal
    if valid_len is not None:
        cols = torch.arange(kv_start, kv_end, device=device)
        invalid = cols[None, :] >= valid_len.to(device).view(-1, 1)  # (B, n)
        vl = torch.zeros(invalid.shape, device=device, dtype=dtype).masked_fill(invalid, float("-inf"))[:, None, None, :]
        bias = vl if bias is None else bias + vl
    if key_start is not None:
        cols = torch.arange(kv_start, kv_end, device=device)
        before = cols[None, :] < key_start.to(device).view(-1, 1)  # (B, n)
        ks = torch.zeros(before.shape, device=device, dtype=dtype).masked_fill(before, float("-inf"))[:, None, None, :]
        bias = ks if bias is None else bias + ks
    if alibi_slopes is not None:
        cols = torch.arange(kv_start, kv_end, device=device, dtype=dtype)
        ab = (alibi_slopes.to(device=device, dtype=dtype)[:, None] * cols[None, :])[None, :, None, :]  # (1, Hq, 1, n)
        bias = ab if bias is None else bias + ab
    return bias


def attention_states(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    attn_mask: Tensor | None = None,
    valid_len: Tensor | None = None,
    scale: float | None = None,
    is_causal: bool = False,
    kv_start: int = 0,
    kv_end: int | None = None,
    compute_dtype: torch.dtype = torch.float32,
    split_lse: bool = False,
    key_start: Tensor | None = None,
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
) -> tuple[Tensor, ...]:
    """Softmax state of Q over keys [kv_start, kv_end).

    Parameters
    ----------
    q : (B, Hq, L, D) any float dtype.
    k : (B, Hkv, N, D); v : (B, Hkv, N, Dv); Hq must be a multiple of Hkv.
    attn_mask : bool or float, broadcastable to (B, Hq, L, N), indexed with absolute key positions.
    valid_len : (B,) integer tensor, or None.
    key_start : (B,) integer tensor, or None: the first key of each row (earlier keys do not exist).
    softcap : c != 0 caps the scaled scores to ``c * tanh(s)`` before the mask is added (0: no cap).
    alibi_slopes : (Hq,) float tensor, or None: ALiBi slopes (scores + ``slope[h] * j``).

    Returns
    -------
    o : (B, Hq, L, Dv) in ``compute_dtype``, normalised within the partition (0 where it is empty).
    lse : (B, Hq, L) in ``compute_dtype``, natural log; -inf where the partition is empty.
        With ``split_lse``: two tensors instead, the row max ``m`` and ``log l`` (lse = m + log l; both -inf where
        the partition is empty), for a merge that must not lose ``log l`` next to a huge ``m``.
    """
    B, Hq, L, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    if Hq % Hkv:
        raise ValueError(f"query heads ({Hq}) must be a multiple of KV heads ({Hkv})")
    G = Hq // Hkv
    kv_end = N if kv_end is None else min(kv_end, N)
    scale = default_scale(D) if scale is None else scale
    Dv = v.shape[-1]
    if kv_end <= kv_start:
        empty_lse = torch.full((B, Hq, L), float("-inf"), device=q.device, dtype=compute_dtype)
        return (torch.zeros(B, Hq, L, Dv, device=q.device, dtype=compute_dtype), empty_lse) + \
            ((empty_lse.clone(),) if split_lse else ())
    # Pack the G query heads of one KV head together, as the kernels do: (B, Hkv, G*L, D).
    qc = q.to(compute_dtype).reshape(B, Hkv, G * L, D)
    kc = k[:, :, kv_start:kv_end].to(compute_dtype)
    vc = v[:, :, kv_start:kv_end].to(compute_dtype)
    scores = (qc @ kc.transpose(-1, -2)) * scale  # (B, Hkv, G*L, n)
    if softcap:
        scores = torch.tanh(scores) * softcap
    bias = _bias(L, kv_start, kv_end, attn_mask, valid_len, is_causal, q.device, compute_dtype, key_start,
                 alibi_slopes)
    if bias is not None:
        n = kv_end - kv_start
        bias = bias.expand(B, Hq, L, n).reshape(B, Hkv, G * L, n)
        scores = scores + bias
    row_max = scores.amax(dim=-1, keepdim=True)
    empty = torch.isneginf(row_max)
    safe_max = torch.where(empty, torch.zeros_like(row_max), row_max)
    p = torch.exp(scores - safe_max)
    denom = p.sum(dim=-1, keepdim=True)
    o = (p @ vc) / torch.where(empty, torch.ones_like(denom), denom)
    o = torch.where(empty, torch.zeros_like(o), o).reshape(B, Hq, L, Dv)
    neg_inf = torch.full_like(row_max, float("-inf"))
    if split_lse:  # log(0) = -inf for empty rows already
        return o, torch.where(empty, neg_inf, row_max).reshape(B, Hq, L), torch.log(denom).reshape(B, Hq, L)
    lse = torch.where(empty, neg_inf, safe_max + torch.log(denom))
    return o, lse.reshape(B, Hq, L)


def merge_states(o_parts: Tensor, lse_parts: Tensor, log_l_parts: Tensor | None = None, *,
                 split_lse: bool = False) -> tuple[Tensor, ...]:
    """Merge P softmax states along dim 0.

    Parameters
    ----------
    o_parts : (P, ..., Dv) float32 normalised partial outputs.
    lse_parts : (P, ...) float32 natural-log LSEs; -inf marks an empty partition. With ``log_l_parts``: the
        partitions' row maxima ``m`` (lse = m + log l).
    log_l_parts : (P, ...) float32 ``log l`` of each partition, or None. Needed for exact weights when ``m`` is so
        large in magnitude (a row hidden by ``finfo.min``) that ``m + log l`` rounds to ``m``.

    split_lse : return the merged state's row max ``m`` and ``log l`` apart instead of lse = m + log l, for a
        later merge (a multi-GPU combine) that must not lose ``log l`` either.

    Returns
    -------
    o : (..., Dv) and lse : (...) (with ``split_lse``: m (...) and log l (...)). Rows empty in every partition give
    o = 0 and lse = -inf (m = log l = -inf).
    """
    lse_max = lse_parts.amax(dim=0)
    all_empty = torch.isneginf(lse_max)
    safe_max = torch.where(all_empty, torch.zeros_like(lse_max), lse_max)
    rel = lse_parts - safe_max.unsqueeze(0)
    if log_l_parts is not None:
        rel = rel + log_l_parts  # weights l_p * exp(m_p - M); empty partitions: -inf
    w = torch.exp(rel)  # empty partitions: exp(-inf) = 0
    total = w.sum(dim=0)
    safe_total = torch.where(all_empty, torch.ones_like(total), total)
    o = (o_parts * w.unsqueeze(-1)).sum(dim=0) / safe_total.unsqueeze(-1)
    if split_lse:  # all-empty rows: lse_max is -inf already and log(0) = -inf
        return o, lse_max, torch.log(total)
    lse = torch.where(all_empty, torch.full_like(lse_max, float("-inf")), safe_max + torch.log(safe_total))
    return o, lse


def decode_attention_states(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    attn_mask: Tensor | None = None,
    valid_len: Tensor | None = None,
    scale: float | None = None,
    is_causal: bool = False,
    num_partitions: int = 1,
    compute_dtype: torch.dtype = torch.float32,
    key_start: Tensor | None = None,
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    split_lse: bool = False,
) -> tuple[Tensor, ...]:
    """Split-KV by partition and merge, the structure the kernels use. Returns (o, lse) in ``compute_dtype``, or
    with ``split_lse`` (o, m, log l) (see :func:`attention_states`)."""
    N = k.shape[2]
    if num_partitions < 1:
        raise ValueError(f"decode_attention_states: num_partitions must be >= 1; got {num_partitions}")
    num_partitions = max(1, min(num_partitions, max(N, 1)))
    if num_partitions == 1:
        return attention_states(q, k, v, attn_mask=attn_mask, valid_len=valid_len, scale=scale, is_causal=is_causal,
                                compute_dtype=compute_dtype, key_start=key_start, softcap=softcap,
                                alibi_slopes=alibi_slopes, split_lse=split_lse)
    chunk = -(-N // num_partitions)
    states = [attention_states(q, k, v, attn_mask=attn_mask, valid_len=valid_len, scale=scale, is_causal=is_causal,
                               kv_start=s, kv_end=s + chunk, compute_dtype=compute_dtype, split_lse=True,
                               key_start=key_start, softcap=softcap, alibi_slopes=alibi_slopes)
              for s in range(0, N, chunk)]
    return merge_states(*(torch.stack([s[j] for s in states]) for j in range(3)), split_lse=split_lse)


def decode_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    attn_mask: Tensor | None = None,
    valid_len: Tensor | None = None,
    scale: float | None = None,
    is_causal: bool = False,
    num_partitions: int = 1,
    key_start: Tensor | None = None,
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
) -> Tensor:
    """Exact decode attention in fp32 (fp64 for fp64 inputs), returned in ``q.dtype``: (B, Hq, L, Dv)."""
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    o, _ = decode_attention_states(q, k, v, attn_mask=attn_mask, valid_len=valid_len, scale=scale,
                                   is_causal=is_causal, num_partitions=num_partitions, compute_dtype=compute,
                                   key_start=key_start, softcap=softcap, alibi_slopes=alibi_slopes)
    return o.to(q.dtype)


def sdpa_float64(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    attn_mask: Tensor | None = None,
    valid_len: Tensor | None = None,
    scale: float | None = None,
    is_causal: bool = False,
    key_start: Tensor | None = None,
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
) -> Tensor:
    """The oracle: one dense softmax in float64 over explicitly repeated K/V heads. Returns float64 (B, Hq, L, Dv)."""
    B, Hq, L, D = q.shape
    G = Hq // k.shape[1]
    k64 = k.double().repeat_interleave(G, dim=1)
    v64 = v.double().repeat_interleave(G, dim=1)
    scale = default_scale(D) if scale is None else scale
    s = (q.double() @ k64.transpose(-1, -2)) * scale
    if softcap:
        s = torch.tanh(s) * softcap
    bias = _bias(L, 0, k.shape[2], attn_mask, valid_len, is_causal, q.device, torch.float64, key_start, alibi_slopes)
    if bias is not None:
        s = s + bias
    mx = s.amax(-1, keepdim=True)
    empty = torch.isneginf(mx)
    p = torch.exp(s - torch.where(empty, torch.zeros_like(mx), mx))
    den = p.sum(-1, keepdim=True)
    out = (p @ v64) / torch.where(empty, torch.ones_like(den), den)
    return torch.where(empty, torch.zeros_like(out), out)


#: ``valid_len`` of a batch row whose mask does not limit the keys (a mask broadcast along them): at least any
#: key count; every consumer clamps valid lengths to the keys it has.
UNLIMITED_LEN = 2**31 - 1


def valid_len_from_mask(attn_mask: Tensor, batch: int) -> Tensor:
    """Per batch row, one past the last key position any query row may attend to: (B,) int32, on device.

    Parameters
    ----------
    attn_mask : bool (True = attend) or additive float, of any shape broadcastable to (B, Hq, L, N) as in SDPA
        (1-D (N,) to 4-D, any dim of size 1, a trailing dim of size 1 meaning every key alike).
    batch : B.

    Exact for any mask: tiles after that position are fully masked for every row, so skipping them changes
    nothing. A float mask counts a position as visible when its bias is > -inf (finfo.min is visible). A mask
    broadcast along the keys gives ``UNLIMITED_LEN`` (or 0 where it hides every key).
    """
    if attn_mask.dim() > 4:
        raise ValueError(f"valid_len_from_mask: a mask of rank {attn_mask.dim()} does not broadcast to (B, Hq, L, N)")
    visible = attn_mask if attn_mask.dtype == torch.bool else ~torch.isneginf(attn_mask)
    visible = visible.reshape((1,) * (4 - visible.dim()) + tuple(visible.shape))  # (B or 1, H or 1, L or 1, N or 1)
    if visible.shape[0] not in (1, batch):
        raise ValueError(f"valid_len_from_mask: the mask's batch dim {visible.shape[0]} is neither 1 nor {batch}")
    visible = visible.any(dim=2).any(dim=1)  # (B or 1, N or 1)
    n = visible.shape[-1]
    if n == 1:
        last = visible[:, 0].to(torch.int32) * UNLIMITED_LEN
    else:
        positions = torch.arange(1, n + 1, device=visible.device, dtype=torch.int32)
        last = (visible.to(torch.int32) * positions).amax(dim=-1)
    return last.expand(batch).to(torch.int32).contiguous()


def key_start_from_mask(attn_mask: Tensor, batch: int) -> Tensor:
    """Per batch row, the first key position any query row may attend to: (B,) int32, on device (0 where the mask
    hides every key of the row, or is broadcast along the keys).

    Parameters
    ----------
    attn_mask : bool (True = attend) or additive float, broadcastable to (B, Hq, L, N) as for
        :func:`valid_len_from_mask`, with the same notion of visible (a float bias > -inf, finfo.min included).
    batch : B.

    Exact for any mask: every key before that position is hidden from every query row of the batch row, so a
    kernel that starts reading there (a sliding window's band: the last W keys) computes the same result.
    """
    if attn_mask.dim() > 4:
        raise ValueError(f"key_start_from_mask: a mask of rank {attn_mask.dim()} does not broadcast to (B, Hq, L, N)")
    visible = attn_mask if attn_mask.dtype == torch.bool else ~torch.isneginf(attn_mask)
    visible = visible.reshape((1,) * (4 - visible.dim()) + tuple(visible.shape))
    if visible.shape[0] not in (1, batch):
        raise ValueError(f"key_start_from_mask: the mask's batch dim {visible.shape[0]} is neither 1 nor {batch}")
    visible = visible.any(dim=2).any(dim=1)  # (B or 1, N or 1)
    # argmax returns the first maximal index: the first visible key, or 0 where none is
    first = visible.to(torch.uint8).argmax(dim=-1).to(torch.int32)
    return first.expand(batch).contiguous()


def key_range_from_mask(attn_mask: Tensor, batch: int) -> Tensor:
    """Both ends of the keys a batch row may see, (2, B) int32: row 0 as :func:`key_start_from_mask` but 2**31 - 1
    where the mask hides every key of the row (an empty range, as one scan with atomic minima gives it; the kernels
    clamp the start to the valid length), row 1 :func:`valid_len_from_mask`. Same arguments as those."""
    end = valid_len_from_mask(attn_mask, batch)
    start = key_start_from_mask(attn_mask, batch)
    start = torch.where(end > 0, start, torch.full_like(start, 2**31 - 1))
    return torch.stack([start, end])
