"""The shapes of ``attnopt bench planner``: the issue's named shapes, fixed corners of the grid, a seeded
Latin-hypercube sample of the grid, and a few seeded shapes off the grid.

The grid (issue 19): B in 1-64; G = Hq/Hkv in {1, 2, 3, 4, 5, 7, 8}; D in {64, 80, 96, 128, 256}; N from 1k to
512k; dynamic and static caches; q_len 1 and 4. A case is ``(B, Hq, Hkv, D, N, q_len, cache)`` with ``cache`` one of

* ``fixed``: a static KV length, no mask (the issue's table);
* ``dynamic``: the KV length is marked dynamic (a growing cache), so the site is planned per length bucket;
* ``static``: a preallocated cache of N keys holding N / ``STATIC_FILL`` with a bool mask (B, 1, q_len, N);
* ``static-full``: the same holding all but its last ``FULL_SLACK`` keys, as the e2e bench's StaticCache of the
  context plus 64 new tokens at its first decode step (the ``E2E`` cases, run when named with ``--cases``).

A shape whose K/V would exceed ``MAX_SET_BYTES`` has its batch halved until it fits (the N stratum is kept).
"""
from __future__ import annotations

import math
import random
import re

Case = tuple[int, int, int, int, int, int, str]

#: name -> case; the issue-19 table's shapes (the D=96 MHA one stands for its held-out shape).
NAMED: dict[str, Case] = {
    "llama3-8b-8k": (1, 32, 8, 128, 8192, 1, "fixed"),
    "llama3-8b-128k": (1, 32, 8, 128, 131072, 1, "fixed"),
    "smollm2-8k": (1, 9, 3, 64, 8192, 1, "fixed"),
    "smollm2-128k": (1, 9, 3, 64, 131072, 1, "fixed"),
    "mha56-d64-64k": (1, 56, 56, 64, 65536, 1, "fixed"),
    "llama3-8b-B64-4k": (64, 32, 8, 128, 4096, 1, "fixed"),
    "mha32-d96-32k": (1, 32, 32, 96, 32768, 1, "fixed"),
    "static-4k-of-32k": (1, 32, 8, 128, 32768, 1, "static"),
}
#: The e2e bench's attention sites (issue 16), nearly full static caches: SmolLM2's at 1k and 8k, llama3-8b's at
#: 128k. Run only when named (``--cases``): the tuner times a static cache full, and these show it picks there.
E2E: dict[str, Case] = {
    "e2e-smollm2-1k-static": (1, 9, 3, 64, 1024 + 64, 1, "static-full"),
    "e2e-smollm2-8k-static": (1, 9, 3, 64, 8192 + 64, 1, "static-full"),
    "e2e-llama3-8b-128k-static": (1, 32, 8, 128, 131072 + 64, 1, "static-full"),
}
#: The case the issue's static-cache check reads: a 32k cache holding 4k, the mask passed in, >= 5x SDPA over it.
STATIC_CHECK_CASE = "static-4k-of-32k"
STATIC_CHECK_MIN = 5.0
#: The grid's extremes: smallest and largest of every axis, each in a shape that fits in memory.
CORNERS: dict[str, Case] = {
    "corner-B1-mha-d64-1k-q1-dyn": (1, 16, 16, 64, 1024, 1, "dynamic"),
    "corner-B1-g8-d256-512k-q4-static": (1, 32, 4, 256, 524288, 4, "static"),
    "corner-B64-g8-d64-1k-q1-static": (64, 64, 8, 64, 1024, 1, "static"),
    "corner-B64-mha-d256-2k-q4-dyn": (64, 8, 8, 256, 2048, 4, "dynamic"),
    "corner-B1-g7-d80-512k-q1-dyn": (1, 14, 2, 80, 524288, 1, "dynamic"),
    "corner-B16-g5-d96-64k-q4-static": (16, 20, 4, 96, 65536, 4, "static"),
}
GROUPS = (1, 2, 3, 4, 5, 7, 8)
HEAD_DIMS = (64, 80, 96, 128, 256)
LOG2_B = (0, 6)  # B in 1..64
LOG2_N = (10, 19)  # N in 1k..512k
Q_LENS = (1, 4)
CACHES = ("dynamic", "static")
#: A static cache holds 1 / STATIC_FILL of its capacity (the issue's 4k of 32k).
STATIC_FILL = 8
#: A ``static-full`` cache's free slots.
FULL_SLACK = 64
#: The cache kinds passing a mask.
STATIC_KINDS = ("static", "static-full")
#: K/V bytes of one input set (bf16) above which a sampled shape's batch is halved.
MAX_SET_BYTES = 6 << 30


def _fit(b: int, hkv: int, d: int, n: int, item: int = 2) -> int:
    while b > 1 and b * hkv * n * 2 * d * item > MAX_SET_BYTES:
        b //= 2
    return b


def _balanced(values, count: int, rng: random.Random) -> list:
    """``count`` draws of ``values``, each value within one of the others' count, in a seeded random order."""
    out = [values[i % len(values)] for i in range(count)]
    rng.shuffle(out)
    return out


def _strata(lo: float, hi: float, count: int, rng: random.Random) -> list[float]:
    """One uniform draw in each of ``count`` equal strata of [lo, hi), in a seeded random order."""
    width = (hi - lo) / count
    out = [lo + (i + rng.random()) * width for i in range(count)]
    rng.shuffle(out)
    return out


def latin_hypercube(count: int, seed: int) -> dict[str, Case]:
    """``count`` grid shapes: log2 B and log2 N stratified (each stratum of each axis sampled once), G, D, q_len
    and the cache kind balanced, the axes paired at random (a Latin hypercube over the mixed axes). Hkv is drawn
    from {8, 16, 32, 56} for MHA and {1, 2, 4, 8} otherwise; N is rounded to a multiple of 64 so that most lengths
    fall inside a bucket, not on its edge."""
    if count <= 0:
        return {}
    rng = random.Random(seed)
    groups, dims = _balanced(GROUPS, count, rng), _balanced(HEAD_DIMS, count, rng)
    q_lens, caches = _balanced(Q_LENS, count, rng), _balanced(CACHES, count, rng)
    log_b, log_n = _strata(LOG2_B[0], LOG2_B[1] + 1, count, rng), _strata(LOG2_N[0], LOG2_N[1] + 1e-9, count, rng)
    out: dict[str, Case] = {}
    for i in range(count):
        g, d = groups[i], dims[i]
        hkv = rng.choice((8, 16, 32, 56)) if g == 1 else rng.choice((1, 2, 4, 8))
        n = max(1024, min(1 << LOG2_N[1], int(round(2 ** log_n[i] / 64)) * 64))
        b = _fit(max(1, min(64, int(2 ** log_b[i]))), hkv, d, n)
        L, cache = q_lens[i], caches[i]
        out[f"lhs{i:02d}-B{b}-{g * hkv}/{hkv}-d{d}-N{n}-q{L}-{cache}"] = (b, g * hkv, hkv, d, n, L, cache)
    return out


def off_grid(count: int, seed: int) -> dict[str, Case]:
    """``count`` seeded shapes outside the grid: G in {6, 10, 12, 16}, D in {32, 112} or a grid D, B not a power
    of two, N not a power of two, q_len 2 or 3."""
    rng = random.Random(seed + 1000)
    out: dict[str, Case] = {}
    for i in range(count):
        g = rng.choice((6, 10, 12, 16))
        d = rng.choice((32, 112, 64, 128))
        hkv = rng.choice((1, 2, 4))
        n = rng.randrange(1500, 600_000)
        b = _fit(rng.choice((3, 5, 12, 48)), hkv, d, n)
        L, cache = rng.choice((2, 3)), rng.choice(CACHES)
        out[f"off{i}-B{b}-{g * hkv}/{hkv}-d{d}-N{n}-q{L}-{cache}"] = (b, g * hkv, hkv, d, n, L, cache)
    return out


#: A sampled case's name (``latin_hypercube``, ``off_grid``), which spells its shape; any prefix may stand first, so
#: that a held-out shape can be named: ``x-B3-12/4-d96-N5000-q1-dynamic``.
_SHAPE_NAME = re.compile(r"^[A-Za-z0-9_.]+-B(\d+)-(\d+)/(\d+)-d(\d+)-N(\d+)-q(\d+)-(fixed|dynamic|static|static-full)$")


def case_of(name: str) -> Case:
    """The case named ``name``: a named, corner or e2e case, or a name that spells its shape as the sampled ones do
    (``PREFIX-B<b>-<Hq>/<Hkv>-d<D>-N<N>-q<L>-<cache>``). ``ValueError`` naming both otherwise."""
    known = {**NAMED, **CORNERS, **E2E}
    if name in known:
        return known[name]
    m = _SHAPE_NAME.match(name)
    if m is None or int(m.group(3)) == 0 or int(m.group(2)) % int(m.group(3)):
        raise ValueError(f"unknown case {name!r}; known: {', '.join(known)}; or a shape spelled "
                         "PREFIX-B<b>-<Hq>/<Hkv>-d<D>-N<N>-q<L>-<fixed|dynamic|static|static-full> "
                         "(Hq a multiple of Hkv)")
    b, hq, hkv, d, n, q = (int(m.group(i)) for i in range(1, 7))
    return (b, hq, hkv, d, n, q, m.group(7))


def all_cases(grid: int, off: int, seed: int, named: tuple[str, ...] | None = None) -> dict[str, Case]:
    """The named shapes and the corners (or only the cases ``named``: named, corner, e2e or shape-spelling names,
    ``case_of``), ``off`` off-grid shapes, then ``grid`` Latin-hypercube ones: in that order, so that a run its
    time budget cuts short loses sampled shapes, not a kind of shape."""
    if named is not None:
        bad = []
        for c in named:
            try:
                case_of(c)
            except ValueError as exc:
                bad.append((c, exc))
        if bad:
            raise ValueError(f"unknown case(s) {[c for c, _ in bad]}: {bad[0][1]}")
    picked = {c: case_of(c) for c in named} if named is not None else {**NAMED, **CORNERS}
    return {**picked, **off_grid(off, seed), **latin_hypercube(grid, seed)}


def valid_len_of(case: Case) -> int | None:
    """The valid length of a static case (its capacity / ``STATIC_FILL``; a ``static-full`` one's capacity less
    ``FULL_SLACK``), else ``None``."""
    if case[6] == "static":
        return max(1, case[4] // STATIC_FILL)
    if case[6] == "static-full":
        return max(1, case[4] - FULL_SLACK)
    return None


def geomean(values) -> float:
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else math.nan
