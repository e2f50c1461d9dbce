"""What the measured choice times (``attnopt.tuning``): the candidates of a shape, in the order they are timed, which
of them share compiled kernels, and how a kernel plan is weighed against the SDPA peer's own kernel.

The cost model ranks the grids of one kernel configuration well and configurations against each other poorly, so
the tuner times the model's pick, every explicit SDPA backend (the peers' own kernels), the most parallel split-KV
plan, the model's ``top_k`` kernel plans and one plan of a few further configurations; after them, other grids of
the close configurations (``grid_siblings``) and the fastest plan's twins (``variant_twins``). ``compile_key`` tells
which plans share their Triton kernels at one site shape (a symbolic length's later buckets time only those already
compiled).
"""
from __future__ import annotations

import json
import math
from typing import Sequence

from .plan import Plan

#: A kernel plan must beat the fastest dense (SDPA) plan by more than this fraction, at every length it is judged at,
#: to be chosen over it. The dense plan is the peer's own kernel, so choosing it holds 1.0x the peer by construction;
#: a kernel plan that wins by less than the timing noise (about 1 % round to round) may lose by as much on the next
#: measurement (H100, planner part 0 of 2 at 18ffcc3: 0.978x-0.987x where a kernel plan or cuDNN won narrowly).
PEER_MARGIN = 0.01
#: A bucket's kernel winner is also timed against the fastest dense plan at the bucket's ends when that plan is within
#: this fraction of it at the middle: a fixed grid runs from half to twice its tiles per split inside a 2x bucket, so
#: the order of two plans this close can swap there (lhs08: split-KV ahead at 4096 keys, cuDNN 2 % ahead at 2432).
PEER_SPAN = 0.08
#: Kernel (non-SDPA) candidates timed per shape, best estimates first.
DEFAULT_TOP_K = 4
#: Kernel configurations beyond the top ``DEFAULT_TOP_K``: the best-estimated plan of each further (kind, block_n,
#: num_warps, num_stages) family, up to this many. On the H100 the datasheet model ranked SmolLM2's 1k static site
#: (9/3 heads, D=64) S=5/256/8/2 first, 10.0 µs alone in a graph, and left the fastest family out of its top four:
#: S=16/64/4/3 ran in 6.2 µs (probe at c761f67). Timing one plan per family lets measurement find it.
DEFAULT_EXTRA_FAMILIES = 4
#: After the first timing, the other grids of the fastest kernel configurations are timed too (``grid_siblings``):
#: this many configurations, up to ``GRID_SIBLINGS`` grids each. They share the compiled kernel, so each costs only its
#: timing. The model ranks grids of one configuration by waves and misses where a length's tiles quantise: at B=3
#: 12/4 heads D=96 it ranked S=16 (three 128-key tiles a split at 5000 keys) over S=33 (two), which was never timed
#: (H100, bf50495: S=16 16.4 µs against cuDNN's 15.8).
SIBLING_FAMILIES = 2
GRID_SIBLINGS = 4
#: ... only for configurations within this fraction of the fastest candidate measured (a grid with one tile a split
#: fewer runs up to a third faster; further behind, another grid cannot win).
SIBLINGS_WITHIN = 0.5
#: Then (``grid_siblings``'s ``near``) every further configuration whose fastest timed grid is within this fraction
#: of the fastest kernel plan gets ``NEAR_GRIDS`` grid siblings, those whose split counts at the timed length are
#: nearest the fastest plan's (at most ``SIBLING_FAMILIES_MAX`` configurations in all): a configuration is first timed
#: at one grid, its best estimate, and that grid can be its worst, while the fastest plan's grid already fits the
#: shape's output tiles to the GPU. H100 (planner cases at 2cead39), B1 14/2 D80 at 512k keys: 128-key tiles with 4
#: warps and 3 stages were timed only at the model's fixed 128 splits, 138.8 µs, 12 % behind the fastest timed plan
#: and seventh of the configurations; their 66 splits, the winner's grid (S66/bn256 chunks, 120.9), ran 120.0-120.3
#: µs padded in ``benchmarks/trail_variants.py`` (1a15bc4, 2c6eb78) and were never timed.
#: One grid each: on the H100 (planner cases at ef39938) every win of a further configuration came from its nearest
#: grid (512k above; lhs37, S22/bn256/w4/st3 beside the fastest S22/bn256/w8/st2: 482.5 µs against cuDNN's 487.9;
#: static 4k of 32k, S16/bn64 beside S16/bn128), while its second nearest grids cost a warm-up (2-5 s for ten).
#: Of the fastest plan's kind only (a stream-K grid counts programs, a split-KV one splits per output tile), and not
#: the prefetching or swapped families (``variant_twins`` times those of the fastest plan).
SIBLING_FAMILY_NEAR = 0.15
SIBLING_FAMILIES_MAX = 8
NEAR_GRIDS = 1
#: The runtime-key fields that make a kernel plan's twins (``variant_twins``): a twin runs the same grid and tiles
#: with L2 prefetch, head chunks, swapped products or pointer loads changed. The model cannot rank twins (each is
#: estimated just behind its plain twin), and ``to_time`` times only the best-estimated prefetching and swapped plans,
#: which may be of a slow configuration: at 512k keys above it timed S1024/bn256/w8/st2 prefetching (151.7 µs) while
#: S66/bn128/w4/st3's prefetching twin ran 117.5-118.9 µs (``trail_variants``), against cuDNN's 117.1-117.7.
TWIN_FIELDS = ("l2_prefetch", "head_chunks", "swap_ab", "tma")
#: The fastest measured kernel plans whose twins are timed after the grid siblings, and the most twins timed in all
#: (each a cold compile, about a second, in the warm-up's parallel compile): the fastest plan's own, three where the
#: head dim is cut in chunks (prefetching, chunked, both), one elsewhere while swap-AB twins are off.
TWIN_PLANS = 1
TWINS_MOST = 3
#: ... only where the fastest kernel plan is within this fraction of the fastest measured plan: on the H100 a
#: prefetching twin ran at most 2.1 % faster than its plain plan (``trail_variants``, 512k above), a head-chunked one up
#: to 16 % (``SplitKV``'s ``CHUNK_MIN_BLOCK_N`` note).
TWINS_WITHIN = 0.15
#: Further families are timed only within this factor of the best kernel estimate (a family the model puts 3x
#: behind costs a cold compile, about a second, and has not won a measurement on the H100).
EXTRA_WITHIN = 2.0


def to_time(ranked: Sequence[Plan], top_k: int, extra_families: int = DEFAULT_EXTRA_FAMILIES, *,
            n_keys: int | None = None) -> list[Plan]:
    """The candidates worth timing, in the order they are timed.

    Which: the model's pick; every explicit SDPA backend (cuDNN first: the fastest on Hopper; ``auto`` only when no
    backend is named explicitly, as it is one of them); the most parallel split-KV plan (``most_parallel``); the
    best-estimated head-chunked plan where there are such (D=80/96: the model cannot rank them); the
    ``top_k`` kernel plans by estimate; the best-estimated plan of up to ``extra_families`` further kernel
    configurations (kind, block_n, num_warps, num_stages, head chunks) estimated within ``EXTRA_WITHIN`` of the best (the model
    ranks the grids of one configuration well and configurations against each other poorly).

    Order: the model's pick, the SDPA backends, the most parallel plan, the head-chunked one, one plan of each
    configuration, the best-estimated swap-AB and prefetching plans (``SplitKVPlan.swap_ab`` / ``l2_prefetch``,
    where the candidates have such twins: only these two of them; the top k and the further families are of the
    others), then a second grid of any configuration. The budget stops new candidates, and a configuration's first plan pays its cold compile
    (about a second) where a second grid of it costs only its timing, so the configurations come first.
    ``n_keys``: the KV length they are timed at (a grid that follows the length is counted there)."""
    if not ranked:
        return []
    explicit = [p for p in ranked if p.kind == "dense" and getattr(p, "backend", "auto") != "auto"]
    order = {"cudnn": 0, "flash": 1, "efficient": 2, "math": 3}
    dense = sorted(explicit, key=lambda p: order.get(p.backend, 9)) or [p for p in ranked if p.kind == "dense"][:1]
    ranked_kernels = [p for p in ranked if p.kind != "dense"]
    # the swap-AB and prefetching twins, estimated just behind their plain twins, would otherwise fill the top k
    # and the further families in their place; the best-estimated of each is timed early instead (below)
    plain = [p for p in ranked_kernels if not (getattr(p, "swap_ab", False) or getattr(p, "l2_prefetch", 0))]
    kernels = plain[:top_k]
    families = {_family(p) for p in [ranked[0]] + kernels}
    estimates = [p.est_us for p in kernels if math.isfinite(p.est_us)]
    ceiling = EXTRA_WITHIN * min(estimates) if estimates else math.inf
    for p in plain[top_k:]:
        if extra_families <= 0:
            break
        if _family(p) not in families and not p.est_us > ceiling:
            families.add(_family(p))
            kernels.append(p)
            extra_families -= 1
    widest = most_parallel(ranked_kernels, n_keys)
    # the best-estimated head-chunked plan (D=80/96), timed early: the model ranks each just behind its padded twin
    # and cannot tell which runs faster (H100: from 16 % faster to 8 % slower), so only a measurement picks one
    chunked = next((p for p in ranked_kernels if getattr(p, "head_chunks", False)), None)
    # likewise the best-estimated swap-AB plan and the best-estimated prefetching one (the model ranks neither)
    swapped = next((p for p in ranked_kernels if getattr(p, "swap_ab", False)), None)
    fetching = next((p for p in ranked_kernels if getattr(p, "l2_prefetch", 0)), None)
    early = [p for p in (widest, chunked) if p is not None]
    twins = [p for p in (swapped, fetching) if p is not None]  # after the configurations: each a cold compile
    seen_families = {_family(ranked[0])} | {_family(p) for p in early + twins}
    firsts, seconds = [], []
    for p in kernels:
        (seconds if _family(p) in seen_families else firsts).append(p)
        seen_families.add(_family(p))
    out: list[Plan] = [ranked[0]]
    for p in dense + early + firsts + twins + seconds:
        if all(p.runtime_key() != q.runtime_key() for q in out):
            out.append(p)
    return out


def grid_siblings(measured: dict[str, float], ranked: Sequence[Plan], tried: set[str],
                  families: int = SIBLING_FAMILIES, most: int = GRID_SIBLINGS, n_keys: int | None = None,
                  near: bool = False) -> list[Plan]:
    """The untried grids (``ranked`` order, at most ``most`` each) of the ``families`` fastest measured kernel
    configurations (``_family``: the same kernel apart from the grid, and whether one split skips the merge) within
    ``SIBLINGS_WITHIN`` of the fastest measured. With ``near``, instead: of each further configuration of the fastest
    kernel plan's kind, neither prefetching nor swapped, within ``SIBLING_FAMILY_NEAR`` of the fastest measured kernel
    plan (``SIBLING_FAMILIES_MAX`` configurations in all, counting the ``families``), the ``NEAR_GRIDS`` untried grids
    whose split counts at ``n_keys`` are nearest (by ratio) the fastest kernel plan's, every configuration's nearest
    first. ``measured``: runtime key -> µs of the
    candidates timed; ``tried``: the runtime keys timed or failed. A sibling of a configuration timed only at one
    split, or only at several, compiles that other kernel in the warm-up; the rest share a compiled kernel."""
    by_key = {p.runtime_key(): p for p in ranked}
    kernels = _kernels_fastest_first(measured, by_key)
    if not kernels:
        return []
    within = (1 + SIBLINGS_WITHIN) * min(measured.values())
    close = (1 + SIBLING_FAMILY_NEAR) * measured[kernels[0]]
    chosen: list[tuple] = []
    for k in kernels:
        fam = _family(by_key[k])
        if fam in chosen or measured[k] > within:
            continue
        if len(chosen) < families:
            chosen.append(fam)
        elif near and measured[k] <= close and len(chosen) < SIBLING_FAMILIES_MAX and \
                by_key[k].kind == by_key[kernels[0]].kind and not _twin_flags(by_key[k]):
            chosen.append(fam)
    grids = [[p for p in ranked if p.kind != "dense" and p.runtime_key() not in tried and _family(p) == fam]
             for fam in chosen]
    if not near:
        return [p for g in grids[:families] for p in g[:most]]
    target = _splits(by_key[kernels[0]], n_keys)
    nearest = [sorted(g, key=lambda p: abs(math.log(_splits(p, n_keys) / target)))[:NEAR_GRIDS]
               for g in grids[families:]]
    return [g[i] for i in range(NEAR_GRIDS) for g in nearest if i < len(g)]


def _kernels_fastest_first(measured: dict[str, float], by_key: dict[str, Plan]) -> list[str]:
    """The runtime keys of the measured kernel (not dense) plans of ``by_key``, fastest first."""
    return sorted((k for k in measured if k in by_key and by_key[k].kind != "dense"), key=measured.get)


def _twin_flags(plan: Plan) -> bool:
    """Whether a kernel plan prefetches into L2 or swaps its products (a twin of a plain plan)."""
    return bool(getattr(plan, "l2_prefetch", 0) or getattr(plan, "swap_ab", False))


def _splits(plan: Plan, n_keys: int | None) -> int:
    """Programs per output tile at ``n_keys`` keys (≥ 1): a split-KV plan's splits there, a stream-K plan's grid."""
    splits_at = getattr(plan, "splits_at", None)
    if splits_at is not None:
        return max(1, splits_at(n_keys) if n_keys else plan.num_splits)
    return max(1, int(getattr(plan, "grid", 1)))


def variant_twins(measured: dict[str, float], ranked: Sequence[Plan], tried: set[str], plans: int | None = None,
                  most: int | None = None) -> list[Plan]:
    """The untried twins (``TWIN_FIELDS``: the same plan but for L2 prefetch, head chunks, swapped products or
    pointer loads) in ``ranked`` of the ``plans`` (``TWIN_PLANS``) fastest measured kernel plans, the fastest's
    first, at most ``most`` (``TWINS_MOST``); none where the fastest kernel plan is over ``TWINS_WITHIN`` behind the
    fastest measured plan (a dense one). ``measured``: runtime key -> µs; ``tried``: the runtime keys timed or
    failed."""
    plans = TWIN_PLANS if plans is None else plans
    most = TWINS_MOST if most is None else most
    by_key = {p.runtime_key(): p for p in ranked}
    kernels = _kernels_fastest_first(measured, by_key)
    if not kernels or measured[kernels[0]] > (1 + TWINS_WITHIN) * min(measured.values()):
        return []
    out: list[Plan] = []
    for k in kernels[:plans]:
        base = _apart_from_twins(by_key[k])
        out += [p for p in ranked if p.kind == by_key[k].kind and p.runtime_key() not in tried
                and _apart_from_twins(p) == base and all(p is not q for q in out)]
    return out[:most]


def _apart_from_twins(plan: Plan) -> str:
    """A plan's runtime key without the ``TWIN_FIELDS``."""
    data = dict(json.loads(plan.runtime_key())["data"])
    for name in TWIN_FIELDS:
        data.pop(name, None)
    return json.dumps({"kind": plan.kind, "data": data}, sort_keys=True)


def most_parallel(kernels: Sequence[Plan], n_keys: int | None = None) -> Plan | None:
    """The split-KV plan with the smallest tiles and, among those, the most splits (the best estimate of equals):
    on a short KV (a few tiles per (batch row, KV head)) one tile per split fills the GPU where the model's wave
    sizing does not. At SmolLM2's 1k static site (9/3 heads, D=64) that is S=17/64/4/3; a forced H100 sweep found
    S=16/64/4/3 at 6.2 µs against 10 µs for the model's S=5/256/8/2 (c761f67). ``None`` without a split-KV plan.
    ``n_keys``: the KV length, where a plan's grid follows it (``SplitKVPlan.splits_at``); without it, the plans
    whose grids follow the length as one split per tile come first (those of several tiles per split are the
    small-split family, sized for long caches)."""
    splits = [p for p in kernels if p.kind == "split_kv"]
    if not splits:
        return None

    def order(p: Plan) -> tuple:
        count = (0, -p.splits_at(n_keys)) if n_keys else (p.tiles_per_split > 1, -p.num_splits)
        return (p.block_n, *count, p.est_us if math.isfinite(p.est_us) else math.inf)

    return min(splits, key=order)


def _family(plan: Plan) -> tuple:
    """A kernel plan's configuration apart from its grid: (kind, block_n, num_warps, num_stages, head chunks,
    swap-AB, L2 prefetch, TMA tiles)."""
    return (plan.kind, getattr(plan, "block_n", None), getattr(plan, "num_warps", None),
            getattr(plan, "num_stages", None), getattr(plan, "head_chunks", False), getattr(plan, "swap_ab", False),
            getattr(plan, "l2_prefetch", 0), getattr(plan, "tma", None))


def compile_key(plan: Plan) -> str:
    """What a kernel plan compiles apart from its grid: its runtime key without the split count, the grid or the
    tiles per split, with whether the split count is 1 (one split writes the output itself and skips the merge; the
    split count is otherwise not specialised, ``runtime/kernels/split_kv.py``). Plans of one key share their kernels
    at one site shape, so a bucket may time any of them once another bucket compiled one."""
    data = dict(json.loads(plan.runtime_key())["data"])
    splits = data.pop("num_splits", None)
    data.pop("grid", None)
    data.pop("tiles_per_split", None)
    if splits is not None:
        data["one_split"] = splits == 1
    return json.dumps({"kind": plan.kind, "data": data}, sort_keys=True)


def fastest_dense(measured: dict[str, float], by_key: dict[str, Plan]) -> str | None:
    """The runtime key of the fastest measured dense (SDPA) plan, or ``None``."""
    dense = [k for k in measured if by_key[k].kind == "dense"]
    return min(dense, key=measured.get) if dense else None


def near_peer(best: str, measured: dict[str, float], by_key: dict[str, Plan]) -> str | None:
    """The fastest dense plan when ``best`` is a kernel plan and that dense plan is within ``PEER_SPAN`` of it."""
    peer = fastest_dense(measured, by_key)
    if peer is None or by_key[best].kind == "dense" or measured[peer] > (1 + PEER_SPAN) * measured[best]:
        return None
    return peer


def prefer_peer(best: str, measured: dict[str, float], by_key: dict[str, Plan]) -> str:
    """``best``, or the fastest dense plan where ``best`` is a kernel plan ahead of it by ``PEER_MARGIN`` or less."""
    peer = fastest_dense(measured, by_key)
    if peer is not None and by_key[best].kind != "dense" and measured[peer] <= (1 + PEER_MARGIN) * measured[best]:
        return peer
    return best
