"""``AttentionSite``: what one attention call in a graph is, as the planner sees it."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

#: How the mask of a site was classified by ``passes.detect``.
MASK_KINDS = (
    "none",          # no mask, not causal
    "causal",        # is_causal=True with PyTorch's top-left alignment
    "valid_length",  # a padding / valid-length mask as HF static caches build it
    "arbitrary",     # any other boolean or additive mask, passed through as a tensor
)

#: How the K/V heads reach the attention call.
GQA_SOURCES = ("mha", "enable_gqa", "repeat_kv", "repeat_interleave")


@dataclass(frozen=True)
class AttentionSite:
    """One attention call found in an FX graph.

    Shapes follow the Hugging Face layout: Q is (B, Hq, q_len, head_dim), K/V are (B, Hkv, kv_len, head_dim).
    ``kv_len`` is ``None`` when it is symbolic at compile time. ``unsupported`` holds the reason the site
    is left untouched, or ``None`` when it can be rewritten.
    """

    node: str
    module_path: str
    pattern: str
    batch: int | None
    q_heads: int
    kv_heads: int
    head_dim: int
    q_len: int | None
    kv_len: int | None
    dtype: str
    mask_kind: str = "none"
    scale: float | None = None
    is_causal: bool = False
    gqa_source: str = "mha"
    v_head_dim: int | None = None
    kv_layout: str = "bhnd"
    kv_len_hint: int | None = None
    #: Keys [0, P) of K/V are one (1, Hkv, P, D) tensor broadcast over the batch (``passes/patterns/prefix.py``
    #: proves it): P, or None when no shared prefix is proven. The cascade plan attends it once for all rows.
    shared_prefix: int | None = None
    unsupported: str | None = None
    #: Keys a query row attends to when the site is a sliding window (the module's window, or one proved in the
    #: mask), else None. The kernels then read only the keys from the window's first one (found on device).
    window: int | None = None
    #: c when the scores are logit-softcapped as ``c * tanh(s)`` (Gemma 2's ``tanh(s / cap) * cap``, the
    #: ``1 / cap`` folded into ``scale``), else None.
    softcap: float | None = None
    #: Whether the scores get ALiBi (a per-head slope times the key position), proved in the graph; the op then
    #: takes the slopes (Hq,) instead of reading a bias tensor.
    alibi: bool = False

    def __post_init__(self) -> None:
        if self.mask_kind not in MASK_KINDS:
            raise ValueError(f"unknown mask kind {self.mask_kind!r}; valid: {', '.join(MASK_KINDS)}")
        if self.gqa_source not in GQA_SOURCES:
            raise ValueError(f"unknown GQA source {self.gqa_source!r}; valid: {', '.join(GQA_SOURCES)}")
        if self.window is not None and (not isinstance(self.window, int) or self.window < 1):
            raise ValueError(f"window must be a positive int or None; got {self.window!r}")
        if self.softcap is not None and not self.softcap:
            raise ValueError("softcap must be a nonzero number or None; got 0")

    @property
    def group_size(self) -> int:
        return self.q_heads // self.kv_heads if self.kv_heads else 0

    @property
    def effective_kv_len(self) -> int | None:
        """The KV length to plan for: the static length, else the trace-time hint."""
        return self.kv_len if self.kv_len is not None else self.kv_len_hint

    @property
    def keys_read(self) -> int | None:
        """Keys a decode kernel reads per row: a window's ``window + q_len - 1`` (the band of the last query rows),
        at most the planned length; else the planned length."""
        n = self.effective_kv_len
        if self.window is None:
            return n
        band = self.window + (self.q_len or 1) - 1
        return band if n is None else min(n, band)

    def variant_str(self) -> str:
        """The attention variant for the plan table: ``window=4096``, ``softcap=50``, both, or ""."""
        parts = ([f"window={self.window}"] if self.window is not None else []) + \
            ([f"softcap={self.softcap:g}"] if self.softcap is not None else []) + (["alibi"] if self.alibi else [])
        return " ".join(parts)

    @property
    def dtype_bytes(self) -> int:
        return {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}.get(self.dtype, 2)

    def shape_str(self) -> str:
        """Every known size, ``?`` for an unknown one, ``N~hint`` for a symbolic KV length traced at ``hint``.

        E.g. ``B=1 H=32/8 q=1 N=8192 D=128``, ``B=1 H=9/3 q=? N~37 D=64``. Head counts and head dims of 0 are
        the detector's "unknown" (symbolic or no fake value) and print as ``?``.
        """
        def known(x: int | None, zero_unknown: bool = False) -> str:
            return "?" if x is None or (zero_unknown and x == 0) else str(x)

        if self.kv_len is not None:
            n = f"N={self.kv_len}"
        elif self.kv_len_hint is not None:
            n = f"N~{self.kv_len_hint}"
        else:
            n = "N=?"
        d = f"D={known(self.head_dim, True)}"
        if self.v_head_dim is not None and self.v_head_dim != self.head_dim:
            d += f" Dv={self.v_head_dim}"
        prefix = f" prefix={self.shared_prefix}" if self.shared_prefix is not None else ""
        return (f"B={known(self.batch)} H={known(self.q_heads, True)}/{known(self.kv_heads, True)} "
                f"q={known(self.q_len)} {n}{prefix} {d}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "AttentionSite":
        """The site of ``to_dict``'s JSON. A field of the wrong JSON type (a plan log edited by hand, or written by
        something else) raises ``TypeError`` naming it: ``node`` as a list reached the plan table, where it raised
        deep inside rich."""
        for f in dataclasses.fields(cls):
            if f.name in data:
                _check_field(f.name, str(f.type), data[f.name])
        return cls(**data)

    @classmethod
    def canonical(cls, **overrides: Any) -> "AttentionSite":
        """A llama3-8b-shaped decode site (32/8 heads, D=128, 8k keys, bf16), for tests and ``explain``."""
        base = dict(node="sdpa", module_path="model.layers.0.self_attn", pattern="sdpa", batch=1, q_heads=32,
                    kv_heads=8, head_dim=128, q_len=1, kv_len=8192, dtype="bfloat16", gqa_source="enable_gqa")
        base.update(overrides)
        return cls(**base)


#: The JSON value types a field annotation admits (ints are numbers too; a bool is neither).
_FIELD_TYPES = {"str": (str,), "int": (int,), "float": (int, float), "bool": (bool,)}


def _check_field(name: str, annotation: str, value: Any) -> None:
    kinds = [k.strip() for k in annotation.split("|")]
    if value is None and "None" in kinds:
        return
    ok = any(isinstance(value, _FIELD_TYPES.get(k, (object,))) and (k == "bool" or not isinstance(value, bool))
             for k in kinds if k != "None")
    if not ok:
        raise TypeError(f"site field {name!r} must be {annotation}, got {type(value).__name__} {value!r}")
