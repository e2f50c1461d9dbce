"""``torch.ops.attnopt.*``: the ops that the lowering pass inserts.

Registered through ``torch.library.Library`` with a plain CompositeExplicitAutograd kernel (cheaper to
dispatch than ``torch.library.custom_op``'s Python wrapper) and fake implementations, so dynamo, inductor and
``torch.export`` trace through them.

``plan`` is a plan's ``runtime_key()`` JSON; it is parsed once and cached with the strategy's prepared state.
``site`` names the site for call counting and error messages. ``softcap`` (c != 0: scores ``c * tanh(s)``) and
``key_start`` ((B,) first key per row: a sliding window's, row 0 of ``key_range_from_mask``) and ``alibi_slopes``
((Hq,): ALiBi, scores + slope[h] * key position) are the variants of
``runtime/strategies/base.py``'s ``VARIANTS``.
"""
from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import torch
from torch import Tensor

from attnopt.plan import Plan, plan_from_json

_lib = torch.library.Library("attnopt", "DEF")
_lib.define(
    "decode_attention(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, Tensor? valid_len, float scale, "
    "bool is_causal, str plan, str site, float softcap=0.0, Tensor? key_start=None, Tensor? alibi_slopes=None) "
    "-> Tensor"
)
_lib.define(
    "decode_attention_states(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, Tensor? valid_len, float scale, "
    "bool is_causal, str plan, str site, float softcap=0.0, Tensor? key_start=None, Tensor? alibi_slopes=None) "
    "-> (Tensor, Tensor)"
)
_lib.define(
    "cascade_attention(Tensor q, Tensor k_prefix, Tensor v_prefix, Tensor k_suffix, Tensor v_suffix, Tensor? attn_mask, "
    "Tensor? valid_len, float scale, bool is_causal, str plan, str site) -> Tensor"
)
_lib.define("merge_states(Tensor o_parts, Tensor lse_parts) -> (Tensor, Tensor)")
_lib.define("check_close(Tensor new, Tensor ref, str site, float atol, float rtol, int calls) -> Tensor")
_lib.define("valid_len_from_mask(Tensor attn_mask, SymInt batch) -> Tensor")
_lib.define("key_start_from_mask(Tensor attn_mask, SymInt batch) -> Tensor")
_lib.define("key_range_from_mask(Tensor attn_mask, SymInt batch) -> Tensor")
_lib.define("shard_mask_columns(Tensor attn_mask, SymInt local_len) -> Tensor")

#: Calls per site key, counted on the host by the op (not under CUDA-graph replay).
CALL_COUNTS: Counter[str] = Counter()
_state_lock = threading.Lock()
_STATES: dict[tuple, Any] = {}


_RESOLVED: dict[str, tuple[Plan, Any]] = {}


def _resolve(plan: str) -> tuple[Plan, Any]:
    """(plan, strategy) for a plan string, parsed once: the per-call path is one dict lookup. A pending key
    (``attnopt.tuning_defer``) resolves to its measured winner, waiting for it if it is still being measured (the
    backend's callable has waited before its first call, so this does not)."""
    hit = _RESOLVED.get(plan)
    if hit is None:
        from attnopt import tuning_defer

        if tuning_defer.is_pending(plan):  # a measured choice made in the background: its winner, once
            hit = _RESOLVED[plan] = _resolve(tuning_defer.resolved_key(plan))
            return hit
        from .strategies import get_strategy

        parsed = plan_from_json(plan)
        hit = _RESOLVED[plan] = (parsed, get_strategy(parsed.kind))
    return hit


def check_inputs(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, valid_len: Tensor | None,
                 mask_keys_local: bool = True) -> None:
    """Raise ``ValueError`` naming what is wrong with the inputs of a decode-attention op (shapes and dtypes only:
    no device sync). Run once per prepared state (plan and shape family), not per call.

    q : (B, Hq, L, D); k : (B, Hkv, N, D); v : (B, Hkv, N, Dv) with Hq a multiple of Hkv; attn_mask : bool or
    floating, broadcastable to (B, Hq, L, N); valid_len : (B,) int32/int64. ``mask_keys_local=False``: the mask's
    last dim may be the global key count of a sequence-sharded cache (tree/ring plans), not ``k``'s.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"decode_attention: {name} must be 4-D (B, H, L|N, D); got shape {tuple(t.shape)}")
    B, Hq, L, D = q.shape
    if k.shape[0] != B or v.shape[0] != B:
        raise ValueError(f"decode_attention: batch sizes differ: q {B}, k {k.shape[0]}, v {v.shape[0]}")
    if k.shape[1] == 0 or Hq % k.shape[1]:
        raise ValueError(f"decode_attention: query heads ({Hq}) must be a multiple of KV heads ({k.shape[1]})")
    if tuple(k.shape[:3]) != tuple(v.shape[:3]):
        raise ValueError(f"decode_attention: k {tuple(k.shape)} and v {tuple(v.shape)} differ in batch, heads or "
                         "length")
    if k.shape[3] != D:
        raise ValueError(f"decode_attention: head dims differ: q {D}, k {k.shape[3]}")
    if not (q.dtype == k.dtype == v.dtype) or not q.dtype.is_floating_point:
        raise ValueError(f"decode_attention: q, k, v must share one floating dtype; got {q.dtype}, {k.dtype}, "
                         f"{v.dtype}")
    if attn_mask is not None:
        if attn_mask.dtype != torch.bool and not attn_mask.dtype.is_floating_point:
            raise ValueError(f"decode_attention: attn_mask must be bool (True = attend) or floating (additive); got "
                             f"{attn_mask.dtype}")
        full = (B, Hq, L, k.shape[2])
        shape = tuple(attn_mask.shape) if mask_keys_local else tuple(attn_mask.shape[:-1]) + (1,)
        if attn_mask.dim() > 4 or any(s != 1 and s != f for s, f in zip(reversed(shape), reversed(full))):
            raise ValueError(f"decode_attention: attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to "
                             f"(B, Hq, L, N) = {full}")
    if valid_len is not None:
        if valid_len.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"decode_attention: valid_len must be int32 or int64; got {valid_len.dtype}")
        if tuple(valid_len.shape) != (B,):
            raise ValueError(f"decode_attention: valid_len must have shape (B,) = ({B},); got "
                             f"{tuple(valid_len.shape)}")


def _prepared(plan_key: str, plan: Plan, strategy, q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None,
              valid_len: Tensor | None = None) -> Any:
    key = (plan_key, q.device, q.dtype, q.shape[0], q.shape[1], q.shape[2], q.shape[3], k.shape[1], v.shape[3])
    state = _STATES.get(key)
    if state is None:
        with _state_lock:
            state = _STATES.get(key)
            if state is None:
                check_inputs(q, k, v, attn_mask, valid_len, not getattr(strategy, "distributed", False))
                if getattr(strategy, "distributed", False):  # its prepare runs collectives: this thread
                    state = strategy.prepare(plan, q, k, v)
                else:
                    state = outside_graph_pools(lambda: strategy.prepare(plan, q, k, v), q.device)
                _STATES[key] = state if state is not None else False
    return state if state is not False else None


_PREPARE_THREAD: list[Any] = []


def outside_graph_pools(make, device: torch.device):
    """``make()``, with what it allocates (a workspace, counters) in the caching allocator's ordinary pool.

    The first call of an op often runs inside inductor's CUDA-graph-tree warm-up, which sends every allocation of
    the current thread to the graph's private pool; a workspace kept there outlives the graph's tracked outputs,
    and the trees refuse to record ("tensor(s) in the cudagraph pool not tracked as outputs"; seen on a 30-layer
    model with ``mode="reduce-overhead"``). That routing is per thread, so the state is made on a worker thread
    and synchronized there (``prepare`` may sync). Inside a stream capture (a graph the user captures around the
    first call) another thread's work could break the capture, so there it is made in place, as before.
    """
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return make()
    if not _PREPARE_THREAD:
        from concurrent.futures import ThreadPoolExecutor

        _PREPARE_THREAD.append(ThreadPoolExecutor(1, thread_name_prefix="attnopt-prepare"))

    def work():
        with torch.cuda.device(device):
            state = make()
            torch.cuda.current_stream().synchronize()
        return state

    return _PREPARE_THREAD[0].submit(work).result()


def fake_layout(out: Tensor) -> Tensor:
    """``out`` with the contiguous layout the fake implementations declare (``timer.site_call`` applies it too, so
    that the tuner times the copy it costs where a plan returns another layout). SDPA's flash and cuDNN kernels return
    (B, H, L, D) as a transposed view of (B, L, H, D) memory; for L > 1 that differs from the declared strides, and
    inductor, which trusts the fake, asserted ("expected stride 448, got 64") on a 7-token prompt. Free at L == 1,
    where both layouts are contiguous."""
    return out if out.is_contiguous() else out.contiguous()


def _decode_attention(q, k, v, attn_mask, valid_len, scale, is_causal, plan, site, softcap=0.0, key_start=None,
                      alibi_slopes=None):
    CALL_COUNTS[site] += 1
    p, strategy = _resolve(plan)
    state = _prepared(plan, p, strategy, q, k, v, attn_mask, valid_len)
    if softcap or key_start is not None or alibi_slopes is not None:
        from .strategies.base import variant_kwargs

        return fake_layout(strategy.run(state, p, q, k, v, attn_mask, valid_len, scale, is_causal,
                                        **variant_kwargs(strategy, key_start, softcap, alibi_slopes)))
    return fake_layout(strategy.run(state, p, q, k, v, attn_mask, valid_len, scale, is_causal))


def _decode_attention_states(q, k, v, attn_mask, valid_len, scale, is_causal, plan, site, softcap=0.0,
                             key_start=None, alibi_slopes=None):
    CALL_COUNTS[site] += 1
    p, strategy = _resolve(plan)
    state = _prepared(plan, p, strategy, q, k, v, attn_mask, valid_len)
    if softcap or key_start is not None or alibi_slopes is not None:
        from .strategies.base import variant_kwargs

        o, lse = strategy.run_states(state, p, q, k, v, attn_mask, valid_len, scale, is_causal,
                                     **variant_kwargs(strategy, key_start, softcap, alibi_slopes))
    else:
        o, lse = strategy.run_states(state, p, q, k, v, attn_mask, valid_len, scale, is_causal)
    return fake_layout(o), fake_layout(lse)


def check_cascade_inputs(q: Tensor, k_prefix: Tensor, v_prefix: Tensor, k_suffix: Tensor, v_suffix: Tensor,
                         attn_mask: Tensor | None, valid_len: Tensor | None, is_causal: bool) -> None:
    """``ValueError`` naming what is wrong with the inputs of ``cascade_attention`` (shapes and dtypes only), run
    once per prepared state. k_prefix (1, Hkv, P, D) / v_prefix (1, Hkv, P, Dv) are every row's first P keys,
    k_suffix (B, Hkv, S, D) / v_suffix (B, Hkv, S, Dv) each row's next S; the mask covers P + S keys."""
    if k_prefix.dim() != 4 or k_prefix.shape[0] != 1 or v_prefix.dim() != 4 or v_prefix.shape[0] != 1:
        raise ValueError(f"cascade_attention: the shared prefix must be (1, Hkv, P, D); got k {tuple(k_prefix.shape)}, "
                         f"v {tuple(v_prefix.shape)}")
    if tuple(k_prefix.shape[1:2]) + tuple(k_prefix.shape[3:]) != tuple(k_suffix.shape[1:2]) + tuple(k_suffix.shape[3:]) \
            or v_prefix.shape[1] != v_suffix.shape[1] or v_prefix.shape[3] != v_suffix.shape[3]:
        raise ValueError(f"cascade_attention: prefix k {tuple(k_prefix.shape)} / v {tuple(v_prefix.shape)} and suffix "
                         f"k {tuple(k_suffix.shape)} / v {tuple(v_suffix.shape)} differ in heads or head dim")
    if is_causal:
        raise ValueError("cascade_attention: is_causal is not supported (top-left causal at decode hides every key "
                         "past the first q_len)")
    if valid_len is not None and attn_mask is None:
        raise ValueError("cascade_attention: valid_len needs the attn_mask it was read from (the shared prefix is "
                         "attended for all rows at once; per-row limits inside it must be in the mask)")
    rows = (k_suffix.shape[0], k_suffix.shape[1], k_prefix.shape[2] + k_suffix.shape[2])
    check_inputs(q, torch.empty(rows + (k_suffix.shape[3],), device="meta", dtype=k_suffix.dtype),
                 torch.empty(rows + (v_suffix.shape[3],), device="meta", dtype=v_suffix.dtype), attn_mask, valid_len)
    if not (k_prefix.dtype == v_prefix.dtype == v_suffix.dtype == q.dtype):
        raise ValueError(f"cascade_attention: q, k, v must share one floating dtype; got {q.dtype}, prefix "
                         f"{k_prefix.dtype}/{v_prefix.dtype}, suffix {k_suffix.dtype}/{v_suffix.dtype}")


def _cascade_attention(q, k_prefix, v_prefix, k_suffix, v_suffix, attn_mask, valid_len, scale, is_causal, plan, site):
    """The cascade op. Its plan is a cascade plan, or (from the tuner) a bucketed plan choosing by the total key
    count; a bucket whose plan is another kind gets the concatenated K/V, as the original attention read them."""
    CALL_COUNTS[site] += 1
    p, strategy = _resolve(plan)
    if p.kind == "bucketed":
        p, strategy = _resolve(p.plan_for(k_prefix.shape[2] + k_suffix.shape[2]))
    if p.kind != "cascade":
        rows = (q.shape[0], -1, -1, -1)
        k = torch.cat([k_prefix.expand(rows), k_suffix], dim=2)
        v = torch.cat([v_prefix.expand(rows), v_suffix], dim=2)
        state = _prepared(p.runtime_key(), p, strategy, q, k, v, attn_mask, valid_len)
        return fake_layout(strategy.run(state, p, q, k, v, attn_mask, valid_len, scale, is_causal))
    key = ("cascade", plan, q.device, q.dtype, *q.shape, k_prefix.shape[1], k_prefix.shape[2] == 0,
           k_suffix.shape[2] == 0, v_prefix.shape[3])
    state = _STATES.get(key)
    if state is None:
        check_cascade_inputs(q, k_prefix, v_prefix, k_suffix, v_suffix, attn_mask, valid_len, is_causal)
        with _state_lock:
            state = _STATES.get(key)
            if state is None:
                state = _STATES[key] = outside_graph_pools(lambda: strategy.prepare(p, q, k_suffix, v_suffix),
                                                           q.device)
    return fake_layout(strategy.run_cascade(state, p, q, k_prefix, v_prefix, k_suffix, v_suffix, attn_mask,
                                            valid_len, scale))


def _merge_states(o_parts, lse_parts):
    if o_parts.is_cuda and o_parts.dtype == torch.float32 and lse_parts.dtype == torch.float32:
        from .kernels import triton_usable

        if triton_usable("cuda"):
            from .kernels.merge import merge_states as merge_kernel

            return merge_kernel(o_parts, lse_parts)
    from .reference import merge_states

    return merge_states(o_parts, lse_parts)


class VerificationError(AssertionError):
    """A rewritten site disagreed with the original attention beyond tolerance."""


def _check_close(new, ref, site, atol, rtol, calls):
    CALL_COUNTS["verify:" + site] += 1
    if CALL_COUNTS["verify:" + site] <= calls:
        n, r = new.float(), ref.float()
        err = (n - r).abs()
        bound = atol + rtol * r.abs()
        # NaN or an infinity where the original has the same one agrees (a plain softmax's fully masked row is NaN)
        bad = ~((err <= bound) | (n == r) | (torch.isnan(n) & torch.isnan(r)))
        if bool(bad.any()):
            raise VerificationError(
                f"attnopt verify: site {site} differs from the original attention: max abs error "
                f"{err.max().item():.3e} > tolerance atol={atol:g} + rtol={rtol:g}*|ref| at {int(bad.sum())} of "
                f"{bad.numel()} elements")
        CALL_COUNTS["verified:" + site] += 1  # calls that ran the check and passed (last_plans reports them)
    return new.clone()


def _mask_reduction(name: str):
    """The op ``name`` (``valid_len_from_mask``, ``key_start_from_mask``, ``key_range_from_mask``): its one-launch
    kernel (``kernels/valid_len.py``) where the kernels run, else the reference (several kernels on a GPU: about
    25 µs of a SmolLM2 step for the valid length alone)."""
    def reduce(attn_mask, batch):
        from .strategies.split_kv import use_triton

        if use_triton(attn_mask) and attn_mask.dim() >= 1 and attn_mask.shape[-1] > 1:
            from .kernels import valid_len as kernels

            return getattr(kernels, name)(attn_mask, batch)
        from . import reference

        return getattr(reference, name)(attn_mask, batch)

    reduce.__name__ = f"_{name}"
    return reduce


def _shard_mask_columns(attn_mask, local_len):
    """A mask over the global key columns (..., N) -> this rank's columns (..., local_len), through the current
    group's sequence-sharded cache (``runtime.distributed``); unchanged when it already has local_len columns."""
    from .distributed.cache import adapt_mask
    from .distributed.groups import current_group

    if attn_mask.shape[-1] == local_len:
        return attn_mask.clone()
    out = adapt_mask(current_group(), attn_mask, attn_mask.new_empty((1, 1, local_len, 1)))
    return out.contiguous()


for _name, _fn in (("decode_attention", _decode_attention), ("decode_attention_states", _decode_attention_states),
                   ("cascade_attention", _cascade_attention),
                   ("merge_states", _merge_states), ("check_close", _check_close),
                   *((name, _mask_reduction(name)) for name in ("valid_len_from_mask", "key_start_from_mask",
                                                                "key_range_from_mask")),
                   ("shard_mask_columns", _shard_mask_columns)):
    _lib.impl(_name, _fn, "CompositeExplicitAutograd")


@torch.library.register_fake("attnopt::decode_attention")
def _decode_attention_fake(q, k, v, attn_mask, valid_len, scale, is_causal, plan, site, softcap=0.0, key_start=None,
                           alibi_slopes=None):
    return q.new_empty((q.shape[0], q.shape[1], q.shape[2], v.shape[3]))


@torch.library.register_fake("attnopt::cascade_attention")
def _cascade_attention_fake(q, k_prefix, v_prefix, k_suffix, v_suffix, attn_mask, valid_len, scale, is_causal, plan,
                            site):
    return q.new_empty((q.shape[0], q.shape[1], q.shape[2], v_prefix.shape[3]))


@torch.library.register_fake("attnopt::decode_attention_states")
def _decode_attention_states_fake(q, k, v, attn_mask, valid_len, scale, is_causal, plan, site, softcap=0.0,
                                  key_start=None, alibi_slopes=None):
    shape = (q.shape[0], q.shape[1], q.shape[2])
    return q.new_empty(shape + (v.shape[3],), dtype=torch.float32), q.new_empty(shape, dtype=torch.float32)


@torch.library.register_fake("attnopt::merge_states")
def _merge_states_fake(o_parts, lse_parts):
    return o_parts.new_empty(o_parts.shape[1:]), lse_parts.new_empty(lse_parts.shape[1:])


@torch.library.register_fake("attnopt::check_close")
def _check_close_fake(new, ref, site, atol, rtol, calls):
    return torch.empty_like(new)


@torch.library.register_fake("attnopt::valid_len_from_mask")
def _valid_len_from_mask_fake(attn_mask, batch):
    return attn_mask.new_empty((batch,), dtype=torch.int32)


@torch.library.register_fake("attnopt::key_start_from_mask")
def _key_start_from_mask_fake(attn_mask, batch):
    return attn_mask.new_empty((batch,), dtype=torch.int32)


@torch.library.register_fake("attnopt::key_range_from_mask")
def _key_range_from_mask_fake(attn_mask, batch):
    return attn_mask.new_empty((2, batch), dtype=torch.int32)


@torch.library.register_fake("attnopt::shard_mask_columns")
def _shard_mask_columns_fake(attn_mask, local_len):
    return attn_mask.new_empty((*attn_mask.shape[:-1], local_len))


def reset_runtime_state() -> None:
    """Drop prepared states and call counts (tests; after freeing a model)."""
    with _state_lock:
        _STATES.clear()
    _RESOLVED.clear()
    CALL_COUNTS.clear()
