"""Pieces shared by the decode kernels on the host (launch geometry, masks, TMA descriptors); on the device, the
KV-tile loop is in ``attend.py`` and the merges of partial states and the stores are in ``partials.py``.

Conventions (the same as ``runtime/reference.py``; ``attend.py`` states how scores are rounded):

* Q is (B, Hq, L, D); K is (B, Hkv, N, D); V is (B, Hkv, N, Dv); Hq = G * Hkv and query head ``h`` reads KV
  head ``h // G``.
* The G * L query rows of one KV head are packed into one tile: packed row ``r = g * L + i`` is query head
  ``kvh * G + g`` at query position ``i``. Rows are cut into blocks of ``BLOCK_M`` (a power of two >= 16 so
  that ``tl.dot`` can run on them); padding rows are masked.
* States are (o, lse) with natural-log LSEs in fp32. Empty rows (no visible key) give o = 0 and lse = -inf.
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

from attnopt.cost.traffic import head_chunk_widths

from . import interpreting
# the KV-tile loop's pieces, imported from here by kernels that predate attend.py (saap.py)
from .attend import (_attend, _attend_tile, _load_q, _row_coords, _softmax_update,  # noqa: F401
                     _split_share)

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


def kv_descriptors(k: torch.Tensor, v: torch.Tensor, block_n: int, split: tuple[int, int] = (0, 0)):
    """Tensor descriptors for bulk (TMA) copies of (1, 1, block_n, padded D) K/V tiles, or None when this input
    cannot take them: not Hopper or newer (nor the interpreter), a Triton without descriptors, a last dim that is
    not contiguous, or strides and base not 16-byte aligned (the copy engine's rules).

    ``split`` = (d_lo, d_hi) with d_lo > 0 (:func:`head_dim_split`): four descriptors, K and V columns [0, d_lo) in
    (1, 1, block_n, d_lo) boxes, then K[..., d_lo:] and V[..., d_lo:] in (1, 1, block_n, d_hi) boxes (the columns
    past D arrive as zeros)."""
    d_lo, d_hi = split
    if k.device.type == "cuda":
        if device_major(k.device.index) < 9:
            return None
    elif not interpreting():
        return None
    if _tensor_descriptor_cls() is None:
        return None
    parts = [(k, d_lo), (v, d_lo)]
    if d_lo:
        parts += [(k[..., d_lo:], d_hi), (v[..., d_lo:], d_hi)]
    descs = []
    for t, width in parts:
        item = t.element_size()
        if (t.dim() != 4 or t.stride(-1) != 1 or t.data_ptr() % 16 or min(t.shape) == 0
                or any((s * item) % 16 for s in t.stride()[:-1])):
            return None
        descs.append(_descriptor(t, [1, 1, block_n, width or block_d_for(t.shape[-1])]))
    return tuple(descs)


def head_dim_split(head_dim: int, head_dim_v: int) -> tuple[int, int]:
    """How the kernels cut the head dims: (width of the first chunk, width of the second), both powers of two, or
    (0, 0) to run them in one chunk padded to a power of two (``attnopt.cost.traffic.head_chunk_widths``: 72, 80
    and 96 as 64 + 32, the columns past D masked; 160, 192). Padded to 128, D=80 spends 37 % of Q.K's and P.V's MMA
    work, shared memory and TMA box on zeros (ptxas, sm_90, bf16, 128-key tiles, 3 stages, TMA: 139 KB of shared
    memory, one program per SM; as 64 + 32: 105 KB, two). A 16-wide second chunk (80 = 64 + 16 exactly) spilled 784
    bytes there where the 32-wide one spills none. ``ATTNOPT_HEAD_CHUNKS=0`` turns cutting off (for comparisons)."""
    if os.environ.get("ATTNOPT_HEAD_CHUNKS", "1") == "0":
        return 0, 0
    return head_chunk_widths(head_dim, head_dim_v)


def tail_in_loop(use_tma: bool, valid_len: torch.Tensor | None, is_causal: bool) -> bool:
    """Whether the KV loop runs the tile crossing the last key itself (a kernel's ``PAST_ZERO``): with TMA tiles and
    the keys ending at the tensors' own N (no valid length, no causal cut), where the copy engine reads the rows past
    N as zeros. ``ATTNOPT_TAIL_IN_LOOP=0`` runs that tile after the loop instead, as before (for comparisons); exact
    either way."""
    return use_tma and valid_len is None and not is_causal and os.environ.get("ATTNOPT_TAIL_IN_LOOP", "1") != "0"


def prefetch_applies(k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether a kernel launched on ``k``/``v`` may prefetch whole tiles into L2 (``tile_ops``' PREFETCH): compiled
    for a Hopper-or-newer GPU (the instructions are PTX; the interpreter runs none), each (batch row, KV head)'s rows
    one contiguous run of 16-byte-aligned rows of at most 512 bytes (the line-by-line form covers 4 lines a row)."""
    if k.device.type != "cuda" or interpreting() or device_major(k.device.index) < 9:
        return False
    return all(t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] and (t.shape[-1] * t.element_size()) % 16 == 0
               and t.shape[-1] * t.element_size() <= 512 and t.data_ptr() % 16 == 0 for t in (k, v))


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
                  key_start: torch.Tensor | None = None, alibi_slopes: torch.Tensor | None = None,
                  split: tuple[int, int] | None = None):
    """The inputs both decode kernels take first, and how to read them.

    Returns
    -------
    pointers : (q, k, v, K tiles, V tiles, mask, valid_len, key_start, alibi_slopes): the tiles are TMA descriptors
        when ``tma`` is asked for and applies to this launch (``tma_now``), else K and V again; an absent mask,
        valid length, key start or slopes tensor is q (never read). With ``split`` given (the head split
        (d_lo, d_hi) of :func:`head_dim_split`; (0, 0) for none) the V tiles are followed by the second chunk's K
        and V tiles (descriptors of K[..., d_lo:] and V[..., d_lo:] where d_lo > 0 and the tiles are descriptors,
        else K and V again).
    mask_strides, mask_kind : from :func:`mask_args`.
    use_tma : whether the tiles are descriptors.
    """
    mask, mask_strides, mask_kind = mask_args(attn_mask, geo.B, geo.Hq, geo.L, geo.N)
    descs = kv_descriptors(k, v, block_n, split or (0, 0)) if tma and tma_now(q.device) else None
    tiles = descs if descs is not None else (k, v)
    if split is not None and len(tiles) == 2:
        tiles = tiles + tiles
    if key_start is not None and tuple(key_start.shape) != (geo.B,):
        raise ValueError(f"key_start must have shape (B,) = ({geo.B},); got {tuple(key_start.shape)}")
    if alibi_slopes is not None and (tuple(alibi_slopes.shape) != (geo.Hq,) or alibi_slopes.stride(0) != 1
                                     or not alibi_slopes.dtype.is_floating_point):
        raise ValueError(f"alibi_slopes must be a contiguous float tensor of shape (Hq,) = ({geo.Hq},); got "
                         f"{tuple(alibi_slopes.shape)} {alibi_slopes.dtype}")
    pointers = (q, k, v, *tiles, mask if mask is not None else q,
                valid_len if valid_len is not None else q, key_start if key_start is not None else q,
                alibi_slopes if alibi_slopes is not None else q)
    return pointers, mask_strides, mask_kind, descs is not None
