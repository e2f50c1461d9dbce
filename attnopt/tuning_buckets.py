"""The KV-length buckets of a symbolic length (``attnopt.tuning``): one plan per bucket, timed at its middle and
judged at its ends."""
from __future__ import annotations

import bisect
import math
from typing import Sequence

#: Upper edges of the KV-length buckets of a symbolic length; longer lengths take the last bucket.
BUCKETS: tuple[int, ...] = tuple(1 << i for i in range(10, 20))


def bucket_length(bound: int, bounds: Sequence[int] = BUCKETS) -> int:
    """The KV length a bucket is timed at: the geometric middle of (previous bound, ``bound``] (of (bound / 2, bound]
    for the first), rounded to 64 keys. Every length of a bucket runs its plan, and the middle is within sqrt(2) of
    each of them, where the upper edge is 2x from the lower: on the H100 the bucket (2048, 4096] timed at 4096 chose
    split-KV for B=64 8/8 heads D=80, 2% slower than cuDNN at 2432 (planner part 0 of 2, lhs08, at 18ffcc3)."""
    i = list(bounds).index(bound)
    low = bounds[i - 1] if i > 0 else bound // 2
    middle = math.sqrt(low * bound)
    n = int(round(middle / 64)) * 64 if middle >= 64 else int(round(middle))
    return min(bound, max(low + 1, n))


def bucket_span(bound: int, bounds: Sequence[int] = BUCKETS) -> tuple[int, int]:
    """The shortest and longest KV length a bucket's plan is tuned for: just above the previous bound (half the
    first bound for the first bucket) and ``bound``. "Just above" is 64 keys above where the bound is a multiple of
    64: Triton specializes a kernel on whether an integer argument is a multiple of 16, and an odd length would
    compile every candidate again."""
    i = list(bounds).index(bound)
    low = bounds[i - 1] if i > 0 else bound // 2
    return min(bound, low + (64 if low >= 64 and low % 64 == 0 else 1)), bound


def bucket_of(n: int, bounds: Sequence[int] = BUCKETS) -> int:
    """The bucket (its upper edge) holding KV length ``n``: the first bound >= n, else the last bound."""
    if n < 1:
        raise ValueError(f"a KV length must be >= 1, got {n}")
    return bounds[min(bisect.bisect_left(bounds, n), len(bounds) - 1)]


def hint_length(hint: int, bound: int, bounds: Sequence[int] = BUCKETS) -> int:
    """The KV length the hint's bucket is timed at: the trace-time hint (the length the site runs at now) rounded up
    to a multiple of 16, kept inside the bucket's span (``bucket_span``: a hint far below the first bucket's, a
    prompt of a few tokens, would tune for lengths that pass in a few steps; the last bucket takes any longer
    length). Rounding up keeps every plan's tile count (tiles are multiples of 16 keys) and, as Triton specializes an
    integer argument on whether it is a multiple of 16, spares a compile of every candidate at an odd length."""
    if hint < 1:
        raise ValueError(f"a KV length hint must be >= 1, got {hint}")
    low, high = bucket_span(bound, bounds)
    n = max(low, -(-int(hint) // 16) * 16)
    return n if list(bounds).index(bound) == len(bounds) - 1 else min(high, n)
