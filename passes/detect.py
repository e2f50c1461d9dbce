"""``detect`` pass: find every attention site, read its shapes from ``node.meta``, decide whether it is
decode-time attention, and classify its mask. Non-mutating: it appends one ``AttentionMatch`` per site (in
graph order) to ``ctx.matches``, including sites left alone, whose ``site.unsupported`` says why.

Decode-time rule (issue 2, item 3): ``q_len`` is static and ``<= config.max_decode_q_len``, and ``kv_len`` is
symbolic, or static with ``kv_len > q_len`` and ``kv_len >= config.min_kv_len``. Everything else is prefill.
A size the shape environment has specialised (a StaticCache's head count under ``dynamic=True``) is static.

Softmax scale: a number, or under ``dynamic=True`` the ``.item()`` of a 0-d input that dynamo makes of a float
attribute (HF's ``self.scaling``). SDPA specialises that symbolic float (dynamo guards it; it is read as a
number); the eager chain keeps it symbolic and ``lower`` folds it into q at run time.

Mask kinds (issue 2, item 4; the runtime applies any mask exactly per tile, so the kind is for reporting, the
cost model and wiring ``valid_len``), from ``patterns.mask_form``, which proves what a mask is:

* ``none`` / ``causal``: no mask tensor (``causal`` = ``is_causal=True``, PyTorch's top-left alignment);
* ``valid_length``: one head, and an AND of ``key_position <= query_position`` (key positions: ``arange`` plus
  a per-row offset along the last dim) with terms that compare no positions, such as Hugging Face's padding
  lookup ``padding[batch, kv]``; through broadcasts, slices and ``where(mask, 0, finfo.min)`` for additive forms.
  This is the mask transformers builds *inside* a compiled forward over a StaticCache (a direct call,
  ``torch.export``). ``generate()`` over a StaticCache builds its 4-D mask *before* the compiled forward
  (``create_masks_for_generate``), so the graph sees a placeholder, of which nothing can be proved: "arbitrary";
* ``arbitrary``: any other boolean or additive 0 / -inf / very-negative mask (graph inputs, suffixes, ORs, ...).

Sliding windows (``site.window``): a site with a mask is one when its module is in ``config.sliding_windows``
(``attnopt.optimize`` fills it from the model's attention modules), or when its mask provably is a window: an AND
of ``key <= query`` and ``key > query - w`` (HF's ``sliding_window_overlay``; ``w`` is read off the subtraction).
Other spellings of the band (``kv >= qp + (1 - w)``, ``qp - kv < w``) are read by ``patterns.band``. Nothing about
the window's exactness rests on the window number: ``lower`` either proves the band from the mask's graph
(``passes/window.py``) or scans the mask for the first key any query row may see (``key_range_from_mask``, on the
device each step) and still applies it, so any mask, window or not, gives the original's result; the window only
says that the start is worth finding (and what the cost model prices: the band's keys). Without a model object (``torch.compile(model, backend="attnopt")``) only
the graph can tell: a mask that is a graph input (``generate()`` over a StaticCache) is not recognised as a
window and is read whole. A site without a mask (HF's sdpa path drops it while the window exceeds the keys)
attends to every key, as the original does.

Logit softcapping (``site.softcap``) and ALiBi (``site.alibi``), from the eager pattern: only plan kinds that
apply them are planned.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from attnopt.site import AttentionSite

from . import guard
from .context import PassContext
from .patterns.band import band_window
from .patterns import (AttentionMatch, classify_mask, find_matches, logical_shape, mask_form, meta_dtype, meta_shape,
                       meta_val, module_path)


def _static(x: Any) -> tuple[int | None, int | None]:
    """(static value or None, hint) of a size that may be a SymInt."""
    if isinstance(x, int):
        return x, x
    if isinstance(x, torch.SymInt):
        node = x.node
        try:
            # A symbol the shape environment has since specialised (e.g. a StaticCache's head count under
            # dynamic=True, fixed by repeat_kv's reshape) reads as a number: dynamo guards on it.
            v = node.maybe_as_int() if hasattr(node, "maybe_as_int") else None
            if v is not None:
                return int(v), int(v)
        except Exception:  # noqa: BLE001 - best effort on the symbolic-shape internals
            pass
        hint = getattr(node, "hint", None)
        if hint is None:
            try:
                hint = node.shape_env.size_hint(node.expr)
            except Exception:  # noqa: BLE001
                hint = None
        return None, int(hint) if hint is not None else None
    return None, None


def _dtype_name(dt: torch.dtype | None) -> str:
    return str(dt).removeprefix("torch.") if dt is not None else "unknown"


def _mask_kind(m: AttentionMatch, q_len: Any) -> str:
    if m.score_bias is not None:  # a bias (Bloom's baddbmm) joins the mask: no longer a prefix of keys, nor none
        return "arbitrary"
    if m.attn_mask is None:
        return "causal" if m.is_causal else "none"
    if not isinstance(m.attn_mask, fx.Node):
        return "arbitrary"
    return classify_mask(m.attn_mask, q_len, invert=m.mask_invert)


def sliding_window_of(m: AttentionMatch, path: str, config, batch: Any = None) -> int | None:
    """The window of a site with a mask, or None: its module's (``config.sliding_windows``, filled by
    ``attnopt.optimize`` from the model), or one its mask provably is (``key > query - w`` AND-ed with
    ``key <= query``, or any other spelling of that band that ``patterns.band`` proves)."""
    if m.attn_mask is None:
        return None
    window = dict(config.sliding_windows).get(path) if path else None
    if window is None and isinstance(m.attn_mask, fx.Node):
        if not m.mask_invert:  # the band counts the keys from both bounds (``key < q`` keeps one fewer than ``<=``)
            window = band_window(m.attn_mask, batch)
        form = mask_form(m.attn_mask, m.mask_invert) if window is None else None
        if form is not None and form.upper and form.window is not None:
            window = form.window
    return window


def build_site(m: AttentionMatch, config) -> AttentionSite:
    """Turn a pattern match into an ``AttentionSite``: shapes, decode rule, mask kind, unsupported reason."""
    reason = m.reason
    name = m.anchor.name if m.pattern.startswith("sdpa") else m.output.name
    qs, ks, vs = logical_shape(m, "q"), logical_shape(m, "k"), logical_shape(m, "v")
    fields: dict[str, Any] = dict(node=name, module_path=module_path(m.anchor if m.anchor is not None else m.output),
                                  pattern=m.pattern, batch=None, q_heads=0, kv_heads=0, head_dim=0, q_len=None,
                                  kv_len=None, dtype=_dtype_name(meta_dtype(m.q)), scale=m.scale,
                                  is_causal=m.is_causal, gqa_source=m.gqa_source)
    if qs is None or ks is None or vs is None:
        fields["unsupported"] = reason or "q/k/v shapes are unknown (no fake value in node.meta)"
        return AttentionSite(**fields)
    if len(qs) != 4 or len(ks) != 4 or len(vs) != 4:
        fields["unsupported"] = reason or f"expects 4-D (B, H, L, D) q/k/v; got ranks {len(qs)}/{len(ks)}/{len(vs)}"
        return AttentionSite(**fields)
    b, _ = _static(qs[0])
    hq, _ = _static(qs[1])
    hkv, _ = _static(ks[1])
    d, _ = _static(qs[3])
    dv, _ = _static(vs[3])
    L, _ = _static(qs[2])
    n, n_hint = _static(ks[2])
    fields.update(batch=b, q_heads=hq or 0, kv_heads=hkv or 0, head_dim=d or 0, v_head_dim=dv, q_len=L, kv_len=n,
                  kv_len_hint=n_hint)
    try:
        fields["mask_kind"] = _mask_kind(m, L)
    except Exception as e:  # noqa: BLE001 - classification is for reporting; never fail detection on it
        fields["mask_kind"] = "arbitrary"
        reason = reason or f"mask analysis failed: {e}"
    if reason is None:
        dts = {meta_dtype(m.q), meta_dtype(m.k), meta_dtype(m.v)}
        if any(getattr(meta_val(x), "requires_grad", False) for x in _differentiable_inputs(m)):
            reason = "training: gradients flow through this attention (the decode op has no backward)"
        elif not _same_batch(qs[0], ks[0]):
            reason = (f"the batch sizes of q ({qs[0]}) and k/v ({ks[0]}) differ: the original broadcasts them, the "
                      "decode op reads one K/V row per query row")
        elif None in (hq, hkv, d, dv):
            reason = "symbolic head count or head dim"
        elif 0 in (b, hq, hkv, d, dv):
            reason = (f"an empty attention (batch {b}, heads {hq}/{hkv}, head dims {d}/{dv}): nothing to rewrite, the "
                      "original's result is empty or zero")
        elif len(dts) != 1:
            reason = "q, k and v have different dtypes: " + ", ".join(sorted(_dtype_name(t) for t in dts))
        elif next(iter(dts)) not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            reason = f"dtype {_dtype_name(next(iter(dts)))} is not a floating-point attention dtype"
        elif hq % hkv:
            reason = f"query heads ({hq}) are not a multiple of KV heads ({hkv})"
        elif not same_static(ks[:3], vs[:3]):
            reason = "k and v differ in batch, heads or length"
        elif m.scale is None:
            reason = "the softmax scale is not a compile-time constant"
        elif L is None:
            reason = "prefill: symbolic q_len"
        elif L > config.max_decode_q_len:
            reason = f"prefill: q_len={L} > max_decode_q_len={config.max_decode_q_len}"
        elif n is not None and n <= L:
            reason = f"prefill: q_len={L} >= kv_len={n}"
        elif n is not None and n < config.min_kv_len:
            reason = f"kv_len={n} < min_kv_len={config.min_kv_len}"
        elif m.attn_mask is not None and isinstance(m.attn_mask, fx.Node):
            reason = _check_mask(m, qs, ks)
    if reason is None:
        fields["window"] = sliding_window_of(m, fields["module_path"], config, qs[0])
        fields["softcap"] = m.softcap
        fields["alibi"] = m.alibi_slopes is not None
    if m.shared_prefix is not None:
        prefix, prefix_hint = _static(meta_shape(m.shared_prefix[0])[2])
        fields["shared_prefix"] = prefix if prefix is not None else prefix_hint
    fields["unsupported"] = reason
    return AttentionSite(**fields)


def bare_site(m: AttentionMatch) -> AttentionSite:
    """The site of ``m`` with its name and pattern alone (what ``build_site`` failed to fill is unknown)."""
    anchor = m.anchor if m.anchor is not None else m.output
    node = m.anchor.name if m.pattern.startswith("sdpa") and m.anchor is not None else m.output.name
    try:
        path = module_path(anchor)
    except Exception:  # noqa: BLE001 - the name is for the report; the site is left alone either way
        path = ""
    return AttentionSite(node=node, module_path=path, pattern=m.pattern, batch=None, q_heads=0, kv_heads=0,
                         head_dim=0, q_len=None, kv_len=None, dtype="unknown")


def _differentiable_inputs(m: AttentionMatch) -> list:
    """Every tensor whose gradient the original would compute: q, k, v, and the mask, bias, ALiBi slopes and
    run-time scale factors (a learned position bias or temperature, while q/k/v come from frozen weights)."""
    return [m.q, m.k, m.v, m.attn_mask, m.score_bias, m.alibi_slopes] + [c for c, _ in m.scale_nodes]


def _same_batch(a: Any, b: Any) -> bool:
    """Whether two batch sizes are provably equal: equal ints, or symbols the shape environment knows equal (a
    symbolic size beside a static one may be broadcast against it)."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    if isinstance(a, int) or isinstance(b, int):
        return False
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return str(a) == str(b) or bool(statically_known_true(a == b))


def same_static(a, b) -> bool:
    """Sizes agree where both are static ints (two symbolic sizes are taken as equal: the original call
    raises at run time when they are not, and so does the rewritten one)."""
    if len(a) != len(b):
        return False
    return all(not (isinstance(x, int) and isinstance(y, int)) or x == y for x, y in zip(a, b))


def _check_mask(m: AttentionMatch, qs, ks) -> str | None:
    """The mask must broadcast to (B, Hq, L, N) and be boolean or floating."""
    s, dt = meta_shape(m.attn_mask), meta_dtype(m.attn_mask)
    if s is None:
        return "the mask's shape is unknown"
    if dt is not None and dt != torch.bool and not dt.is_floating_point:
        return f"mask dtype {_dtype_name(dt)} is neither bool nor floating"
    if m.mask_invert and dt != torch.bool:
        return "masked_fill with a non-boolean mask"
    if len(s) > 4:
        return f"mask of rank {len(s)} > 4"
    full = (qs[0], qs[1], qs[2], ks[2])[4 - len(s):]
    for have, want in zip(s, full):
        if isinstance(have, int) and have == 1:
            continue
        if not same_static((have,), (want,)):
            return f"mask of shape {tuple(s)} does not broadcast to (B, Hq, L, N) = {tuple(full)}"
    return None


def detect(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Append one ``AttentionMatch`` per attention site of ``gm`` to ``ctx.matches`` (graph order)."""
    for m in find_matches(gm):
        try:
            m.site = build_site(m, ctx.config)
        except Exception as exc:  # noqa: BLE001 - on_error: this site alone is left as the original
            m.site = guard.site_failed(ctx, bare_site(m), "detect", exc)
        ctx.matches.append(m)
    return gm


__all__ = ["detect", "build_site", "sliding_window_of"]
