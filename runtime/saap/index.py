"""The SAAP index artifact: safetensors tensors plus versioned JSON metadata.

Per covered layer and KV head it holds the k-means centroids over de-roped keys (or, with ``rotated``, over the
keys as the cache holds them) and, optionally, the query
MLP (Linear -> BatchNorm -> ReLU -> Linear, stored batched over the KV heads); the metadata holds the RoPE
parameters used to de-rope and the identity of the model it was trained on. ``load_index`` refuses a corrupt
file or one made for another model (name/config hash, layer count, heads, head dim, RoPE) with an error that
names the file and the mismatch.

Tensor names (``l`` a layer, Hkv KV heads, C clusters, D head dim, H the MLP's hidden width):
``layers.l.centroids`` (Hkv, C, D); ``layers.l.mlp.w1`` (Hkv, H, D), ``b1`` (Hkv, H), ``bn_mean``,
``bn_var``, ``bn_weight``, ``bn_bias`` (Hkv, H), ``w2`` (Hkv, C, H), ``b2`` (Hkv, C). All fp32.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..kernels.saap_rule import ScoringMLP, mlp_logits, scoring_centroids, scoring_mlp
from .rope import RopeSpec, remove_rope, rope_spec_from_config

INDEX_FORMAT = "attnopt-saap-index"
INDEX_VERSION = 1
MLP_TENSORS = ("w1", "b1", "bn_mean", "bn_var", "bn_weight", "bn_bias", "w2", "b2")
#: Config fields that make up a model's identity (the hash changes when any of them does).
IDENTITY_FIELDS = ("model_type", "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                   "head_dim", "intermediate_size", "vocab_size", "rope_parameters", "rope_theta")


class SaapIndexError(ValueError):
    """A SAAP index file is unreadable, corrupt, or was built for another model."""


@dataclass(frozen=True)
class ModelIdentity:
    """What an index must match: the model's name, a hash of its architecture config, and its shapes."""

    name: str
    config_hash: str
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelIdentity":
        return cls(name=str(data["name"]), config_hash=str(data["config_hash"]), num_layers=int(data["num_layers"]),
                   num_q_heads=int(data["num_q_heads"]), num_kv_heads=int(data["num_kv_heads"]),
                   head_dim=int(data["head_dim"]))


def model_identity(config: Any, name: str | None = None) -> ModelIdentity:
    """The identity of a Hugging Face config (the hash covers ``IDENTITY_FIELDS``)."""
    raw = {f: getattr(config, f, None) for f in IDENTITY_FIELDS}
    digest = hashlib.sha256(json.dumps(raw, sort_keys=True, default=str).encode()).hexdigest()[:16]
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return ModelIdentity(name=name or getattr(config, "_name_or_path", "") or config.model_type, config_hash=digest,
                         num_layers=int(config.num_hidden_layers), num_q_heads=int(heads),
                         num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads), head_dim=int(head_dim))


@dataclass
class LayerIndex:
    """One layer's centroids (Hkv, C, D) fp32 and optional batched query MLP (``MLP_TENSORS`` -> tensors)."""

    centroids: Tensor
    mlp: dict[str, Tensor] | None = None
    _scoring: tuple | None = field(default=None, repr=False, compare=False)  # (key, ScoringMLP) of scoring_mlp

    def scoring_mlp(self, eps: float) -> ScoringMLP:
        """The MLP as the rule scores with it (``saap_rule.scoring_mlp``: BatchNorm folded, 16-bit weights), made
        once per eps, dtype and device. Raises ``ValueError`` for a layer without an MLP."""
        from ..kernels import saap_rule

        if self.mlp is None:
            raise ValueError("this SAAP layer has no query MLP (centroid scoring)")
        key = (float(eps), saap_rule.MLP_DTYPE, self.mlp["w1"].device)
        if self._scoring is None or self._scoring[0] != key:
            self._scoring = (key, scoring_mlp(self.mlp, eps))
        return self._scoring[1]

    def to(self, device: torch.device | str) -> "LayerIndex":
        mlp = {k: t.to(device) for k, t in self.mlp.items()} if self.mlp is not None else None
        return LayerIndex(self.centroids.to(device), mlp)


@dataclass
class SaapIndex:
    """A loaded (or freshly trained) index. ``layers`` maps a layer number to its ``LayerIndex``."""

    identity: ModelIdentity
    rope: RopeSpec
    layers: dict[int, LayerIndex]
    bn_eps: float = 1e-5
    #: Free-form training facts (context, keys per cluster, steps, ...), kept in the metadata.
    train_info: dict[str, Any] = field(default_factory=dict)
    #: Clusters over the keys as the cache holds them (rotated) instead of de-roped, queries scored rotated too.
    #: Better where decode stays within the positions trained on (measured at 4k: oracle recall +2 points);
    #: the paper's de-roping is what extrapolates past them.
    rotated: bool = False
    #: Lloyd passes over each prompt's own keys at prefill, from these centroids (``build.fit_to_prompt``); decode
    #: then scores with the means of the prompt's clusters. 0: the trained centroids as they are (an index of before
    #: the option).
    refine: int = 0

    @property
    def num_clusters(self) -> int:
        return next(iter(self.layers.values())).centroids.shape[1]

    def decode_defaults(self) -> dict[str, int]:
        """The ``probes``, ``sink`` and ``window`` decode uses when the user gives none (``saap_probes`` ... of
        ``attnopt.optimize`` left at None): what training recommended (``train_info["decode"]``), else the paper's
        l = 32, sink 1, window 2047 (an index of before the recommendation)."""
        rec = self.train_info.get("decode") or {}
        return {"probes": int(rec.get("probes", 32)), "sink": int(rec.get("sink", 1)),
                "window": int(rec.get("window", 2047))}

    @property
    def has_mlp(self) -> bool:
        return all(li.mlp is not None for li in self.layers.values())

    def to(self, device: torch.device | str) -> "SaapIndex":
        return SaapIndex(self.identity, self.rope, {l: li.to(device) for l, li in self.layers.items()}, self.bn_eps,
                         dict(self.train_info), self.rotated, self.refine)

    def without_mlp(self) -> "SaapIndex":
        """The training-free baseline: the same clusters, scored by centroids."""
        return SaapIndex(self.identity, self.rope, {l: LayerIndex(li.centroids) for l, li in self.layers.items()},
                         self.bn_eps, dict(self.train_info), self.rotated, self.refine)

    def check_model(self, config: Any, path: str | Path = "<index>") -> None:
        """``SaapIndexError`` naming ``path`` and the mismatch when ``config`` is not the model this index is for."""
        mine, theirs = self.identity, model_identity(config)

        def differ(name: str) -> None:
            if getattr(mine, name) != getattr(theirs, name):
                raise SaapIndexError(f"SAAP index {path} was built for another model: {name} is {getattr(mine, name)} "
                                     f"in the index ({mine.name}) but {getattr(theirs, name)} in the model")

        for name in ("num_layers", "num_q_heads", "num_kv_heads", "head_dim"):
            differ(name)
        try:  # before the hash, which covers the RoPE too: name the RoPE when that is what differs
            rope = rope_spec_from_config(config)
        except ValueError as exc:
            raise SaapIndexError(f"SAAP index {path}: {exc}") from None
        if rope != self.rope:
            raise SaapIndexError(f"SAAP index {path} has RoPE {self.rope.to_dict()} but the model has {rope.to_dict()}")
        differ("config_hash")

    # ------------------------------------------------------------------------------------------ scoring
    def cluster_scores(self, layer: int, q: Tensor, positions: Tensor, scale: float,
                       centroids: Tensor | None = None) -> Tensor:
        """Group-summed cluster scores of queries ``q`` (B, Hq, L, D) (rotated) at ``positions`` (L,) or (B, L).

        Each query head gets a distribution over the C clusters (the MLP's softmax, as the rule computes it:
        ``saap_rule.mlp_logits`` with the BatchNorm folded and 16-bit weights and inputs, or without an MLP the
        softmax of ``scale * q . centroid``, with ``centroids`` (Hkv, C, D) when given: the ones refined at
        prefill, ``ClusterState.centroids``); the G heads of a group are summed, as the paper picks a group's
        clusters jointly. Returns (B, Hkv, L, C) fp32 (the L tokens are kept apart; sum them for a joint pick).
        """
        li = self.layers[layer]
        B, Hq, L, D = q.shape
        cents = li.centroids if centroids is None else centroids
        Hkv, C, _ = cents.shape
        pos = positions if positions.dim() == 1 else positions[:, None, :]
        qd = (q.float() if self.rotated else remove_rope(q, pos, self.rope)).reshape(B, Hkv, Hq // Hkv * L, D)
        if li.mlp is None:
            # the centroids as the kernel reads them (the rule's rounding), the products in fp32
            logits = torch.einsum("bhmd,hcd->bhmc", qd, scoring_centroids(cents).to(qd.device, torch.float32)) * scale
        else:
            logits = mlp_logits(li.scoring_mlp(self.bn_eps), qd)
        return torch.softmax(logits, dim=-1).reshape(B, Hkv, Hq // Hkv, L, C).sum(dim=2)

    # ------------------------------------------------------------------------------------------ save
    def metadata(self) -> dict[str, Any]:
        return {"format": INDEX_FORMAT, "version": INDEX_VERSION, "model": self.identity.to_dict(),
                "rope": self.rope.to_dict(), "layers": sorted(self.layers), "num_clusters": self.num_clusters,
                "mlp": self.has_mlp, "bn_eps": self.bn_eps, "train": self.train_info, "rotated": self.rotated,
                "refine": self.refine}

    def save(self, path: str | Path) -> None:
        from safetensors.torch import save_file

        tensors: dict[str, Tensor] = {}
        for l, li in self.layers.items():
            tensors[f"layers.{l}.centroids"] = li.centroids.float().contiguous().cpu()
            for name, t in (li.mlp or {}).items():
                tensors[f"layers.{l}.mlp.{name}"] = t.float().contiguous().cpu()
        save_file(tensors, str(path), metadata={"saap": json.dumps(self.metadata(), sort_keys=True)})


def load_index(path: str | Path, config: Any = None) -> SaapIndex:
    """Read an index; with ``config``, also check that it was built for that model (``SaapIndexError`` if not)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"SAAP index {path} does not exist")
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            raw = (f.metadata() or {}).get("saap")
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as exc:  # safetensors raises its own error types for truncated/garbled headers
        raise SaapIndexError(f"SAAP index {path} is not a readable safetensors file: {exc}") from None
    if raw is None:
        raise SaapIndexError(f"SAAP index {path} has no 'saap' metadata: not an attnopt SAAP index")
    try:
        meta = json.loads(raw)
        if meta.get("format") != INDEX_FORMAT:
            raise SaapIndexError(f"SAAP index {path}: format {meta.get('format')!r}, expected {INDEX_FORMAT!r}")
        if meta.get("version") != INDEX_VERSION:
            raise SaapIndexError(f"SAAP index {path}: version {meta.get('version')} is not supported "
                                 f"(this attnopt reads version {INDEX_VERSION})")
        identity = ModelIdentity.from_dict(meta["model"])
        rope = RopeSpec.from_dict(meta["rope"])
        layer_ids = [int(l) for l in meta["layers"]]
        want_mlp = bool(meta["mlp"])
        C = int(meta["num_clusters"])
    except (KeyError, TypeError, json.JSONDecodeError) as exc:
        raise SaapIndexError(f"SAAP index {path}: corrupt metadata ({type(exc).__name__}: {exc})") from None
    layers = {}
    for l in layer_ids:
        if not 0 <= l < identity.num_layers:
            raise SaapIndexError(f"SAAP index {path}: layer {l} outside the model's {identity.num_layers} layers")
        cent = tensors.get(f"layers.{l}.centroids")
        want = (identity.num_kv_heads, C, identity.head_dim)
        if cent is None or tuple(cent.shape) != want:
            got = None if cent is None else tuple(cent.shape)
            raise SaapIndexError(f"SAAP index {path}: layers.{l}.centroids has shape {got}, expected {want}")
        mlp = None
        if want_mlp:
            missing = [n for n in MLP_TENSORS if f"layers.{l}.mlp.{n}" not in tensors]
            if missing:
                raise SaapIndexError(f"SAAP index {path}: layer {l} lacks MLP tensors {', '.join(missing)}")
            mlp = {n: tensors[f"layers.{l}.mlp.{n}"] for n in MLP_TENSORS}
            if mlp["w2"].shape[:2] != (identity.num_kv_heads, C) or mlp["w1"].shape[2] != identity.head_dim:
                raise SaapIndexError(f"SAAP index {path}: layer {l}'s MLP shapes {tuple(mlp['w1'].shape)}, "
                                     f"{tuple(mlp['w2'].shape)} do not match {identity.num_kv_heads} KV heads, "
                                     f"{C} clusters, head dim {identity.head_dim}")
        layers[l] = LayerIndex(cent.float(), mlp)
    if not layers:
        raise SaapIndexError(f"SAAP index {path} covers no layer")
    index = SaapIndex(identity, rope, layers, float(meta.get("bn_eps", 1e-5)), dict(meta.get("train") or {}),
                      bool(meta.get("rotated", False)),  # absent: an index of before the option, de-roped
                      int(meta.get("refine", 0)))
    if config is not None:
        index.check_model(config, path)
    return index


def synthetic_index(q_heads: int, kv_heads: int, head_dim: int, clusters: int, layers: tuple[int, ...] = (1,),
                    num_layers: int | None = None, centroids: Tensor | None = None, seed: int = 0,
                    rope_theta: float = 10000.0) -> SaapIndex:
    """An index with given (or random normal) centroids and no MLP, for a model of the given shapes: tests and
    the synthetic-key benchmarks. ``centroids`` is (Hkv, C, D); the same set serves every layer."""
    gen = torch.Generator().manual_seed(seed)
    cents = centroids if centroids is not None else torch.randn(kv_heads, clusters, head_dim, generator=gen)
    ident = ModelIdentity("synthetic", "synthetic", num_layers or max(layers) + 1, q_heads, kv_heads, head_dim)
    return SaapIndex(ident, RopeSpec(rope_theta, head_dim), {l: LayerIndex(cents.float().clone()) for l in layers})
