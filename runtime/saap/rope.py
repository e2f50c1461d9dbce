"""RoPE parameters of a model and their inverse: SAAP clusters keys and queries *without* their rotary
position encoding (the paper's de-roping), while attention itself keeps the rotated vectors.

Only Llama's default rotate-half RoPE is supported (``rope_type`` "default"): the rotation of a pair of dims
by ``pos * inv_freq``. Scaled variants (llama3, yarn, longrope, dynamic, linear) change frequencies and
magnitudes with the context; they are refused with a clear error rather than de-roped wrongly.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor

SUPPORTED_ROPE_TYPES = ("default",)


@dataclass(frozen=True)
class RopeSpec:
    """The rotary embedding SAAP inverts: ``inv_freq[i] = theta ** (-2 i / rotary_dim)``."""

    #: The RoPE base (``config.rope_parameters["rope_theta"]`` in transformers 5.x).
    theta: float
    #: Dims rotated (the head dim for Llama; partial rotary factors are refused).
    rotary_dim: int
    #: Always "default" for now (see ``SUPPORTED_ROPE_TYPES``).
    rope_type: str = "default"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RopeSpec":
        return cls(theta=float(data["theta"]), rotary_dim=int(data["rotary_dim"]),
                   rope_type=str(data.get("rope_type", "default")))

    def inv_freq(self, device: torch.device | str = "cpu") -> Tensor:
        """(rotary_dim / 2,) fp32, as Llama's rotary embedding computes it."""
        steps = torch.arange(0, self.rotary_dim, 2, dtype=torch.int64, device=device).float()
        return 1.0 / (self.theta ** (steps / self.rotary_dim))


def rope_spec_from_config(config: Any) -> RopeSpec:
    """The ``RopeSpec`` of a Hugging Face config; ``ValueError`` naming the RoPE type when it is not supported."""
    params = getattr(config, "rope_parameters", None) or {}
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"per-layer-type RoPE parameters ({', '.join(params)}) are not supported by SAAP")
    rope_type = (params.get("rope_type") or params.get("type") or "default") if isinstance(params, dict) else "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"SAAP cannot de-rope rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    if theta is None:
        theta = getattr(config, "rope_theta", None)  # transformers 4.x configs
    if theta is None:
        raise ValueError("the model config has no RoPE base (rope_parameters['rope_theta'] or rope_theta)")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) if isinstance(params, dict) else 1.0
    if factor not in (None, 1.0, 1):
        raise ValueError(f"SAAP does not support partial rotary embeddings (partial_rotary_factor={factor})")
    return RopeSpec(theta=float(theta), rotary_dim=int(head_dim), rope_type=rope_type)


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _cos_sin(spec: RopeSpec, positions: Tensor, head_dim: int) -> tuple[Tensor, Tensor]:
    if head_dim != spec.rotary_dim:
        raise ValueError(f"head dim {head_dim} does not match the RoPE's rotary dim {spec.rotary_dim}")
    freqs = positions.to(torch.float32)[..., None] * spec.inv_freq(positions.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: Tensor, positions: Tensor, spec: RopeSpec) -> Tensor:
    """Rotate ``x`` (..., N, D) by positions (N,) or broadcastable (..., N); fp32 math, ``x``'s dtype out."""
    cos, sin = _cos_sin(spec, positions, x.shape[-1])
    xf = x.float()
    return (xf * cos + _rotate_half(xf) * sin).to(x.dtype)


def remove_rope(x: Tensor, positions: Tensor, spec: RopeSpec) -> Tensor:
    """Undo ``apply_rope``: rotate ``x`` (..., N, D) back by ``-positions``. Returns fp32.

    The rotation of each (i, i + D/2) pair is orthogonal, so the inverse is the rotation by the opposite angle:
    ``x = x_r cos - rotate_half(x_r) sin``.
    """
    cos, sin = _cos_sin(spec, positions, x.shape[-1])
    xf = x.float()
    return xf * cos - _rotate_half(xf) * sin
