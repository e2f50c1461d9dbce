"""What the tuner's timer calls (``attnopt.timer``): a site's synthetic input sets, one plan's call on one of them as
the lowered op makes it, and running first calls on threads at once. Nothing here runs at import time."""
from __future__ import annotations

import os
from typing import Any, Callable

from .plan import Plan, uses_valid_len
from .site import AttentionSite

#: The fill a static cache (valid-length mask) is timed at: full. Its valid length is a device tensor, unknown at
#: compile time, and one plan serves every fill (choosing by it would sync). A step is longest near full, and a
#: Hugging Face StaticCache sized to the prompt plus the new tokens runs there (the e2e caches: 94-99 % full).
#: Tuning version 3 timed half-full caches and kept SmolLM2's 1k site on S=5/256/8/2 (10 µs in the e2e step), where
#: a forced sweep found S=16/64/4/3 at 6.2 µs (H100, c761f67): how many keys each split gets changes the ranking.
STATIC_FILL = 1.0
#: The input sets of one timing span this many L2 sizes.
L2_FACTOR = 4
#: At most this many input sets (small shapes need many to span the L2; each is a few hundred kB there).
MAX_SETS = 256
#: Threads that make a shape's candidates' first calls at once before any is timed (``GpuTimer.warm_up``). A cold
#: Triton compile takes about a second per configuration on the H100 machine's host, mostly in MLIR/LLVM passes and
#: ptxas, which do not hold the GIL (a separate process).
WARM_WORKERS = 16


def synthetic_inputs(site: AttentionSite, index: int, device: str = "cuda", reduce: bool = True) -> dict[str, Any]:
    """One input set of ``site``'s shape: q (B, Hq, L, D), k (B, Hkv, N, D), v (B, Hkv, N, Dv) in its dtype; for a
    valid-length or arbitrary mask a bool mask (B, 1, L, N) keeping the first ``STATIC_FILL * N`` keys and the
    (B,) int32 ``valid_len`` that ``attnopt::valid_len_from_mask`` makes of it (computed here, once). A sliding
    window's mask keeps only the last ``window`` of those keys, with its ``key_start`` (also computed once).
    ``reduce=False``: the same two written down, not computed (equal, and no kernel launched: the timer's sets,
    whose mask reduction would otherwise compile anew for each length timed)."""
    import torch

    dtype = getattr(torch, site.dtype)
    b, L, n = int(site.batch), int(site.q_len), int(site.kv_len)
    g = torch.Generator(device=device).manual_seed(4321 + index)
    s = {"q": torch.randn(b, site.q_heads, L, site.head_dim, device=device, dtype=dtype, generator=g),
         "k": torch.randn(b, site.kv_heads, n, site.head_dim, device=device, dtype=dtype, generator=g),
         "v": torch.randn(b, site.kv_heads, n, site.v_head_dim or site.head_dim, device=device, dtype=dtype,
                          generator=g),
         "mask": None, "valid_len": None}
    if site.mask_kind in ("valid_length", "arbitrary"):
        keep = max(1, int(n * STATIC_FILL))
        cols = torch.arange(n, device=device)
        band = cols < keep
        if site.window is not None:  # a sliding window's band: the last ``window`` keys before ``keep``
            band &= cols >= keep - site.window
        s["mask"] = band[None, None, None, :].expand(b, 1, L, n).contiguous()
        if not reduce:  # the mask's valid range written down, as the reduction computes it (no kernel launched)
            s["valid_len"] = torch.full((b,), keep, device=device, dtype=torch.int32)
            if site.window is not None:
                s["key_start"] = torch.full((b,), max(0, keep - site.window), device=device, dtype=torch.int32)
            return s
        from attnopt.runtime import ops  # noqa: F401  (registers torch.ops.attnopt.*)

        if site.window is not None:  # as the lowered graph computes both ends of a window site's keys
            s["key_start"], s["valid_len"] = torch.ops.attnopt.key_range_from_mask(s["mask"], b)
        else:
            s["valid_len"] = torch.ops.attnopt.valid_len_from_mask(s["mask"], b)
    return s


def mask_reduction(site: AttentionSite) -> str:
    """The op the lowered graph runs over a masked site's mask for a kernel plan: ``key_range_from_mask`` at a
    sliding window (its start and valid length), else ``valid_len_from_mask``."""
    return "key_range_from_mask" if site.window is not None else "valid_len_from_mask"


def site_call(plan: Plan, site: AttentionSite, s: dict[str, Any], state: Any = None) -> Callable[[], Any]:
    """A call of ``plan`` on input set ``s`` as the lowered op runs it: ``strategy.run`` only, with the set's mask
    and, for a plan that reads one, its precomputed valid length, its output in the op's layout (``fake_layout``).
    ``state``: the strategy's prepared state (prepared here, before the call is made, when ``None``)."""
    from attnopt.runtime.strategies import get_strategy

    strategy = get_strategy(plan.kind)
    if state is None:
        state = strategy.prepare(plan, s["q"], s["k"], s["v"])
    scale = site.scale if site.scale is not None else site.head_dim ** -0.5
    if hasattr(strategy, "timed_call"):  # a plan whose op takes other inputs than (q, k, v): the cascade
        return strategy.timed_call(plan, site, s, state, scale)
    q, k, v, mask = s["q"], s["k"], s["v"], s["mask"]
    valid_len = s.get("valid_len") if uses_valid_len(plan, site) else None
    if uses_valid_len(plan, site) and valid_len is None and mask is not None:
        raise ValueError("site_call: the input set has a mask but no precomputed valid_len (synthetic_inputs "
                         "makes one)")

    # the layout the op hands back (its fake's): a dense plan at q_len > 1 pays a copy of SDPA's transposed output
    from attnopt.runtime.ops import fake_layout

    variant = variant_of(strategy, site, s)
    if variant:
        def call_variant():
            return fake_layout(strategy.run(state, plan, q, k, v, mask, valid_len, scale, site.is_causal, **variant))
        return call_variant

    def call():
        return fake_layout(strategy.run(state, plan, q, k, v, mask, valid_len, scale, site.is_causal))
    return call


def variant_of(strategy, site: AttentionSite, s: dict[str, Any]) -> dict[str, Any]:
    """The variant keywords the lowered op gives ``strategy`` at ``site``: the set's window start, the cap, and for
    ALiBi Bloom's slopes for the site's heads (the kernels' time does not depend on their values)."""
    import torch

    from attnopt.runtime.strategies.base import variant_kwargs

    slopes = (torch.tensor([2.0 ** -(8 * (h + 1) / site.q_heads) for h in range(site.q_heads)], device=s["q"].device)
              if site.alibi else None)
    return variant_kwargs(strategy, s.get("key_start"), site.softcap or 0.0, slopes)


def error_text(exc: BaseException) -> str:
    """One line naming an exception: ``error: Type: first line of its message`` (at most 160 characters of it); an
    error raised in a worker process (``timer_proc.WorkerTimerError``) keeps the text it had there."""
    if isinstance(getattr(exc, "worker_text", None), str):
        return exc.worker_text
    text = str(exc).splitlines()[0][:160] if str(exc) else ""
    return f"error: {type(exc).__name__}: {text}"


def run_concurrently(pooled: dict[str, Callable[[], Any]], here: dict[str, Callable[[], Any]] | None = None,
                     workers: int = WARM_WORKERS) -> dict[str, str]:
    """Run the ``pooled`` calls on up to ``workers`` threads while the ``here`` calls run, one after another, on
    the calling thread (for state that is kept per thread, as PyTorch keeps cuDNN's graphs); wait for all. Returns
    the error text (``error_text``) of each call that raised, by key; the others' results are dropped."""
    from concurrent.futures import ThreadPoolExecutor

    errors: dict[str, str] = {}
    with ThreadPoolExecutor(max(1, min(workers, len(pooled))), thread_name_prefix="attnopt-warm") as pool:
        futures = {key: pool.submit(call) for key, call in pooled.items()}
        for key, call in (here or {}).items():
            try:
                call()
            except Exception as exc:  # noqa: BLE001 - reported by key, like the pooled calls' errors
                errors[key] = error_text(exc)
    for key, future in futures.items():
        if future.exception() is not None:
            errors[key] = error_text(future.exception())
    return errors


def set_count(set_bytes: int, l2_bytes: int | None, free_bytes: int) -> int:
    """Input sets for one timing: enough to span ``L2_FACTOR`` L2 sizes, at most ``MAX_SETS`` and at most what
    half the free memory holds. ``MemoryError`` when not even one set fits there."""
    if set_bytes > free_bytes // 2:
        raise MemoryError(f"one input set needs {set_bytes / 1e9:.2f} GB, {free_bytes / 1e9:.1f} GB free")
    l2 = l2_bytes or (50 << 20)
    want = -(-L2_FACTOR * l2 // max(set_bytes, 1))
    return int(max(1, min(MAX_SETS, want, free_bytes // 2 // max(set_bytes, 1))))


def count_from_env(name: str, default: int, meaning: str) -> int:
    """A whole number >= 0 from ``$name`` where set, else ``default``; a bad value is a ``ValueError`` naming the
    variable and ``meaning`` (what the number counts and what 0 and 1 do)."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    if not text.isdigit():
        raise ValueError(f"{name}={text!r}: expected a whole number of {meaning}")
    return int(text)
