"""Ring decode: ``pass_kv`` rotates the K/V shards around the ring in P-1 overlapped P2P steps and merges the state
of each visiting shard (Ring Attention's decode baseline); ``pass_q`` rotates the query's partial state instead (at
decode the query is replicated, so only [o | m | log l] travels): each rank merges its own local state into what it
receives, P-1 hops. Both return the exact state over the whole sequence. The running states keep the row max and
log l apart (see ``local.py``), so that a row that finfo.min hides weighs each shard by its key count.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import Tensor

from ..reference import merge_states
from .checks import check_shapes_once, decode_signature
from .groups import DistGroup, DistributedDecodeError, current_group
from .local import PACKED_EXTRA, _pack, local_states

#: Ring variants (``RingPlan.variant``).
RING_VARIANTS = ("pass_kv", "pass_q")


def _as_bias(attn_mask: Tensor | None, B: int, Hq: int, L: int, n: int, device) -> Tensor | None:
    """A local mask as an additive fp32 bias (B, Hm, L, n) (Hm = 1 or Hq), for travelling with its K/V."""
    if attn_mask is None:
        return None
    m = attn_mask
    while m.dim() < 4:
        m = m.unsqueeze(0)
    hm = 1 if m.shape[1] == 1 else Hq
    m = m.expand(B, hm, L, n)
    if m.dtype == torch.bool:
        return torch.zeros(m.shape, dtype=torch.float32, device=device).masked_fill(~m, float("-inf"))
    return m.to(torch.float32)


def _lengths(g: DistGroup, n: int, device) -> list[int]:
    t = torch.tensor([n], dtype=torch.int64, device=device)
    out = torch.empty((g.world, 1), dtype=torch.int64, device=device)
    g.all_gather(out, t, what="ring: shard lengths")
    return [int(x) for x in out.flatten().tolist()]


def ring_pass_kv(q: Tensor, k: Tensor, v: Tensor, g: DistGroup, *, attn_mask: Tensor | None = None,
                 valid_len: Tensor | None = None, scale: float | None = None, is_causal: bool = False,
                 local: str = "auto", shard_lens: Sequence[int] | None = None,
                 check_shapes: bool = True) -> tuple[Tensor, Tensor]:
    """Ring pass-KV: P-1 steps; each step sends the visiting K/V block on while attending to it.

    The blocks are padded to the longest shard; each carries its per-row valid count (B,) and, with a mask,
    its bias columns. ``shard_lens`` (every rank's n) saves the all-gather of the lengths when known.
    ``check_shapes``: compare shapes, dtypes and the mask's heads across ranks before the first collective of a
    new signature (see :func:`tree_decode`). Returns the global (o, lse), fp32.
    """
    P, r = g.world, g.rank
    B, Hq, L, D = q.shape
    Hkv, n, Dv = k.shape[1], k.shape[2], v.shape[-1]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    dev = q.device
    if is_causal:
        rows = torch.arange(L, device=dev)[:, None]
        causal = torch.arange(n, device=dev)[None, :] <= rows
        attn_mask = causal if attn_mask is None else (attn_mask & causal if attn_mask.dtype == torch.bool
                                                      else attn_mask.masked_fill(~causal, float("-inf")))
    bias = _as_bias(attn_mask, B, Hq, L, n, dev)
    if check_shapes:  # the blocks that travel: K/V shapes and dtype, and the bias's heads (0: no bias)
        check_shapes_once(g, "ring_pass_kv", decode_signature(q, k, v) + [0 if bias is None else bias.shape[1]])
    lens = list(shard_lens) if shard_lens is not None else _lengths(g, n, q.device if g.blocking else "cpu")
    if lens[r] != n:
        raise DistributedDecodeError(f"ring pass_kv: shard_lens[{r}]={lens[r]} but the local shard has {n} keys")
    cap = max(lens)
    # A block: K (B, Hkv, cap, D), V (B, Hkv, cap, Dv), valid counts (B,), with a mask its bias columns.
    kv_dtype = k.dtype

    def alloc(tag):
        bufs = [g.buffer(("ring_k", tag), (B, Hkv, cap, D), kv_dtype, dev),
                g.buffer(("ring_v", tag), (B, Hkv, cap, Dv), kv_dtype, dev),
                g.buffer(("ring_n", tag), (B,), torch.int64, dev)]
        if bias is not None:
            bufs.append(g.buffer(("ring_b", tag), (B, bias.shape[1], L, cap), torch.float32, dev))
        return bufs

    vl = torch.full((B,), n, dtype=torch.int64, device=dev)
    if valid_len is not None:
        vl = torch.minimum(vl, valid_len.to(dev, torch.int64))
    if n == cap and k.is_contiguous() and v.is_contiguous():
        own = [k, v, vl] + ([bias.contiguous()] if bias is not None else [])  # send the shard itself, no copy
    else:
        own = alloc("own")
        own[0][:, :, :n].copy_(k)
        own[1][:, :, :n].copy_(v)
        own[0][:, :, n:].zero_()
        own[1][:, :, n:].zero_()
        own[2].copy_(vl)
        if bias is not None:
            own[3][..., :n].copy_(bias)
            own[3][..., n:].fill_(float("-inf"))
    acc = None  # the running (o, m, log l)
    cur = own
    for step in range(P):
        # Receive buffers alternate (two suffice: a buffer is refilled only after its block was attended to).
        nxt = alloc(step % 2) if step < P - 1 else None
        works = g.exchange(cur, nxt, (r + 1) % P, (r - 1) % P) if nxt is not None else []
        src = (r - step) % P
        m = lens[src]
        state = local_states(q, cur[0][:, :, :m], cur[1][:, :, :m],
                             attn_mask=cur[3][..., :m] if bias is not None else None,
                             valid_len=cur[2] if valid_len is not None else None,
                             scale=scale, local=local, split_lse=True)
        if acc is None:
            acc = state
        else:
            acc = merge_states(*(torch.stack(pair) for pair in zip(acc, state)), split_lse=True)
        g.finish(works, f"ring pass_kv step {step + 1}/{P - 1}")
        cur = nxt
    return acc[0], acc[1] + acc[2]


def ring_pass_q(q: Tensor, k: Tensor, v: Tensor, g: DistGroup, *, attn_mask: Tensor | None = None,
                valid_len: Tensor | None = None, scale: float | None = None, is_causal: bool = False,
                local: str = "auto", check_shapes: bool = True) -> tuple[Tensor, Tensor]:
    """Ring pass-Q at decode: the K/V stay; the query's partial state [o | m | log l] travels the ring.

    Every rank attends to its own shard once. At decode the query is replicated on every rank, so a rank
    receiving a partial state merges its own local state into it and passes it on: after P-1 hops every rank
    holds the state over all shards (a ring reduction of states; the query itself need not travel).
    ``check_shapes`` as :func:`ring_pass_kv`. Returns (o, lse), fp32.
    """
    P, r = g.world, g.rank
    if check_shapes:
        check_shapes_once(g, "ring_pass_q", decode_signature(q, k, v))
    B, Hq, L, D = q.shape
    Dv = v.shape[-1]
    own = local_states(q, k, v, attn_mask=attn_mask, valid_len=valid_len, scale=scale, is_causal=is_causal,
                       local=local, split_lse=True)
    width = Dv + PACKED_EXTRA  # [o | m | log l]
    bufs = [g.buffer(("passq", i), (B, Hq, L, width), torch.float32, q.device) for i in range(2)]
    cur, nxt = bufs
    _pack(*own, cur)
    for step in range(P - 1):
        works = g.exchange([cur], [nxt], (r + 1) % P, (r - 1) % P)
        g.finish(works, f"ring pass_q step {step + 1}/{P - 1}")
        got = (nxt[..., :Dv], nxt[..., Dv], nxt[..., Dv + 1])
        merged = merge_states(*(torch.stack(pair) for pair in zip(got, own)), split_lse=True)
        cur, nxt = nxt, cur
        _pack(*merged, cur)
    return cur[..., :Dv].clone(), cur[..., Dv] + cur[..., Dv + 1]


def ring_decode(q: Tensor, k: Tensor, v: Tensor, group: DistGroup | None = None, *, variant: str = "pass_kv",
                attn_mask: Tensor | None = None, valid_len: Tensor | None = None, scale: float | None = None,
                is_causal: bool = False, local: str = "auto", shard_lens: Sequence[int] | None = None,
                return_lse: bool = False, check_shapes: bool = True):
    """Ring decode (``variant`` in ``RING_VARIANTS``). Shapes as :func:`tree_decode`; returns (B, Hq, L, Dv).

    ``check_shapes``: compare the call, shapes and dtypes across ranks before the first collective of a new
    signature (a :class:`DistributedDecodeError` on every rank on a mismatch)."""
    g = group or current_group()
    if variant == "pass_kv":
        o, lse = (ring_pass_kv(q, k, v, g, attn_mask=attn_mask, valid_len=valid_len, scale=scale,
                               is_causal=is_causal, local=local, shard_lens=shard_lens,
                               check_shapes=check_shapes) if g.world > 1 else
                  local_states(q, k, v, attn_mask=attn_mask, valid_len=valid_len, scale=scale, is_causal=is_causal,
                               local=local))
    elif variant == "pass_q":
        o, lse = (ring_pass_q(q, k, v, g, attn_mask=attn_mask, valid_len=valid_len, scale=scale,
                              is_causal=is_causal, local=local, check_shapes=check_shapes) if g.world > 1 else
                  local_states(q, k, v, attn_mask=attn_mask, valid_len=valid_len, scale=scale, is_causal=is_causal,
                               local=local))
    else:
        raise ValueError(f"unknown ring variant {variant!r}; valid: {', '.join(RING_VARIANTS)}")
    out = o.to(q.dtype)
    return (out, lse) if return_lse else out
