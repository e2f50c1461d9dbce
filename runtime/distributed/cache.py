"""The sequence-sharded KV cache: every rank keeps only its keys and values (in :class:`GrowingTensor` storage)
plus their global positions, and maps the op's global masks, valid lengths and causality onto its local keys
(:func:`adapt_mask`, :func:`localize`).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .groups import DistGroup, DistributedDecodeError, current_group


def balanced_bounds(n: int, world: int) -> list[tuple[int, int]]:
    """Contiguous balanced shards of ``n`` tokens: rank r gets [r*n//P, (r+1)*n//P)."""
    return [(r * n // world, (r + 1) * n // world) for r in range(world)]


class GrowingTensor:
    """A tensor that grows along one dimension by appending, with amortised O(1) copies per appended element.

    Appending into ``torch.cat([old, new])`` copies the whole tensor every time: for a KV shard that is the
    whole shard per token per layer, twice the traffic of the attention that reads it. Here the storage grows
    by ``GROWTH`` times (at least ``MIN_EXTRA`` elements) when full, and :attr:`value` is a view of the filled
    prefix. A view handed out earlier stays valid and unchanged: appends write only past its end, and a regrow
    copies into new storage.
    """

    GROWTH = 1.5
    MIN_EXTRA = 256

    def __init__(self, dim: int):
        self.dim = dim
        self._buf: Tensor | None = None
        self.length = 0

    @property
    def value(self) -> Tensor | None:
        """The filled prefix (a view), or None before the first append."""
        return None if self._buf is None else self._buf.narrow(self.dim, 0, self.length)

    @property
    def storage(self) -> Tensor | None:
        """The whole storage (filled prefix and spare capacity), or None before the first append."""
        return self._buf

    def append(self, new: Tensor) -> Tensor:
        """Append ``new`` (same shape as the stored tensor except along ``dim``); returns :attr:`value`."""
        t = new.shape[self.dim]
        if self._buf is None:
            shape = list(new.shape)
            shape[self.dim] = t  # the first block exactly: a prefill that is never extended costs no slack
            self._buf = torch.empty(shape, dtype=new.dtype, device=new.device)
        elif self.length + t > self._buf.shape[self.dim]:
            shape = list(self._buf.shape)
            shape[self.dim] = max(self.length + t, int(self.length * self.GROWTH), self.length + self.MIN_EXTRA)
            grown = torch.empty(shape, dtype=self._buf.dtype, device=self._buf.device)
            grown.narrow(self.dim, 0, self.length).copy_(self.value)
            # spare capacity holds zeros, not stale bits: a replayed tree step reads the storage with the length
            # on the device, and a kernel that loads whole tiles then sees finite values past the length
            grown.narrow(self.dim, self.length, shape[self.dim] - self.length).zero_()
            self._buf = grown
        if t:
            self._buf.narrow(self.dim, self.length, t).copy_(new)
        self.length += t
        return self.value


class ShardedKVCache:
    """A sequence-sharded KV cache over a group: every rank keeps only its keys/values, per layer.

    Token placement is deterministic, so every rank knows every token's owner without communication:

    * the first update (prefill into an empty cache) is split into contiguous balanced shards
      (:func:`balanced_bounds`);
    * each later token goes to the least-filled rank (ties: the lowest rank), which keeps shards within one
      token of each other.

    All layers share the placement (``owner``); ``positions`` are the global positions of the local keys, so
    masks built for the global sequence are sliced with :meth:`local_mask` and RoPE (applied before the
    update) stays global.

    Parameters
    ----------
    group : the :class:`DistGroup` (default: ``current_group()``). It is attached as ``group.cache``.
    """

    def __init__(self, group: DistGroup | None = None):
        self.group = group or current_group()
        self.group.cache = self
        self.owner: list[int] = []  # owner rank of every global position
        self.counts = [0] * self.group.world  # tokens per rank
        self._keys: list[GrowingTensor] = []
        self._values: list[GrowingTensor] = []
        self.layer_len: list[int] = []  # global length seen by each layer
        #: Per layer: whether the last update returned the whole new block instead of the local shard
        #: (a prefill into an empty layer); the same on every rank, so attention decides uniformly.
        self.returned_full: list[bool] = []
        self._positions = GrowingTensor(0)
        self._positions_dev: dict[torch.device, GrowingTensor] = {}  # device mirrors of the positions
        #: layer by the address of its key storage (checked against the layer on lookup: addresses get reused)
        self._layer_at: dict[int, int] = {}
        self._local_len: dict[tuple, list] = {}  # (device, B) -> [device tensor (B,) int32, value it holds]
        self._mask_bufs: dict[tuple, Tensor] = {}  # (dtype, mask shape with the storage's columns) -> buffer

    # ------------------------------------------------------------------------------------ placement
    def _assign(self, upto: int) -> None:
        start = len(self.owner)
        if upto <= start:
            return
        P, me = self.group.world, self.group.rank
        mine: list[int] = []
        if start == 0:
            for r, (a, b) in enumerate(balanced_bounds(upto, P)):
                self.owner.extend([r] * (b - a))
                self.counts[r] += b - a
            a, b = balanced_bounds(upto, P)[me]
            new = torch.arange(a, b, dtype=torch.int64)
        else:
            for pos in range(start, upto):
                r = min(range(P), key=lambda i: (self.counts[i], i))
                self.owner.append(r)
                self.counts[r] += 1
                if r == me:
                    mine.append(pos)
            new = torch.tensor(mine, dtype=torch.int64)
        # Positions grow incrementally (no O(N) rebuild or copy per decode step).
        if new.numel():
            self._positions.append(new)

    @property
    def seq_len(self) -> int:
        """Global number of tokens placed so far."""
        return len(self.owner)

    @property
    def positions(self) -> Tensor:
        """(n_local,) int64 on the CPU: the global positions of this rank's keys, ascending."""
        value = self._positions.value
        return torch.zeros(0, dtype=torch.int64) if value is None else value

    def positions_on(self, device: torch.device | str | None) -> Tensor:
        """:attr:`positions` on ``device``, from a mirror there that receives only the positions added since the
        last call: a decode step copies one token's position to the device, not the whole shard's (which every
        layer's mask slicing did, n_local x 8 bytes per layer and step)."""
        device = torch.device(device or "cpu")
        host = self.positions
        if device.type == "cpu":
            return host
        mirror = self._positions_dev.get(device)
        if mirror is None:
            mirror = self._positions_dev[device] = GrowingTensor(0)
        if mirror.length < host.numel():
            mirror.append(host[mirror.length:].to(device, non_blocking=False))
        return mirror.value if mirror.value is not None else host.to(device)

    def shard_lens(self) -> list[int]:
        return list(self.counts)

    def local_index(self, start: int, count: int) -> list[int]:
        """Indices into a block of ``count`` new tokens at global [start, start+count) that this rank owns."""
        r = self.group.rank
        return [i for i in range(count) if self.owner[start + i] == r]

    # ------------------------------------------------------------------------------------ storage
    def update(self, layer: int, key_states: Tensor, value_states: Tensor) -> tuple[Tensor, Tensor]:
        """Append new tokens (B, Hkv, t, D) of ``layer`` at the next global positions; keep the local ones.

        Returns the local shard (B, Hkv, n_local, D), (B, Hkv, n_local, Dv).
        """
        while len(self._keys) <= layer:
            self._keys.append(GrowingTensor(-2))
            self._values.append(GrowingTensor(-2))
            self.layer_len.append(0)
            self.returned_full.append(False)
        start, t = self.layer_len[layer], key_states.shape[-2]
        self._assign(start + t)
        idx = self.local_index(start, t)
        if len(idx) == t:
            k_new, v_new = key_states, value_states
        elif idx and idx == list(range(idx[0], idx[-1] + 1)):
            k_new, v_new = key_states[:, :, idx[0]:idx[-1] + 1], value_states[:, :, idx[0]:idx[-1] + 1]
        else:
            sel = torch.tensor(idx, dtype=torch.long, device=key_states.device)
            k_new, v_new = key_states.index_select(2, sel), value_states.index_select(2, sel)
        keys, values = self._keys[layer].append(k_new), self._values[layer].append(v_new)
        self.layer_len[layer] = start + t
        self._layer_at[self._keys[layer].storage.data_ptr()] = layer
        return keys, values

    def storage_of(self, k: Tensor, v: Tensor, attn_mask: Tensor | None = None
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor | None] | None:
        """When ``k``, ``v`` are exactly one layer's current local shard (the views :meth:`update` returned):
        that layer's storage (B, Hkv, capacity, D), (B, Hkv, capacity, Dv), the local length as a (B,) int32
        device tensor, and the mask (local columns, (Bm, Hm, L, n)) copied into a buffer with the storage's
        columns (Bm, Hm, L, capacity), or None without a mask. Attention over the storage with that valid length
        and mask gives the same result as over the shard. None when ``k``, ``v`` (or the mask) do not fit.

        The length tensor and the mask buffer are shared by all layers and refilled in stream order, so work
        already queued reads the values it was queued with."""
        layer = self._layer_at.get(k.data_ptr())
        if layer is None:
            return None
        gk, gv = self._keys[layer], self._values[layer]
        ks, vs = gk.storage, gv.storage
        if (ks is None or vs is None or ks.data_ptr() != k.data_ptr() or vs.data_ptr() != v.data_ptr()
                or k.shape != gk.value.shape or v.shape != gv.value.shape or k.stride() != ks.stride()
                or v.stride() != vs.stride()):
            return None
        B, n = k.shape[0], k.shape[2]
        mask_buf = None
        if attn_mask is not None:
            if attn_mask.dim() != 4 or attn_mask.shape[-1] != n or attn_mask.device != k.device:
                return None
            shape = tuple(attn_mask.shape[:-1]) + (ks.shape[2],)
            key = (attn_mask.dtype, shape)
            mask_buf = self._mask_bufs.get(key)
            if mask_buf is None:
                if len(self._mask_bufs) >= 4:  # older capacities: their storage is gone
                    self._mask_bufs.clear()
                mask_buf = self._mask_bufs[key] = torch.zeros(shape, dtype=attn_mask.dtype, device=k.device)
            mask_buf[..., :n].copy_(attn_mask)
        slot = self._local_len.get((k.device, B))
        if slot is None:
            slot = self._local_len[(k.device, B)] = [torch.full((B,), n, dtype=torch.int32, device=k.device), n]
        elif slot[1] != n:
            slot[0].fill_(n)
            slot[1] = n
        return ks, vs, slot[0], mask_buf

    @property
    def keys(self) -> list[Tensor | None]:
        """Per layer: the local keys (B, Hkv, n_local, D), a view of storage grown geometrically."""
        return [k.value for k in self._keys]

    @property
    def values(self) -> list[Tensor | None]:
        """Per layer: the local values (B, Hkv, n_local, Dv)."""
        return [v.value for v in self._values]

    def get_seq_length(self, layer: int = 0) -> int:
        return self.layer_len[layer] if layer < len(self.layer_len) else 0

    # ------------------------------------------------------------------------------------ masks
    def local_mask(self, attn_mask: Tensor | None) -> Tensor | None:
        """Slice a mask over the global keys (..., N_global) to the local keys (..., n_local)."""
        if attn_mask is None:
            return None
        pos = self.positions_on(attn_mask.device)
        if attn_mask.shape[-1] < self.seq_len:
            raise DistributedDecodeError(f"mask has {attn_mask.shape[-1]} key columns but the sharded cache holds "
                                         f"{self.seq_len} tokens")
        return attn_mask.index_select(-1, pos)

    def local_valid_len(self, valid_len: Tensor | None) -> Tensor | None:
        """Global valid lengths (B,) to local ones: the number of local keys at positions < valid_len[b]."""
        if valid_len is None:
            return None
        pos = self.positions_on(valid_len.device)
        return (pos[None, :] < valid_len.view(-1, 1)).sum(dim=1).to(valid_len.dtype)

    def causal_mask(self, q_len: int, device=None) -> Tensor:
        """Bottom-right causal mask (1, 1, L, n_local) bool for the last ``q_len`` global positions."""
        pos = self.positions_on(device)
        q_pos = torch.arange(self.seq_len - q_len, self.seq_len, device=pos.device)
        return (pos[None, :] <= q_pos[:, None])[None, None]


def adapt_mask(group: DistGroup, attn_mask: Tensor | None, k: Tensor) -> Tensor | None:
    """The mask the op received, in local columns: unchanged when it already matches ``k``, else sliced with
    the group's sharded cache; a clear error when neither applies."""
    if attn_mask is None or attn_mask.shape[-1] == k.shape[2]:
        return attn_mask
    if group.cache is not None and attn_mask.shape[-1] >= group.cache.seq_len:
        return group.cache.local_mask(attn_mask)
    raise DistributedDecodeError(
        f"mask has {attn_mask.shape[-1]} key columns but the local shard has {k.shape[2]} keys and no "
        f"ShardedKVCache is attached to {group.describe()} to map global columns to local ones")


def localize(group: DistGroup, q: Tensor, k: Tensor, attn_mask: Tensor | None, valid_len: Tensor | None,
             is_causal: bool) -> tuple[Tensor | None, Tensor | None, bool]:
    """Turn the op's mask arguments into local ones: (attn_mask, valid_len, is_causal).

    With a :class:`ShardedKVCache` attached to the group, ``valid_len`` and ``is_causal`` are global (they
    follow the global key positions) and a mask with global columns is sliced. Without one, the arguments
    are taken as local (``is_causal`` then means top-left over the local keys).
    """
    cache = group.cache
    attn_mask = adapt_mask(group, attn_mask, k)
    if cache is None or cache.positions.numel() != k.shape[2]:
        return attn_mask, valid_len, is_causal
    if valid_len is not None:
        valid_len = cache.local_valid_len(valid_len)
    if is_causal:
        L = q.shape[2]
        pos = cache.positions_on(q.device)
        causal = (pos[None, :] <= torch.arange(L, device=q.device)[:, None])[None, None]
        attn_mask = causal if attn_mask is None else (attn_mask & causal if attn_mask.dtype == torch.bool else
                                                      attn_mask.masked_fill(~causal, float("-inf")))
    return attn_mask, valid_len, False

