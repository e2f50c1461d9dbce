"""``collect``: run a Hugging Face model over long text and keep, per layer and KV head, the de-roped keys of
every position and the de-roped queries of sampled positions (the training set of ``train``).

The model runs with a custom attention function registered through transformers' ``AttentionInterface``: it
sees the rotated query and key states of every layer, records them de-roped, and computes causal SDPA, so the
forward itself is unchanged. Sequences are single rows starting at position 0 (no padding).
"""
from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from .index import ModelIdentity, model_identity
from .rope import RopeSpec, remove_rope, rope_spec_from_config

COLLECT_FORMAT = "attnopt-saap-collection"
COLLECT_VERSION = 1


@dataclass
class SequenceRecord:
    """One sequence: per layer, keys (Hkv, N, D) and queries (Hq, M, D) de-roped fp32, at ``query_positions``."""

    keys: dict[int, Tensor] = field(default_factory=dict)
    queries: dict[int, Tensor] = field(default_factory=dict)
    query_positions: Tensor | None = None  # (M,) int64

    @property
    def length(self) -> int:
        return next(iter(self.keys.values())).shape[1]


@dataclass
class Collection:
    """Everything ``train`` needs: the model's identity and RoPE, and the recorded sequences."""

    identity: ModelIdentity
    rope: RopeSpec
    sequences: list[SequenceRecord]

    def save(self, path: str | Path) -> None:
        from safetensors.torch import save_file

        tensors = {}
        for s, rec in enumerate(self.sequences):
            tensors[f"seq{s}.query_positions"] = rec.query_positions.contiguous()
            for l in rec.keys:
                tensors[f"seq{s}.layer{l}.keys"] = rec.keys[l].contiguous()
                tensors[f"seq{s}.layer{l}.queries"] = rec.queries[l].contiguous()
        meta = {"format": COLLECT_FORMAT, "version": COLLECT_VERSION, "model": self.identity.to_dict(),
                "rope": self.rope.to_dict(), "sequences": len(self.sequences),
                "layers": sorted(self.sequences[0].keys) if self.sequences else []}
        save_file(tensors, str(path), metadata={"saap_collection": json.dumps(meta)})

    @classmethod
    def load(cls, path: str | Path) -> "Collection":
        """Read a collection written by ``save``. ``ValueError`` naming the file where it is not one: not
        safetensors (truncated, garbled), no collection metadata, another format or version, or tensors missing."""
        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"SAAP collection {path} does not exist")
        try:
            with safe_open(str(path), framework="pt") as f:
                raw = (f.metadata() or {}).get("saap_collection")
                names = set(f.keys())
                if raw is None:
                    raise ValueError(f"{path} is not a SAAP collection (no 'saap_collection' metadata)")
                meta = _collection_meta(path, raw)
                seqs = []
                for s in range(int(meta["sequences"])):
                    wanted = [f"seq{s}.query_positions"] + [f"seq{s}.layer{l}.{kind}" for l in meta["layers"]
                                                            for kind in ("keys", "queries")]
                    missing = [n for n in wanted if n not in names]
                    if missing:
                        raise ValueError(f"SAAP collection {path} lacks tensor(s) {', '.join(missing[:3])}")
                    rec = SequenceRecord(query_positions=f.get_tensor(wanted[0]))
                    for l in meta["layers"]:
                        rec.keys[int(l)] = f.get_tensor(f"seq{s}.layer{l}.keys")
                        rec.queries[int(l)] = f.get_tensor(f"seq{s}.layer{l}.queries")
                    seqs.append(rec)
        except ValueError:
            raise
        except Exception as exc:  # safetensors raises its own error types for truncated/garbled headers
            raise ValueError(f"SAAP collection {path} is not a readable safetensors file: {exc}") from None
        return cls(ModelIdentity.from_dict(meta["model"]), RopeSpec.from_dict(meta["rope"]), seqs)


def _collection_meta(path: Path, raw: str) -> dict:
    """The collection's JSON metadata, checked for its format, version and the keys ``load`` reads."""
    try:
        meta = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"SAAP collection {path}: corrupt metadata ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != COLLECT_FORMAT or meta.get("version") != COLLECT_VERSION:
        got = meta if not isinstance(meta, dict) else f"{meta.get('format')!r} v{meta.get('version')}"
        raise ValueError(f"{path}: collection format {got} is not {COLLECT_FORMAT!r} v{COLLECT_VERSION}")
    missing = [k for k in ("sequences", "layers", "model", "rope") if k not in meta]
    if missing:
        raise ValueError(f"SAAP collection {path}: metadata lacks {', '.join(missing)}")
    return meta


@contextlib.contextmanager
def custom_attention(model: Any, name: str, fn: Callable) -> Iterator[None]:
    """Run ``model`` with attention function ``fn`` registered as ``name``; restore its implementation after."""
    from transformers import AttentionInterface

    AttentionInterface.register(name, fn)
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


def causal_sdpa(module: Any, query: Tensor, key: Tensor, value: Tensor, scaling: float | None) -> Tensor:
    """SDPA of the last L positions of a contiguous sequence over all N keys (bottom-right causal), in HF's
    output layout (B, L, Hq, Dv)."""
    L, N = query.shape[2], key.shape[2]
    gqa = query.shape[1] != key.shape[1]
    if L == N:
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=gqa)
    else:
        keep = torch.arange(N, device=key.device)[None, :] <= torch.arange(N - L, N, device=key.device)[:, None]
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=keep, scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2).contiguous()


@torch.no_grad()
def collect(model: Any, sequences: list[Tensor], queries_per_sequence: int = 1024, min_query_position: int = 256,
            seed: int = 0, progress: Any = None) -> Collection:
    """Run ``model`` over each 1-D token sequence and record de-roped keys (all) and queries (a sample).

    Parameters
    ----------
    sequences : list of (N,) int64 token ids; each is one forward pass of batch 1 from position 0.
    queries_per_sequence : how many query positions to keep, sampled uniformly from
        [min_query_position, N) (the long-range queries that ``train`` learns from).
    progress : an optional ``rich.progress.Progress``; one task advances per sequence.
    """
    rope = rope_spec_from_config(model.config)
    gen = torch.Generator().manual_seed(seed)
    records = []
    current: dict[str, Any] = {}

    def record(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        layer = int(module.layer_idx)
        N = key.shape[2]
        pos = current["positions"].to(key.device)
        rec: SequenceRecord = current["record"]
        rec.keys[layer] = remove_rope(key[0], torch.arange(N, device=key.device), rope).cpu()
        rec.queries[layer] = remove_rope(query[0, :, pos], pos, rope).cpu()
        return causal_sdpa(module, query, key, value, scaling), None

    task = progress.add_task("collect", total=len(sequences)) if progress is not None else None
    device = next(model.parameters()).device
    with custom_attention(model, "attnopt_saap_collect", record):
        for ids in sequences:
            n = ids.numel()
            if n <= min_query_position:
                raise ValueError(f"a sequence of {n} tokens has no query position >= {min_query_position}")
            m = min(queries_per_sequence, n - min_query_position)
            positions = torch.randperm(n - min_query_position, generator=gen)[:m].sort().values + min_query_position
            current["positions"], current["record"] = positions, SequenceRecord(query_positions=positions)
            model(input_ids=ids.view(1, -1).to(device), use_cache=False)
            records.append(current["record"])
            if task is not None:
                progress.advance(task)
    return Collection(model_identity(model.config), rope, records)
