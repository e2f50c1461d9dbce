"""Quality of SAAP against dense attention on a real model, in one harness.

A sequence of P + T tokens is prefilled densely for its first P tokens (the prompt); the index is built over
the prompt's keys; then its last T tokens run through the model in one call with SAAP attention, each token
attending to exactly what a decode step at its position would (sink, every key from ``P - window`` up to
itself, and its own top-``probes`` clusters over the indexed keys). Against the dense run of the same tokens
this measures the recall of attention mass (the dense softmax mass of the attended keys, on the sparse run's
own queries and keys), the next-token agreement, the perplexity, and the selectivity (attended keys over
visible keys, averaged over layers >= 1, KV heads and tokens). A synthetic passkey test prefills a haystack with
a needle, then asks for it with SAAP attention for the question and every generated token.

Text comes from Python's own ``pydoc_data.topics``: the topics alternate between the training and the evaluation
part, so the two never share a passage.
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .build import ClusterState, build_clusters
from .collect import causal_sdpa, custom_attention
from .decode import attended_keys, select_clusters
from .index import SaapIndex

PARTS = ("train", "eval")
#: Window as a fraction of the context for each target selectivity (8k: 32, 64, 128, 256 keys).
WINDOW_FRACTION = {0.02: 1 / 256, 0.05: 1 / 128, 0.10: 1 / 64, 0.20: 1 / 32}


def corpus_text(part: str) -> str:
    """The training or evaluation text: alternate ``pydoc_data.topics`` entries, in sorted order."""
    if part not in PARTS:
        raise ValueError(f"unknown text part {part!r}; valid: {', '.join(PARTS)}")
    from pydoc_data.topics import topics

    names = sorted(topics)[PARTS.index(part)::2]
    return "\n\n".join(topics[n] for n in names)


def token_windows(tokenizer: Any, part: str, length: int, count: int) -> list[Tensor]:
    """``count`` disjoint windows of ``length`` tokens of one text part; ``ValueError`` when it is too short."""
    ids = tokenizer(corpus_text(part), return_tensors="pt").input_ids[0]
    if ids.numel() < length * count:
        raise ValueError(f"the {part} text has {ids.numel()} tokens, fewer than {count} windows of {length}")
    return [ids[i * length:(i + 1) * length].clone() for i in range(count)]


@dataclass(frozen=True)
class Setting:
    """One sparse configuration: ``method`` "mlp" (SAAP) or "centroids" (training-free), and its budget."""

    method: str
    target: float
    sink: int
    window: int
    probes: int


METHODS = ("mlp", "centroids", "window", "oracle", "topk")


def setting_for(index: SaapIndex, method: str, target: float, context: int, tail: int, sink: int = 4) -> Setting:
    """Window and probes that aim at ``target`` total selectivity at ``context`` keys (tail tokens count too).

    ``method`` "mlp" (SAAP), "centroids" (the training-free baseline: same clusters, scored by centroids),
    "window" (StreamingLLM: sink + a window that takes the whole budget, no cluster), or "oracle" (the same
    clusters ranked by their true attention mass: the bound of any query model over this partition). "topk" is
    the bound of any sparse selection: the keys themselves ranked by true attention mass, ``probes`` of them
    (keys, not clusters) beside the sink and the window; ``setting_for`` gives it the oracle's budget."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; valid: {', '.join(METHODS)}")
    if method == "window":
        return Setting(method, target, sink, max(16, round(target * context - sink - tail / 2)), 0)
    window = max(16, round(context * WINDOW_FRACTION.get(target, target / 5)))
    per_cluster = max(1.0, (context - window - sink) / index.num_clusters)
    probes = max(1, round((target * context - sink - window - tail / 2) / per_cluster))
    if method == "topk":
        return Setting(method, target, sink, window, round(min(probes, index.num_clusters) * per_cluster))
    return Setting(method, target, sink, window, min(probes, index.num_clusters))


def sparse_layer_target(total: float, num_layers: int, sparse_layers: int) -> float:
    """The selectivity the sparse layers may use so that every layer together (the dense ones read all their
    keys) attends ``total`` of the keys; ``ValueError`` when the dense layers alone exceed it."""
    if not 0 < total <= 1 or not 0 < sparse_layers <= num_layers:
        raise ValueError(f"need 0 < total ({total}) <= 1 and 0 < sparse layers ({sparse_layers}) <= layers "
                         f"({num_layers})")
    dense = num_layers - sparse_layers
    if total * num_layers <= dense:
        raise ValueError(f"a total selectivity of {total:g} is out of reach: the {dense} dense layer(s) of "
                         f"{num_layers} alone read {dense / num_layers:.3g} of the keys")
    return (total * num_layers - dense) / sparse_layers


class Harness:
    """The attention function of every layer during evaluation (``attnopt_saap_eval``).

    ``setting`` None = dense causal SDPA. Otherwise the layers the index covers (every layer but 0 for an index of
    ``train_index``'s default layers; layer 0 too for one trained with it) attend sparsely to the last
    ``prompt_len`` key prefix's clusters, and ``stats`` collects per-layer recall and selectivity, as device
    tensors (no host sync per layer; ``summary`` reads them).

    The clusters built over a prompt are kept for the next settings of the same sink and window until the next
    dense ``use(None, ...)``, which is how every prompt starts (its dense prefill): the build depends only on the
    prompt's keys, the sink and the window, so the settings of one prompt share it.
    """

    def __init__(self, model: Any, index: SaapIndex):
        self.model, self.index = model, index
        self.setting: Setting | None = None
        self.prompt_len = 0
        self.states: dict[tuple[int, int, int], ClusterState] = {}  # (layer, sink, window) -> state
        self.stats: dict[str, list[Tensor]] = {"recall": [], "selectivity": []}
        self.layer_recall: dict[int, list[Tensor]] = {}

    def use(self, setting: Setting | None, prompt_len: int) -> None:
        if setting is None or prompt_len != self.prompt_len:  # a new prompt (or the dense reference of one)
            self.states = {}
        self.setting, self.prompt_len = setting, prompt_len
        self.stats = {"recall": [], "selectivity": []}
        self.layer_recall = {}

    def __call__(self, module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        layer = int(module.layer_idx)
        s = self.setting
        L, N = query.shape[2], key.shape[2]
        if s is None or layer not in self.index.layers or L == N:
            return causal_sdpa(module, query, key, value, scaling), None
        index = self.index if s.method == "mlp" else self.index.without_mlp()
        built = (layer, s.sink, s.window)
        if built not in self.states:  # the same for "mlp" and the rest: the centroids and refine are the index's
            self.states[built] = build_clusters(index, layer, key, self.prompt_len, s.sink, s.window)
        state = self.states[built]
        positions = torch.arange(N - L, N, device=query.device)
        G = query.shape[1] // key.shape[1]
        scores = torch.matmul(query.float(), key.float().repeat_interleave(G, 1).transpose(-1, -2)) * scaling
        cols = torch.arange(N, device=key.device)
        visible = cols[None, :] <= positions[:, None]
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)  # (B, Hq, L, N) dense
        if s.method == "topk":
            keep = top_keys(state, probs, s.probes, visible)
        else:
            if s.method == "oracle":
                clusters = oracle_clusters(state, probs, s.probes)
            else:  # (.., 0) for "window"
                clusters = select_clusters(index, layer, query, positions, s.probes, scaling, per_token=True,
                                           centroids=state.centroids)
            keep = attended_keys(state, clusters, N, L)  # (B, Hkv, L, N)
        mask = keep.repeat_interleave(G, dim=1)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=G > 1)
        recall = (probs * mask).sum(-1).mean()
        self.stats["recall"].append(recall)
        self.layer_recall.setdefault(layer, []).append(recall)
        self.stats["selectivity"].append((keep.sum(-1).float() / (positions + 1).float()).mean())
        return out.transpose(1, 2).contiguous(), None

    def summary(self) -> dict[str, float]:
        """Mean recall and selectivity of the calls since ``use`` (one host sync)."""
        return {k: (float(torch.stack(v).double().mean()) if v else math.nan) for k, v in self.stats.items()}

    def recall_per_layer(self) -> dict[int, list[float]]:
        """Each sparse layer's recall of every call since ``use`` (one host sync)."""
        flat = [(l, r) for l, values in self.layer_recall.items() for r in values]
        got = torch.stack([r for _, r in flat]).tolist() if flat else []
        out: dict[int, list[float]] = {}
        for (l, _), r in zip(flat, got):
            out.setdefault(l, []).append(r)
        return out


def oracle_clusters(state: ClusterState, probs: Tensor, probes: int) -> Tensor:
    """Each group's top-``probes`` clusters by true attention mass: probs (B, Hq, L, N), the dense softmax of
    each query head -> (B, Hkv, L, probes) int64 (the G heads of a group summed, as the query model's are)."""
    B, Hq, L, N = probs.shape
    owner = state.cluster_of_positions(N)  # (B, Hkv, N)
    Hkv = owner.shape[1]
    group = probs.reshape(B, Hkv, Hq // Hkv, L, N).sum(dim=2) * (owner >= 0)[:, :, None, :]
    mass = torch.zeros((B, Hkv, L, state.num_clusters), device=probs.device)
    mass.scatter_add_(-1, owner.clamp(min=0)[:, :, None, :].expand(-1, -1, L, -1), group)
    return mass.topk(min(probes, state.num_clusters), dim=-1).indices


def top_keys(state: ClusterState, probs: Tensor, count: int, visible: Tensor) -> Tensor:
    """(B, Hkv, L, N) bool: the always-attended keys (sink, window, later tokens) plus each group's ``count``
    indexed keys of most attention mass (probs (B, Hq, L, N) summed over the group's heads); ``visible`` (L, N)."""
    B, Hq, L, N = probs.shape
    owner = state.cluster_of_positions(N)  # (B, Hkv, N)
    Hkv = owner.shape[1]
    indexed = (owner >= 0)[:, :, None, :]
    group = probs.reshape(B, Hkv, Hq // Hkv, L, N).sum(dim=2).masked_fill(~indexed, -1.0)
    keep = ~indexed & visible
    k = min(count, N)
    if k > 0:
        top = torch.zeros_like(keep).scatter_(-1, group.topk(k, dim=-1).indices, True)
        keep = keep | (top & indexed)
    return keep


def _truncate(cache: Any, length: int) -> None:
    """Drop the cache's keys past ``length`` (a negative ``crop``, which transformers 5.17 and 5.23 both take)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def _sync(model: Any) -> None:
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)


def _continue(model: Any, cache: Any, ids: Tensor) -> Tensor:
    """Logits (T, vocab) fp32 of ``ids`` (T,) run after ``cache``; the ids go to the model's device."""
    out = model(input_ids=ids.view(1, -1).to(model.device), past_key_values=cache, use_cache=True)
    return out.logits[0].float()


@torch.no_grad()
def evaluate_language(model: Any, harness: Harness, windows: list[Tensor], tail: int,
                      settings: list[Setting], progress: Any = None) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Per setting (and dense): next-token agreement, perplexity, recall and selectivity on the last ``tail``
    positions of every window (each window is ``P + tail + 1`` tokens: the last is only a label). Also returns the
    first window's dense prefill time and the time to build every layer's clusters over its keys (seconds): the
    second build, ``index_build_s``, and the first, ``index_build_first_s``, which on a GPU includes loading the
    kernels the build uses (the H100 run at c2c3ed6 timed only that one)."""
    from transformers import DynamicCache

    settings = list(dict.fromkeys(settings))  # a repeated setting would count its tokens twice
    rows: dict[Setting | None, dict[str, list]] = {s: {"nll": [], "agree": [], "recall": [], "sel": [], "layers": {}}
                                                  for s in [None, *settings]}
    task = progress.add_task("evaluate text", total=len(windows) * (len(settings) + 1)) if progress else None
    timing: dict[str, float] = {}
    for ids in windows:
        P = ids.numel() - tail - 1
        cache = DynamicCache()
        harness.use(None, P)
        start = time.perf_counter()
        model(input_ids=ids[:P].view(1, -1).to(model.device), past_key_values=cache, use_cache=True)
        if not timing:  # what the build at prefill adds: every covered layer's clusters over the prompt's keys
            _sync(model)  # (the first window's prefill: warm where the caller ran the model before, as the GPU
            timing["prefill_s"] = time.perf_counter() - start  # script does; else an upper bound)
            for warm in (False, True):  # the first build in a process also loads (on a GPU) the kernels it uses
                start = time.perf_counter()
                for layer in harness.index.layers:
                    build_clusters(harness.index, layer, cache.layers[layer].keys, P, 1, 0)
                _sync(model)
                timing["index_build_s" if warm else "index_build_first_s"] = time.perf_counter() - start
        labels = ids[P + 1:P + tail + 1].to(model.device)
        dense_top = None
        for s in [None, *settings]:
            _truncate(cache, P)
            harness.use(s, P)
            logits = _continue(model, cache, ids[P:P + tail])
            top = logits.argmax(-1)
            dense_top = top if s is None else dense_top
            r = rows[s]
            r["nll"].append(F.cross_entropy(logits, labels, reduction="sum").item())
            r["agree"].append(float((top == dense_top).float().sum()))
            stats = harness.summary()
            r["recall"].append(stats["recall"])
            r["sel"].append(stats["selectivity"])
            for layer, values in harness.recall_per_layer().items():
                r["layers"].setdefault(layer, []).extend(values)
            if task is not None:
                progress.advance(task)
    n_tok = len(windows) * tail
    out = []
    for s, r in rows.items():
        row = {"method": "dense" if s is None else s.method, **({} if s is None else asdict(s))}
        row.update(perplexity=math.exp(sum(r["nll"]) / n_tok), next_token_agreement=sum(r["agree"]) / n_tok,
                   recall=None if s is None else sum(r["recall"]) / len(r["recall"]),
                   selectivity=1.0 if s is None else sum(r["sel"]) / len(r["sel"]))
        if s is not None:
            row["recall_per_layer"] = {l: round(sum(v) / len(v), 4) for l, v in sorted(r["layers"].items())}
        out.append(row)
    return out, timing


PASSKEY_QUESTION = "\n\nWhat is the pass key? The pass key is"


def passkey_prompt(tokenizer: Any, length: int, key: str, depth: float, filler: Tensor) -> tuple[Tensor, int]:
    """(ids, P): a haystack of eval text with the needle at ``depth``, then the question; P = the haystack's
    length (the question is decoded with SAAP). ``length`` counts every token."""
    needle = tokenizer(f"\nThe pass key is {key}. Remember it. {key} is the pass key.\n", return_tensors="pt",
                       add_special_tokens=False).input_ids[0]
    question = tokenizer(PASSKEY_QUESTION, return_tensors="pt", add_special_tokens=False).input_ids[0]
    hay = length - needle.numel() - question.numel()
    at = int(hay * depth)
    ids = torch.cat([filler[:at], needle, filler[at:hay], question])
    return ids, hay + needle.numel()


@torch.no_grad()
def evaluate_passkey(model: Any, tokenizer: Any, harness: Harness, lengths: list[int], trials: int,
                     settings_for_length: Any, filler: Tensor, new_tokens: int = 7, seed: int = 0,
                     progress: Any = None) -> list[dict[str, Any]]:
    """Per length and setting (and dense): how many of ``trials`` passkeys the greedy answer contains."""
    from transformers import DynamicCache

    rng = random.Random(seed)
    results = []
    total = sum(len(settings_for_length(n)) + 1 for n in lengths) * trials
    task = progress.add_task("passkey", total=total) if progress else None
    for n in lengths:
        settings = [None, *dict.fromkeys(settings_for_length(n))]
        hits = {s: 0 for s in settings}
        sels = {s: [] for s in settings}
        for t in range(trials):
            key = str(rng.randrange(10000, 99999))
            ids, P = passkey_prompt(tokenizer, n, key, depth=0.2 + 0.6 * (t + 0.5) / trials, filler=filler)
            cache = DynamicCache()
            harness.use(None, P)
            model(input_ids=ids[:P].view(1, -1).to(model.device), past_key_values=cache, use_cache=True)
            for s in settings:
                _truncate(cache, P)
                harness.use(s, P)
                logits = _continue(model, cache, ids[P:])
                answer = [int(logits[-1].argmax())]
                for _ in range(new_tokens - 1):
                    answer.append(int(_continue(model, cache, torch.tensor(answer[-1:]))[-1].argmax()))
                text = tokenizer.decode(answer)
                hits[s] += key in text
                sels[s].append(harness.summary()["selectivity"])
                if task is not None:
                    progress.advance(task)
        for s in settings:
            results.append({"length": n, "method": "dense" if s is None else s.method,
                            **({} if s is None else asdict(s)), "found": hits[s], "trials": trials,
                            "selectivity": 1.0 if s is None else sum(sels[s]) / len(sels[s])})
    return results


__all__ = ["Harness", "Setting", "corpus_text", "custom_attention", "evaluate_language", "evaluate_passkey",
           "passkey_prompt", "setting_for", "sparse_layer_target", "token_windows"]
