"""A sliding-window site's key range from its band (``patterns.band``): two tiny ops on the query positions in
place of ``key_range_from_mask``'s scan of the N-long mask, and the band factors dropped from the mask where that
is exact.

For a bound ``value + shift`` (``value`` the per-row position node, ``shift`` a number) the row's end (or start)
is ``clamp(value + shift, 0, N)``, computed as ``clamp(value, -shift, N - shift) + shift`` so that no position,
however large, overflows; then one value per batch row: a reshape (the bounds are per batch row) or the outermost
over the heads and query rows (``amin`` of the starts, ``amax`` of the ends). Both are int64 (B,), contiguous, as
the kernels read them. Under inductor they fuse with the positions' own arithmetic.
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from .context import PassContext
from .mutation import MutationIndex
from .patterns import AttentionMatch, meta_dtype, meta_shape
from .patterns.band import Band, Bound, band_of
from .patterns.nodes import _bare_name


def _per_batch_row(graph: fx.Graph, bound: Bound, n: Any, batch: Any, reduce: str, per_row: bool,
                   new: list) -> fx.Node:
    aten = torch.ops.aten
    x = bound.value
    if meta_dtype(x) != torch.int64:
        x = graph.call_function(aten._to_copy.default, (x,), {"dtype": torch.int64})
        new.append(x)
    if isinstance(n, int):
        x = graph.call_function(aten.clamp.default, (x, -bound.shift, n - bound.shift))
    else:  # a symbolic key count (a node)
        top = graph.call_function(operator.sub, (n, bound.shift))
        new.append(top)
        x = graph.call_function(aten.clamp.default, (x, -bound.shift, top))
    new.append(x)
    if bound.shift:
        x = graph.call_function(aten.add.Tensor, (x, bound.shift))
        new.append(x)
    s = meta_shape(bound.value)
    rows = len(s) == 4  # a 4-D position has the batch dim first; a shorter one is broadcast over the batch
    if per_row:
        x = graph.call_function(aten.reshape.default, (x, [-1]))
    else:
        dims = list(range(1, 4)) if rows else list(range(len(s)))
        x = graph.call_function(getattr(aten, reduce).default, (x, dims, False))
        if not rows:
            new.append(x)
            x = graph.call_function(aten.reshape.default, (x, [1]))
    new.append(x)
    if not (rows and isinstance(s[0], int) and isinstance(batch, int) and s[0] == batch):
        if rows and not (isinstance(s[0], int) and s[0] == 1):
            return x  # the batch dim is the (symbolic) batch itself
        x = graph.call_function(aten.expand.default, (x, [batch]))
        x = graph.call_function(aten.clone.default, (x,), {"memory_format": torch.contiguous_format})
        new += [x.args[0], x]
    return x


def band_key_range(graph: fx.Graph, ctx: PassContext, m: AttentionMatch, mask: fx.Node, q: fx.Node,
                   new_nodes: list, drop_ok: bool) -> tuple[fx.Node, fx.Node, fx.Node | None] | str:
    """(key start, valid length, the mask the op still needs) of a window site whose mask is a band, or the reason
    it is not (the caller then scans the mask). ``drop_ok``: the plan honours ``key_start`` in every case and the
    site keeps PyTorch's zero for an empty row, so the band factors may leave the mask. With a static batch, one
    set of nodes per mask node, right after it, shared by every layer reading it; else nodes of the site's own,
    at the current insertion point (before the site)."""
    batch: Any = m.site.batch
    if m.mask_invert or m.score_bias is not None or m.mask_written:
        return "the mask is inverted, biased or written in place"
    if mask in new_nodes:
        return "the mask was made for this site"
    key = ("band", mask, batch)
    hit = ctx.valid_lens.get(key) if batch is not None else None
    if hit is None:
        band, why = band_of(mask, batch if batch is not None else meta_shape(q)[0], MutationIndex(graph))
        if band is None:
            hit = why
        elif batch is not None:
            with graph.inserting_before(mask.next):  # prepending to the next node keeps the new nodes in order
                start, end = _emit(graph, band, batch, new_nodes)
            hit = (band, start, end)
        else:
            batch = graph.call_function(torch.ops.aten.sym_size.int, (q, 0))
            new_nodes.append(batch)
            start, end = _emit(graph, band, batch, new_nodes)
            hit = (band, start, end)
        if m.site.batch is not None:
            ctx.valid_lens[key] = hit
    if isinstance(hit, str):
        return hit
    band, start, end = hit
    if not (drop_ok and band.per_row):
        return start, end, mask
    if not band.rest:
        return start, end, None
    single = band.rest[0] if len(band.rest) == 1 else None
    return start, end, single if single is not None and len(meta_shape(single) or ()) >= 1 else mask


def _emit(graph: fx.Graph, band: Band, batch: Any, new: list) -> tuple[fx.Node, fx.Node]:
    """The (start, end) nodes of ``band`` at the current insertion point. A symbolic key count is read off the
    band's ``arange`` (which precedes the mask), not off the mask, so that a dropped mask can die."""
    n = meta_shape(band.nodes[0])[-1]
    if not isinstance(n, int):
        arange = next(x for x in band.nodes if _bare_name(x) == "arange")
        end = arange.kwargs.get("end", arange.args[0] if len(arange.args) == 1 else arange.args[1])
        if isinstance(end, fx.Node):  # the symbolic size the arange was made from: the arange itself can die
            n = end
        else:
            n = graph.call_function(torch.ops.aten.sym_size.int, (arange, 0))
            new.append(n)
    start = _per_batch_row(graph, band.lower, n, batch, "amin", band.per_row, new)
    end = _per_batch_row(graph, band.upper, n, batch, "amax", band.per_row, new)
    return start, end


__all__ = ["band_key_range"]
