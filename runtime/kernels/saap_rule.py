"""SAAP's scoring and selection rule, one definition for the Triton scoring and selection (``saap_select``,
``saap_topl``), the PyTorch reference (``runtime/saap/decode.py``), the plan's CPU path, the quality harness and the
ONNX node: the centroids they score with (``scoring_centroids``), the query MLP's folded 16-bit layers and rounded
inputs (``scoring_mlp``, ``mlp_logits``), then each group's ``probes`` clusters of largest score, ranked on the top
``SELECT_KEY_BITS`` bits of each score's order-preserving key, ties broken by the lowest cluster index. PyTorch
only: here, below ``saap/``, so that the kernels can take the constants.
"""
from __future__ import annotations

from typing import NamedTuple

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


#: The dtype of the query MLP's weights as every scorer reads them (``scoring_mlp``), and of each layer's inputs (the
#: de-roped queries, the hidden units, rounded to nearest even): the products of two bf16 values are exact in fp32
#: and the sums stay fp32, so the GPU's bf16 tensor-core products with fp32 accumulation compute the reference's
#: logits up to the order of the sums. The scoring launch's bytes are the weights: at llama3-8b 128k (8 KV heads,
#: D = 128, hidden 1024, 2048 clusters) 71.3 MB a layer in fp32, 35.7 MB in bf16 (12.1 µs at 2.94 TB/s). The index
#: file keeps fp32 and the BatchNorm apart; ``scoring_mlp`` folds and rounds where a scorer takes them.
MLP_DTYPE = torch.bfloat16


class ScoringMLP(NamedTuple):
    """The query MLP as every scorer computes it: BatchNorm folded into the first layer, weights in ``MLP_DTYPE``.
    w1 (Hkv, H, D) and w2 (Hkv, C, H) 16-bit, contiguous; b1 (Hkv, H) and b2 (Hkv, C) fp32."""

    w1: Tensor
    b1: Tensor
    w2: Tensor
    b2: Tensor


def scoring_mlp(mlp: dict[str, Tensor], eps: float) -> ScoringMLP:
    """Fold an index layer's eval BatchNorm into its first layer (in fp32: ``s = weight * rsqrt(var + eps)``,
    ``w1 * s``, ``(b1 - mean) * s + bias``), then round the two weight matrices to ``MLP_DTYPE`` (read at the call).
    ``mlp``: the index's ``MLP_TENSORS`` (fp32). The result lives on the tensors' device."""
    f = {n: t.float() for n, t in mlp.items()}
    s = f["bn_weight"] * torch.rsqrt(f["bn_var"] + eps)
    return ScoringMLP((f["w1"] * s[..., None]).to(MLP_DTYPE).contiguous(),
                      ((f["b1"] - f["bn_mean"]) * s + f["bn_bias"]).contiguous(),
                      f["w2"].to(MLP_DTYPE).contiguous(), f["b2"].contiguous())


def mlp_input(x: Tensor, dtype: torch.dtype) -> Tensor:
    """A layer's input as the rule rounds it: to ``dtype`` (nearest even), back in fp32."""
    return x.to(dtype).float()


def mlp_logits(mlp: ScoringMLP, x: Tensor) -> Tensor:
    """The rule's query MLP over de-roped queries x (B, Hkv, M, D) float: (B, Hkv, M, C) fp32 logits,
    ``relu(round(x) w1^T + b1)`` rounded, times w2^T, plus b2; every product and sum in fp32."""
    dt = mlp.w1.dtype
    h = torch.einsum("bhmd,hkd->bhmk", mlp_input(x, dt), mlp.w1.float()) + mlp.b1[None, :, None, :]
    return torch.einsum("bhmk,hck->bhmc", mlp_input(torch.relu(h), dt), mlp.w2.float()) + mlp.b2[None, :, None, :]


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
