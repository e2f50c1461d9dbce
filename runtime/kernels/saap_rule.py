"""SAAP's selection rule, one definition for the Triton selection (``saap_topl``), the PyTorch reference
(``runtime/saap/decode.py``), the plan's CPU path, the quality harness and the ONNX node: the centroids they score
with (``scoring_centroids``), then each group's ``probes`` clusters of largest score, ranked on the top
``SELECT_KEY_BITS`` bits of each score's order-preserving key, ties broken by the lowest cluster index. PyTorch
only: here, below ``saap/``, so that the kernels can take the constants.
"""
from __future__ import annotations

import torch
from torch import Tensor

#: Bits of each score's order-preserving key that the selection ranks on (``selection_keys``): 16, the score cut to
#: bf16's sign, exponent and 7 mantissa bits, so that the kernel's radix select finds the threshold in at most four
#: 4-bit rounds (on the llama3-8b 128k/512k 5 % bench sets, 32-bit keys took 3 to 6 a head, the slowest of the 8 heads,
#: which sets the time, 5 or 6); the ties this makes at the threshold (1 to 3 extra clusters in about 60 % of those
#: heads) are broken by the lowest cluster index, so the pick is still exactly ``probes`` clusters.
SELECT_KEY_BITS = 16
#: The dtype the centroid scoring reads the centroids in (``scoring_centroids``; products and sums stay fp32): the
#: scoring launch's bytes are the centroids (8 MB a layer in fp32 at llama3-8b 128k, 2048 clusters), so bf16 halves its
#: HBM reads. The index file keeps fp32; the rounding happens where a scorer takes them. On the H100 (a650ee5,
#: llama3-8b 5 %, ``benchmarks/saap_pieces.py`` rows -c16 / -c32 in one run, the same set) the whole call took 33.49 µs
#: at 128k against 36.14 / 35.86 with fp32 (cuDNN 180.25: 5.38x), 66.03 at 512k against 68.46 / 68.05 (10.5x); the
#: scoring alone 5.08 against 8.38, the fused scoring and selection 13.92 against 17.41.
CENTROID_DTYPE = torch.bfloat16


def scoring_centroids(centroids: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """The centroids as every scorer reads them (the Triton scoring, the reference and the plan's CPU path, the quality
    harness, the ONNX node): rounded to ``dtype`` (None: ``CENTROID_DTYPE``, read at the call), contiguous.
    centroids (Hkv, C, D) float -> (Hkv, C, D) in that dtype (the input itself when it already is)."""
    return centroids.to(dtype or CENTROID_DTYPE).contiguous()


def selection_keys(scores: Tensor, bits: int = SELECT_KEY_BITS) -> Tensor:
    """The selection's rank of each score: the top ``bits`` bits of its order-preserving 32-bit key (negative
    floats' magnitude bits flipped, then the sign bit; -0.0 counts as 0.0), as the Triton selection computes it.
    scores (..., C) float -> (..., C) int64 in [0, 2^bits)."""
    s = scores.float()
    s = torch.where(s == 0, torch.zeros_like(s), s)
    u = s.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    key = torch.where(u >= 1 << 31, u ^ 0x7FFFFFFF, u) ^ (1 << 31)
    return key >> (32 - bits)


def top_clusters(scores: Tensor, probes: int, bits: int = SELECT_KEY_BITS) -> Tensor:
    """The selection rule, the kernel's and the reference's (every SAAP pick goes through here): the ``probes``
    clusters of largest ``selection_keys`` (the scores cut to SELECT_KEY_BITS bits), ties broken by the lowest
    cluster index (``bits``: another key width, which only the kernel's timing variants take).
    scores (..., C) -> (..., probes) int64 cluster indices, best first."""
    C = scores.shape[-1]
    probes = max(0, min(int(probes), C))
    low = max(1, (C - 1).bit_length())  # the index's bits: below the key, inverted so that lower indices rank higher
    ranked = (selection_keys(scores, bits) << low) | ((1 << low) - 1 - torch.arange(C, device=scores.device))
    return ranked.topk(probes, dim=-1).indices


def threshold_clusters(scores: Tensor, probes: int, bits: int = SELECT_KEY_BITS) -> Tensor:
    """``top_clusters`` as a mask, as the kernel picks: scores (..., C) -> boolean (..., C), exactly
    max(1, min(probes, C)) set per row."""
    chosen = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    return chosen.scatter_(-1, top_clusters(scores, max(1, int(probes)), bits), True)
