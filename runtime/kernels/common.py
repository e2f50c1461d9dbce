"""Pieces shared by the decode kernels: the packed GQA query tile, the KV-tile loop with masks, the stores.

Conventions (the same as ``runtime/reference.py``):

* Q is (B, Hq, L, D); K is (B, Hkv, N, D); V is (B, Hkv, N, Dv); Hq = G * Hkv and query head ``h`` reads KV
  head ``h // G``.
* The G * L query rows of one KV head are packed into one tile: packed row ``r = g * L + i`` is query head
  ``kvh * G + g`` at query position ``i``. Rows are cut into blocks of ``BLOCK_M`` (a power of two >= 16 so
  that ``tl.dot`` can run on them); padding rows are masked.
* Scores, row maxima and LSEs are in natural-log units, rounded as the original rounds them: the scaled score
  ``fl(qk * scale)``, plus the bias ``fl(s + bias)``. Only differences from the row max are scaled by log2(e) for
  ``exp2``. (Base-2 scores, ``qk * scale * log2(e) + bias * log2(e)``, round a large bias differently: a row that a
  finite bias such as -1e9 hides whole ties keys the original tells apart, and the output moved by up to 1.8.)
  Every difference is taken between rounded values before any scaling: a scaled value minus a rounded maximum is
  contracted into one FMA by the compiler, whose residual (up to 1e31 next to finfo.min) gave inf weights and NaN
  on the H100 while the interpreter was exact. Empty rows (no visible key) give o = 0 and lse = -inf.
* All memory offsets are int64.
"""
from __future__ import annotations

import contextlib
import functools
import math
import os
import threading
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from . import interpreting

#: Largest packed query block (G * q_len rows); more rows are cut into several M blocks.
MAX_BLOCK_M = 64


def next_pow2(x: int) -> int:
    """Smallest power of two >= ``x`` (1 for x <= 1). Plain integer arithmetic: Triton's own helpers are
    constexpr-function objects that cost microseconds of host time per call on the launch path."""
    return 1 << max(0, int(x) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def block_m_for(rows: int) -> int:
    """Rows per query tile for ``rows = G * q_len`` packed rows: a power of two in [16, MAX_BLOCK_M]."""
    return max(16, min(MAX_BLOCK_M, next_pow2(rows)))


def block_d_for(head_dim: int) -> int:
    """Padded head dim (power of two); the padding lanes are masked."""
    return max(16, next_pow2(head_dim))


def mask_args(attn_mask: torch.Tensor | None, B: int, Hq: int, L: int, N: int):
    """(mask tensor or dummy, strides (b, h, l, n), MASK_KIND) for a mask broadcastable to (B, Hq, L, N).

    MASK_KIND: 0 = none, 1 = boolean (True = attend), 2 = additive. Broadcast dims get stride 0; no copy is made.
    """
    if attn_mask is None:
        return None, (0, 0, 0, 0), 0
    m = attn_mask.expand(B, Hq, L, N) if attn_mask.dim() == 4 else attn_mask.broadcast_to(B, Hq, L, N)
    if m.dtype == torch.bool:
        return m.view(torch.uint8), tuple(m.stride()), 1
    return m, tuple(m.stride()), 2


@functools.lru_cache(maxsize=None)
def backend_has_option(name: str) -> bool:
    """Whether this Triton's CUDA backend takes the launch/compile option ``name`` (``maxnreg``, ``launch_pdl``)."""
    try:
        import dataclasses

        from triton.backends.nvidia.compiler import CUDAOptions

        return any(f.name == name for f in dataclasses.fields(CUDAOptions))
    except Exception:  # another backend, or a Triton without it
        return False


def pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch: compiled Triton with ``launch_pdl`` on a Hopper-or-newer GPU (the
    interpreter has no grid-dependency instructions). ``ATTNOPT_PDL=0`` turns it off."""
    if device.type != "cuda" or interpreting() or os.environ.get("ATTNOPT_PDL", "1") == "0":
        return False
    return device_major(device.index) >= 9 and backend_has_option("launch_pdl")


@functools.lru_cache(maxsize=None)
def _device_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def device_major(index: int | None) -> int:
    """Compute-capability major of CUDA device ``index`` (None: the current one), asked of the driver once."""
    return _device_major(torch.cuda.current_device() if index is None else index)


#: Tensor-descriptor templates per (block, dtype). TensorDescriptor's constructor validates its input (about 7 µs
#: of host time); ``kv_descriptors`` checks the same conditions itself (rank, 16-byte base and strides, positive
#: shape, contiguous last dim), so after one validated construction per template a descriptor is a copy of the
#: template with this call's base, shape and strides.
_DESC_TEMPLATES: dict[tuple, Any] = {}


@functools.lru_cache(maxsize=None)
def _tensor_descriptor_cls():
    """Triton's host-side TensorDescriptor class, or None for a Triton without it (looked up once)."""
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:
        return None
    return TensorDescriptor


def _descriptor(t: torch.Tensor, block: list[int]):
    TensorDescriptor = _tensor_descriptor_cls()
    key = (tuple(block), t.dtype)
    template = _DESC_TEMPLATES.get(key)
    if template is None:
        d = TensorDescriptor(t, list(t.shape), list(t.stride()), list(block))
        _DESC_TEMPLATES[key] = {k: v for k, v in vars(d).items() if k not in ("base", "shape", "strides")}
        return d
    d = object.__new__(TensorDescriptor)
    fields = vars(d)
    fields.update(template)
    fields["base"], fields["shape"], fields["strides"] = t, list(t.shape), list(t.stride())
    return d


def tma_now(device: torch.device) -> bool:
    """Whether a launch that may use TMA tiles should, now: while a CUDA graph is being captured, or always with
    ``ATTNOPT_TMA_EAGER=1`` (and in the interpreter, which tests the path). On the H100 machine an eager split-KV
    call with tensor descriptors took 117 µs of host time against 99 µs with pointer tiles (16 splits; 75 against
    49 µs with one split; ``benchmarks/results/experiments/launch-overhead-nvidia-h100-38e55ce.json``), and 201
    against 92 µs on an earlier machine instance, while the kernels differ by 1-10 % on the GPU; a captured graph
    pays the descriptors once."""
    if device.type != "cuda" or os.environ.get("ATTNOPT_TMA_EAGER", "0") == "1" or getattr(_AS_CAPTURED, "on", False):
        return True
    return torch.cuda.is_current_stream_capturing()


_AS_CAPTURED = threading.local()


@contextlib.contextmanager
def tma_as_captured():
    """Within this block, on this thread, ``tma_now`` is true as under a capture. The tuner compiles and times the
    kernel variant that a captured graph replays: a TMA plan's eager warm-up would otherwise compile the pointer
    variant too, a second cold compile (about a second) of every candidate that the graph never runs."""
    before = getattr(_AS_CAPTURED, "on", False)
    _AS_CAPTURED.on = True
    try:
        yield
    finally:
        _AS_CAPTURED.on = before


def kv_descriptors(k: torch.Tensor, v: torch.Tensor, block_n: int):
    """Tensor descriptors for bulk (TMA) copies of (1, 1, block_n, padded D) K/V tiles, or None when this input
    cannot take them: not Hopper or newer (nor the interpreter), a Triton without descriptors, a last dim that is
    not contiguous, or strides and base not 16-byte aligned (the copy engine's rules)."""
    if k.device.type == "cuda":
        if device_major(k.device.index) < 9:
            return None
    elif not interpreting():
        return None
    if _tensor_descriptor_cls() is None:
        return None
    descs = []
    for t in (k, v):
        item = t.element_size()
        if (t.dim() != 4 or t.stride(-1) != 1 or t.data_ptr() % 16 or min(t.shape) == 0
                or any((s * item) % 16 for s in t.stride()[:-1])):
            return None
        descs.append(_descriptor(t, [1, 1, block_n, block_d_for(t.shape[-1])]))
    return tuple(descs)


def dot_flags(dtype: torch.dtype) -> tuple[bool, str]:
    """(UPCAST, input precision) for ``tl.dot``: the interpreter computes bf16 on raw bits, so upcast there;
    fp32 inputs use IEEE products so that results match the fp64 reference tightly."""
    upcast = interpreting()
    precision = "ieee" if (dtype == torch.float32 or upcast) else "tf32"
    return upcast, precision


def softmax_scale(scale: float | None, head_dim: int) -> float:
    """The softmax scale (``1 / sqrt(head_dim)`` when None)."""
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


class DecodeGeometry(NamedTuple):
    """The launch geometry that the split-KV and stream-K launchers derive alike from q, k and v (see the module
    docstring for the packed query tile)."""

    B: int
    Hq: int
    L: int
    D: int
    Hkv: int
    N: int  # keys (the cache's storage length; the valid length may be shorter)
    Dv: int
    G: int  # query heads per KV head
    block_m: int  # packed query rows per tile
    num_m: int  # query tiles per KV head
    block_r: int  # rows a merge reads per tile: the tile's real rows, up to a power of two
    block_d: int  # padded head dim of Q and K
    block_dv: int  # padded head dim of V
    merge_p: int  # partials a merge loads per step (about 8192 fp32 elements in flight)


def decode_geometry(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> DecodeGeometry:
    """:class:`DecodeGeometry` of q (B, Hq, L, D), k (B, Hkv, N, D), v (B, Hkv, N, Dv)."""
    B, Hq, L, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    Dv = v.shape[-1]
    G = Hq // Hkv
    block_m = block_m_for(G * L)
    block_r = next_pow2(min(G * L, block_m))
    block_dv = block_d_for(Dv)
    return DecodeGeometry(B, Hq, L, D, Hkv, N, Dv, G, block_m, cdiv(G * L, block_m), block_r, block_d_for(D),
                          block_dv, max(1, min(32, 8192 // (block_r * block_dv))))


def arrival_counters(geo: DecodeGeometry, device: torch.device) -> torch.Tensor:
    """One zeroed int32 arrival counter per output tile (B * Hkv * num_m,): the last program to arrive at a tile
    merges it and resets its counter, so every launch leaves them zero."""
    return torch.zeros((geo.B * geo.Hkv * geo.num_m,), device=device, dtype=torch.int32)


def decode_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,
                  valid_len: torch.Tensor | None, geo: DecodeGeometry, block_n: int, tma: bool,
                  key_start: torch.Tensor | None = None, alibi_slopes: torch.Tensor | None = None):
    """The inputs both decode kernels take first, and how to read them.

    Returns
    -------
    pointers : (q, k, v, K tiles, V tiles, mask, valid_len, key_start, alibi_slopes): the tiles are TMA descriptors
        when ``tma`` is asked for and applies to this launch (``tma_now``), else K and V again; an absent mask,
        valid length, key start or slopes tensor is q (never read).
    mask_strides, mask_kind : from :func:`mask_args`.
    use_tma : whether the tiles are descriptors.
    """
    mask, mask_strides, mask_kind = mask_args(attn_mask, geo.B, geo.Hq, geo.L, geo.N)
    descs = kv_descriptors(k, v, block_n) if tma and tma_now(q.device) else None
    if key_start is not None and tuple(key_start.shape) != (geo.B,):
        raise ValueError(f"key_start must have shape (B,) = ({geo.B},); got {tuple(key_start.shape)}")
    if alibi_slopes is not None and (tuple(alibi_slopes.shape) != (geo.Hq,) or alibi_slopes.stride(0) != 1
                                     or not alibi_slopes.dtype.is_floating_point):
        raise ValueError(f"alibi_slopes must be a contiguous float tensor of shape (Hq,) = ({geo.Hq},); got "
                         f"{tuple(alibi_slopes.shape)} {alibi_slopes.dtype}")
    pointers = (q, k, v, *(descs if descs is not None else (k, v)), mask if mask is not None else q,
                valid_len if valid_len is not None else q, key_start if key_start is not None else q,
                alibi_slopes if alibi_slopes is not None else q)
    return pointers, mask_strides, mask_kind, descs is not None


@triton.jit
def _row_coords(mb, L, G, BLOCK_M: tl.constexpr):
    """Packed rows of M block ``mb``: (row index within the KV head, g, i, row valid)."""
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)  # packed row r = g * L + i
    g = rows // L  # query head within the group
    i = rows % L  # query position
    return rows, g, i, rows < G * L


@triton.jit
def _load_q(q_ptr, b, kvh, g, i, row_ok, offs_d, stride_qb, stride_qh, stride_ql, stride_qd, G, D,
            UPCAST: tl.constexpr):
    """The packed query tile (BLOCK_M, BLOCK_D) of KV head ``kvh`` in batch row ``b``."""
    h = kvh * G + g
    ptrs = (q_ptr + b.to(tl.int64) * stride_qb + h.to(tl.int64)[:, None] * stride_qh
            + i.to(tl.int64)[:, None] * stride_ql + offs_d.to(tl.int64)[None, :] * stride_qd)
    q = tl.load(ptrs, mask=row_ok[:, None] & (offs_d[None, :] < D), other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    return q


@triton.jit
def _attend(q, acc, m_i, l_i, lo, hi, kv_len,
            k_ptr, v_ptr, k_desc, v_desc, mask_ptr, b, kvh, g, i, row_ok, offs_d, offs_dv,
            stride_kb, stride_kh, stride_kn, stride_kd,
            stride_vb, stride_vh, stride_vn, stride_vd,
            stride_mb, stride_mh, stride_ml, stride_mn,
            sm_scale, G, D, DV,
            BLOCK_N: tl.constexpr, MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr,
            UPCAST: tl.constexpr, PRECISION: tl.constexpr, USE_TMA: tl.constexpr = False,
            kv_first=0, softcap=0.0, HAS_START: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
            alibi_ptr=0, ALIBI: tl.constexpr = False):
    """Online softmax of the query tile over keys [lo, hi) (hi <= kv_len is not required; keys >= kv_len are
    masked). Updates and returns (acc (BLOCK_M, BLOCK_DV) fp32, m_i (BLOCK_M,) natural-log max, l_i (BLOCK_M,) sum).

    USE_TMA: K/V tiles come through the tensor descriptors ``k_desc``/``v_desc`` (4-D, block (1, 1, BLOCK_N,
    BLOCK_D)) as bulk copies; rows past the tensor and padded dims arrive as zeros. Else through pointers.

    A bulk copy reads a tile's rows past ``kv_len`` from the tensor as they are (a sharded cache's spare capacity,
    a static cache's unused tail: any bits, NaN included), and a masked key's zero weight times a NaN value is
    NaN. So with TMA only the whole tiles below ``kv_len`` go through the copy engine; the one tile that crosses it
    (the only one past it with a visible key) is read with masked pointer loads.

    HAS_START: keys before ``kv_first`` do not exist (a sliding window's first key; ``lo`` may be a tile below
    it). SOFTCAP: the scores are ``softcap * tanh(qk * sm_scale)`` (see :func:`_scores`). ALIBI: the scores get
    ``slope[h] * j`` for key position j, slopes (Hq,) at ``alibi_ptr`` (after the cap, before the mask)."""
    k_base = k_ptr + b.to(tl.int64) * stride_kb + kvh.to(tl.int64) * stride_kh
    v_base = v_ptr + b.to(tl.int64) * stride_vb + kvh.to(tl.int64) * stride_vh
    h64 = (kvh * G + g).to(tl.int64)
    i64 = i.to(tl.int64)
    # ALiBi's slope of each query row, loaded once for all tiles (it was loaded again in every tile of the KV loop)
    slope = i.to(tl.float32) * 0.0
    if ALIBI:
        slope = tl.load(alibi_ptr + h64, mask=row_ok, other=0.0).to(tl.float32)
    if USE_TMA:
        end = tl.minimum(hi, kv_len)
        full_end = lo + tl.maximum(end - lo, 0) // BLOCK_N * BLOCK_N
        for start_n in range(lo, full_end, BLOCK_N):
            acc, m_i, l_i = _attend_tile(
                q, acc, m_i, l_i, start_n, kv_len, k_base, v_base, k_desc, v_desc, mask_ptr, b, kvh, h64, i, i64,
                row_ok, offs_d, offs_dv, stride_kn, stride_kd, stride_vn, stride_vd, stride_mb, stride_mh, stride_ml,
                stride_mn, sm_scale, D, DV, BLOCK_N, MASK_KIND, IS_CAUSAL, UPCAST, PRECISION, True,
                kv_first, softcap, HAS_START, SOFTCAP, slope, ALIBI)
        tail = full_end < end
    else:
        full_end = lo
        tail = False
        for start_n in range(lo, hi, BLOCK_N):
            acc, m_i, l_i = _attend_tile(
                q, acc, m_i, l_i, start_n, kv_len, k_base, v_base, k_desc, v_desc, mask_ptr, b, kvh, h64, i, i64,
                row_ok, offs_d, offs_dv, stride_kn, stride_kd, stride_vn, stride_vd, stride_mb, stride_mh, stride_ml,
                stride_mn, sm_scale, D, DV, BLOCK_N, MASK_KIND, IS_CAUSAL, UPCAST, PRECISION, False,
                kv_first, softcap, HAS_START, SOFTCAP, slope, ALIBI)
    if tail:
        # the tile that crosses kv_len, by masked pointer loads: straight-line code, so it adds no pipeline buffers
        # (a second pipelined loop doubled the shared memory); tiles wholly past kv_len hold no visible key
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, full_end, kv_len, k_base, v_base, k_desc, v_desc, mask_ptr, b, kvh, h64, i, i64,
            row_ok, offs_d, offs_dv, stride_kn, stride_kd, stride_vn, stride_vd, stride_mb, stride_mh, stride_ml,
            stride_mn, sm_scale, D, DV, BLOCK_N, MASK_KIND, IS_CAUSAL, UPCAST, PRECISION, False,
            kv_first, softcap, HAS_START, SOFTCAP, slope, ALIBI)
    return acc, m_i, l_i


@triton.jit
def _attend_tile(q, acc, m_i, l_i, start_n, kv_len,
                 k_base, v_base, k_desc, v_desc, mask_ptr, b, kvh, h64, i, i64, row_ok, offs_d, offs_dv,
                 stride_kn, stride_kd, stride_vn, stride_vd, stride_mb, stride_mh, stride_ml, stride_mn,
                 sm_scale, D, DV,
                 BLOCK_N: tl.constexpr, MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr,
                 UPCAST: tl.constexpr, PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
                 kv_first, softcap, HAS_START: tl.constexpr, SOFTCAP: tl.constexpr, slope,
                 ALIBI: tl.constexpr, MASK_ROW: tl.constexpr = False):
    """One KV tile [start_n, start_n + BLOCK_N) of :func:`_attend` (``k_base``/``v_base``: this (batch row, KV
    head)'s K/V pointers; ``h64``, ``i64``: the query rows' heads and positions as int64; ``slope``: ALiBi's slope
    of each query row (BLOCK_M,) fp32). MASK_ROW: the mask is one row per batch row (broadcast over heads and
    queries): one (BLOCK_N,) load, not a (BLOCK_M, BLOCK_N) tile of pointers (registers)."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    n_ok = offs_n < kv_len
    n64 = offs_n.to(tl.int64)
    if USE_TMA:
        k = k_desc.load([b, kvh, start_n, 0]).reshape(BLOCK_N, offs_d.shape[0])
        v = v_desc.load([b, kvh, start_n, 0]).reshape(BLOCK_N, offs_dv.shape[0])
    else:
        # K/V are read once: evict_first keeps them from pushing the (reused) Q, mask and partials out of L2
        k = tl.load(k_base + n64[:, None] * stride_kn + offs_d.to(tl.int64)[None, :] * stride_kd,
                    mask=n_ok[:, None] & (offs_d[None, :] < D), other=0.0, eviction_policy="evict_first")
        v = tl.load(v_base + n64[:, None] * stride_vn + offs_dv.to(tl.int64)[None, :] * stride_vd,
                    mask=n_ok[:, None] & (offs_dv[None, :] < DV), other=0.0, eviction_policy="evict_first")
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = _scores(tl.dot(q, tl.trans(k), input_precision=PRECISION), sm_scale, softcap, SOFTCAP)
    if ALIBI:  # a per-head slope times the key position, rounded as the original's fp32 ``slopes * arange``
        s = s + slope[:, None] * offs_n.to(tl.float32)[None, :]
    if HAS_START:
        n_ok = n_ok & (offs_n >= kv_first)
    visible = n_ok[None, :] & row_ok[:, None]
    if IS_CAUSAL:
        visible = visible & (offs_n[None, :] <= i[:, None])  # top-left: query i sees keys j <= i
    if MASK_KIND == 1 and MASK_ROW:
        mv = tl.load(mask_ptr + b.to(tl.int64) * stride_mb + n64 * stride_mn, mask=n_ok, other=0)
        visible = visible & (mv != 0)[None, :]
    elif MASK_KIND == 1:
        mv = tl.load(mask_ptr + b.to(tl.int64) * stride_mb + h64[:, None] * stride_mh + i64[:, None] * stride_ml
                     + n64[None, :] * stride_mn, mask=visible, other=0)
        visible = visible & (mv != 0)
    if MASK_KIND == 2 and MASK_ROW:
        s = s + tl.load(mask_ptr + b.to(tl.int64) * stride_mb + n64 * stride_mn, mask=n_ok, other=0.0).to(
            tl.float32)[None, :]
    elif MASK_KIND == 2:
        mv = tl.load(mask_ptr + b.to(tl.int64) * stride_mb + h64[:, None] * stride_mh + i64[:, None] * stride_ml
                     + n64[None, :] * stride_mn, mask=visible, other=0.0).to(tl.float32)
        # natural units, rounded as the original's ``scores + mask`` (see the module docstring); finfo.min absorbs
        # the scores (a row it hides whole ties every key: the mean of V, as the original)
        s = s + mv
    return _softmax_update(acc, m_i, l_i, s, visible, v, UPCAST, PRECISION)


@triton.jit
def _scores(qk, sm_scale, softcap, SOFTCAP: tl.constexpr):
    """Scores (natural units) of the dot products ``qk``: ``qk * sm_scale``; SOFTCAP: ``softcap * tanh(qk *
    sm_scale)``. tanh is written with exp2, stable for any x (libdevice's tanh does not run in the interpreter):
    tanh(x) = sign(x) (1 - e) / (1 + e), e = exp(-2 |x|)."""
    x = qk * sm_scale
    if SOFTCAP:
        e = tl.exp2(tl.abs(x) * -2.8853900817779268)  # exp(-2 |x|) = 2^(-2 log2(e) |x|)
        t = (1.0 - e) / (1.0 + e)
        x = tl.where(x < 0, -t, t) * softcap
    return x


@triton.jit
def _split_share(split, n, num_splits, BLOCK_N: tl.constexpr):
    """Keys [lo, hi) of split ``split`` of ``n`` keys: tiles [s * T // S, (s + 1) * T // S) of the T tiles. Shares
    differ by at most one tile (equal ceil(T / S) shares left the last splits short or empty)."""
    n_tiles = tl.cdiv(n, BLOCK_N)
    lo = (split.to(tl.int64) * n_tiles // num_splits).to(tl.int32) * BLOCK_N
    hi = tl.minimum(((split.to(tl.int64) + 1) * n_tiles // num_splits).to(tl.int32) * BLOCK_N, n)
    return lo, hi


@triton.jit
def _softmax_update(acc, m_i, l_i, s, visible, v, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """One online-softmax step: fold the tile's natural-log scores ``s`` (BLOCK_M, BLOCK_N), hidden where ``visible``
    is False, and its values ``v`` (BLOCK_N, BLOCK_DV) into (acc, m_i, l_i). Returns the new (acc, m_i, l_i).
    Differences from the max are taken in natural units, then scaled by log2(e) for ``exp2``."""
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # empty rows so far: no NaN from -inf - -inf
    alpha = tl.exp2((m_i - m_use) * 1.4426950408889634)
    p = tl.exp2((s - m_use[:, None]) * 1.4426950408889634)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if UPCAST:
        pv = tl.dot(p, v, input_precision=PRECISION)
    else:
        pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i


@triton.jit
def _merged_rows(mb, L, G, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr):
    """The real packed rows of M block ``mb`` for an in-kernel merge, BLOCK_R (>= the real rows) at a time:
    (r (row within the block), g, i, row valid)."""
    r = tl.arange(0, BLOCK_R)
    rows = mb * BLOCK_M + r
    return r, rows // L, rows % L, (r < BLOCK_M) & (rows < G * L)


@triton.jit
def _merge_step(mm, den, acc, pl, po, pll):
    """Fold MERGE_P partial states into a running merge: ``pl`` (MERGE_P, R) natural-log row maxima (-inf: empty or
    padding), ``pll`` (MERGE_P, R) their natural ``log l`` (lse = pl + pll; pass 0 when ``pl`` holds whole LSEs),
    ``po`` (MERGE_P, R, BLOCK_DV) normalised outputs; (mm, den, acc) as in :func:`_attend`'s state.

    The maximum and ``log l`` stay apart because next to a maximum near -3.4e38 (a row that ``finfo.min`` hides,
    whose keys tie) ``pl + pll`` would round to ``pl``: the partials would then weigh the same instead of by their
    key counts, and the merge would not give the original's mean of V."""
    m_new = tl.maximum(mm, tl.max(pl, axis=0))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2((mm - m_use) * 1.4426950408889634)
    w = tl.exp2(((pl - m_use[None, :]) + pll) * 1.4426950408889634)  # 0 for empty partials and padding
    den = den * alpha + tl.sum(w, axis=0)
    acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * po, axis=0)
    return m_new, den, acc


@triton.jit
def _load_partials(o_ptr, lse_ptr, sp, NUM_PARTS, o_row, l_row, ok_c, offs_dv, stride_os, stride_od, stride_ls,
                   stride_lpart, DV):
    """Partials ``sp`` (MERGE_P,) of a merge, read past L1 (other programs of this launch wrote them): row maxima and
    log l (MERGE_P, BLOCK_R), -inf where absent, and outputs (MERGE_P, BLOCK_R, BLOCK_DV)."""
    ok = (sp < NUM_PARTS)[:, None] & ok_c[None, :]
    pl = tl.load(lse_ptr + sp[:, None] * stride_ls + l_row[None, :], mask=ok, other=float("-inf"), cache_modifier=".cg")
    pll = tl.load(lse_ptr + stride_lpart + sp[:, None] * stride_ls + l_row[None, :], mask=ok, other=float("-inf"),
                  cache_modifier=".cg")
    po = tl.load(o_ptr + sp[:, None, None] * stride_os + o_row[None, :, None] + offs_dv[None, None, :] * stride_od,
                 mask=ok[:, :, None] & (offs_dv[None, None, :] < DV), other=0.0, cache_modifier=".cg")
    return pl, pll, po


@triton.jit
def _arrive_and_merge(counter_ptr, tile, arrivals, o_ptr, lse_ptr, out_ptr, lse_out_ptr, mb, b, kvh, offs_dv,
                      stride_os, stride_ob, stride_oh, stride_ol, stride_od, stride_ls, stride_lb, stride_lh,
                      stride_ll, stride_lpart, stride_fb, stride_fh, stride_fl, stride_fd, stride_gb, stride_gh,
                      stride_gl, NUM_PARTS, L, G, DV, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                      MERGE_P: tl.constexpr, WRITE_LSE_OUT: tl.constexpr):
    """The in-launch merge of a split decode: count this program's arrival at output ``tile`` (its partial is stored);
    the ``arrivals``-th program to arrive merges the tile's NUM_PARTS partials, (S, B, Hq, L, Dv) outputs at ``o_ptr``
    and (row max, log l) planes at ``lse_ptr`` / ``lse_ptr + stride_lpart`` (int32 offsets: the workspace is small),
    over the tile's real rows, into the final (B, Hq, L, Dv) ``out_ptr`` and (B, Hq, L) ``lse_out_ptr``, then resets
    the counter (zero before and after every launch)."""
    tl.debug_barrier()  # every thread's partial is stored before the release below
    arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
    if arrived == arrivals - 1:
        tl.debug_barrier()
        r, gc, ic, ok_c = _merged_rows(mb, L, G, BLOCK_M, BLOCK_R)
        hc = kvh * G + gc
        o_row = b * stride_ob + hc * stride_oh + ic * stride_ol
        l_row = b * stride_lb + hc * stride_lh + ic * stride_ll
        offs_p = tl.arange(0, MERGE_P)
        # The common maximum first (the row-max plane only: MERGE_P partials a load, all loads independent), so that
        # each step's weights need nothing from the step before; the steps then run software-pipelined, the next
        # step's partials loaded before this step's sums, and the tail costs about one L2 round trip, not one a step.
        mm = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
        for s0 in range(0, NUM_PARTS, MERGE_P):
            sp = s0 + offs_p
            pl = tl.load(lse_ptr + sp[:, None] * stride_ls + l_row[None, :],
                         mask=(sp < NUM_PARTS)[:, None] & ok_c[None, :], other=float("-inf"), cache_modifier=".cg")
            mm = tl.maximum(mm, tl.max(pl, axis=0))
        m_use = tl.where(mm == float("-inf"), 0.0, mm)  # rows empty in every partial: weights 0, no NaN
        den = tl.zeros([BLOCK_R], dtype=tl.float32)
        acc = tl.zeros([BLOCK_R, offs_dv.shape[0]], dtype=tl.float32)
        pl, pll, po = _load_partials(o_ptr, lse_ptr, offs_p, NUM_PARTS, o_row, l_row, ok_c, offs_dv, stride_os,
                                     stride_od, stride_ls, stride_lpart, DV)
        for s0 in range(0, NUM_PARTS, MERGE_P):
            pl_next, pll_next, po_next = _load_partials(o_ptr, lse_ptr, s0 + MERGE_P + offs_p, NUM_PARTS, o_row, l_row,
                                                        ok_c, offs_dv, stride_os, stride_od, stride_ls, stride_lpart,
                                                        DV)
            w = tl.exp2(((pl - m_use[None, :]) + pll) * 1.4426950408889634)  # 0 for empty partials and padding
            den += tl.sum(w, axis=0)
            acc += tl.sum(w[:, :, None] * po, axis=0)
            pl, pll, po = pl_next, pll_next, po_next
        o2, lse2 = _finish(acc, mm, den)
        _store_rows(o2, lse2, out_ptr, lse_out_ptr, b, kvh, gc, ic, ok_c, offs_dv, stride_fb, stride_fh, stride_fl,
                    stride_fd, stride_gb, stride_gh, stride_gl, G, DV, WRITE_LSE_OUT)
        tl.atomic_xchg(counter_ptr + tile, 0, sem="relaxed", scope="gpu")  # ready for the next launch


@triton.jit
def _finish(acc, m_i, l_i):
    """Normalise a state: (o (BLOCK_M, BLOCK_DV) fp32, lse (BLOCK_M,) natural log); empty rows -> (0, -inf)."""
    empty = l_i == 0.0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
    return o, lse


@triton.jit
def _finish_parts(acc, m_i, l_i):
    """A partial state for a later merge: (o (BLOCK_M, BLOCK_DV) fp32, m, log l (BLOCK_M,) natural log); empty
    rows -> (0, -inf, -inf). See :func:`_merge_step` for why ``m`` and ``log l`` are kept apart."""
    empty = l_i == 0.0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    m = tl.where(empty, float("-inf"), m_i)
    log_l = tl.where(empty, float("-inf"), tl.log(tl.where(empty, 1.0, l_i)))
    return o, m, log_l


@triton.jit
def _store_rows(o, lse, o_ptr, lse_ptr, b, kvh, g, i, row_ok, offs_dv,
                stride_ob, stride_oh, stride_ol, stride_od, stride_lb, stride_lh, stride_ll, G, DV,
                WRITE_LSE: tl.constexpr):
    """Store a finished tile into a (B, Hq, L, Dv) output (any strides, any float dtype) and (B, Hq, L) lse."""
    h64 = (kvh * G + g).to(tl.int64)
    i64 = i.to(tl.int64)
    b64 = b.to(tl.int64)
    ptrs = (o_ptr + b64 * stride_ob + h64[:, None] * stride_oh + i64[:, None] * stride_ol
            + offs_dv.to(tl.int64)[None, :] * stride_od)
    tl.store(ptrs, o.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < DV))
    if WRITE_LSE:
        tl.store(lse_ptr + b64 * stride_lb + h64 * stride_lh + i64 * stride_ll, lse, mask=row_ok)


@triton.jit
def _store_lse(lse, lse_ptr, b, kvh, g, i, row_ok, stride_lb, stride_lh, stride_ll, G):
    """Store a (BLOCK_M,) per-row value (an LSE, or the log l plane of a split state) into a (B, Hq, L) plane."""
    h64 = (kvh * G + g).to(tl.int64)
    tl.store(lse_ptr + b.to(tl.int64) * stride_lb + h64 * stride_lh + i.to(tl.int64) * stride_ll, lse, mask=row_ok)
