"""Cross-rank checks before collectives: the plan's world size, and the shapes and dtypes every rank brings.

Ranks that disagree would meet in collectives of different sizes, where one rank aborts and another returns
garbage; these checks gather a small fixed-size signature first (with the group's timeout) and raise
:class:`~.groups.DistributedDecodeError` on every rank, naming each rank's values.
"""
from __future__ import annotations

import hashlib
from typing import Sequence

import torch
from torch import Tensor

from .groups import DistGroup, DistributedDecodeError


def check_world(group: DistGroup, world: int, what: str) -> None:
    """Raise a clear error when a plan's world size is not the group's."""
    if world != group.world:
        raise DistributedDecodeError(
            f"{what} was planned for world={world} ranks but runs on {group.describe()}; re-plan with "
            f"world_size={group.world} (attnopt.optimize(model, process_group=pg) plans for pg.size())")


def _gather_ints(group: DistGroup, values: Sequence[int], what: str) -> list[list[int]]:
    """Every rank's ``values`` (ints, the same count on every rank): one all-gather with the group's timeout."""
    t = torch.tensor([int(x) for x in values], dtype=torch.int64)
    if group.backend == "nccl":
        t = t.cuda()
    out = torch.empty((group.world, t.numel()), dtype=t.dtype, device=t.device)
    group.all_gather(out, t, what=what)
    return out.cpu().tolist()


def check_same_across_ranks(group: DistGroup, values: Sequence[int], names: Sequence[str], what: str) -> None:
    """All-gather ``values`` (ints) and raise :class:`DistributedDecodeError` naming each rank's values on a mismatch.

    Cheap (one all-gather of a few int64); called from ``prepare``, never per step.
    """
    rows = _gather_ints(group, values, f"{what}: shape check")
    if any(r != rows[0] for r in rows):
        per_rank = "; ".join(f"rank {i}: " + ", ".join(f"{n}={v}" for n, v in zip(names, r)) for i, r in enumerate(rows))
        raise DistributedDecodeError(f"{what}: ranks disagree on the decode shapes ({per_rank}); every rank must run "
                                     f"the same query shape, heads and dtype")


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.sha1(text.encode()).digest()[:7], "little")


DTYPE_CODES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.float64: 4}
DECODE_FIELDS = ("B", "Hq", "L", "D", "Hkv", "Dv", "dtype", "kv_dtype", "q_dims")


def decode_signature(q: Tensor, k: Tensor, v: Tensor) -> list[int]:
    """What every rank's decode call must agree on (``DECODE_FIELDS``): q (B, Hq, L, D), the KV heads and value
    dim, the dtypes (codes of ``DTYPE_CODES``). K/V lengths may differ across ranks. -1 stands for a missing dim."""
    qs = list(q.shape) if q.dim() == 4 else [-1] * 4
    return qs + [k.shape[1] if k.dim() == 4 else -1, v.shape[-1] if v.dim() else -1, DTYPE_CODES.get(q.dtype, 0),
                 DTYPE_CODES.get(k.dtype, 0), q.dim()]


def check_decode_shapes(group: DistGroup, q: Tensor, k: Tensor, v: Tensor, what: str, plan_key: str = "") -> None:
    """Check that every rank runs the same (B, Hq, L, D, Hkv, Dv, dtypes, plan). K/V lengths may differ."""
    check_same_across_ranks(group, decode_signature(q, k, v) + [_digest(plan_key)], DECODE_FIELDS + ("plan",), what)


def _cannot_sync() -> bool:
    """Inside a CUDA graph capture or a dynamo trace no host sync can happen: the check is left to an eager call."""
    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


#: The public calls that compare a signature across ranks before their first collective, and its fields. The
#: signature sent is [call index, values..., -1 padding]: the same size for every call, so that ranks making
#: different calls still meet in one all-gather and learn of it.
CHECKED_CALLS: dict[str, tuple[str, ...]] = {
    "tree_decode": DECODE_FIELDS + ("collective", "hierarchical"),
    "combine_tree": ("B", "Hq", "L", "Dv", "lse_matches", "dtype", "collective", "hierarchical"),
    "ring_pass_kv": DECODE_FIELDS + ("mask_heads",),
    "ring_pass_q": DECODE_FIELDS,
}
SIGNATURE_LEN = 1 + max(len(fields) for fields in CHECKED_CALLS.values())
_DTYPE_NAMES = {code: str(dtype).replace("torch.", "") for dtype, code in DTYPE_CODES.items()}


def _describe_signature(rank: int, row: Sequence[int]) -> str:
    calls = list(CHECKED_CALLS)
    call = calls[row[0]] if 0 <= row[0] < len(calls) else f"call {row[0]}"
    shown = [f"{n}={_DTYPE_NAMES.get(v, v) if n.endswith('dtype') else v}"
             for n, v in zip(CHECKED_CALLS.get(call, ()), row[1:])]
    return f"rank {rank}: {call}({', '.join(shown)})"


def check_shapes_once(group: DistGroup, call: str, values: Sequence[int]) -> None:
    """Before the first collective of ``call`` (a key of ``CHECKED_CALLS``) with a new signature ``values``: one
    all-gather of every rank's signature (with the group's timeout), and a :class:`DistributedDecodeError` on every
    rank, naming each rank's call and values, when they differ.

    Each group remembers the signatures its ranks agreed on, so a decode loop pays one small all-gather per new
    shape, not per step. Ranks are expected to call with the same sequence of shapes: a rank whose first call of
    a shape differs from the others' is caught here. Skipped inside a CUDA graph capture or a dynamo trace (no
    host sync there); an eager call of the same shape checks it.
    """
    fields = CHECKED_CALLS[call]
    if len(values) != len(fields):
        raise ValueError(f"{call}: {len(values)} signature values for the {len(fields)} fields {fields}")
    key = (call, tuple(int(x) for x in values))
    if group.world <= 1 or key in group._checked or _cannot_sync():
        return
    row = [list(CHECKED_CALLS).index(call), *key[1]] + [-1] * (SIGNATURE_LEN - 1 - len(values))
    rows = _gather_ints(group, row, f"{call}: shape check")
    if any(r != rows[0] for r in rows):
        per_rank = "; ".join(_describe_signature(i, r) for i, r in enumerate(rows))
        raise DistributedDecodeError(
            f"attnopt distributed decode: ranks disagree on the call, shapes or dtypes ({per_rank}); every rank must "
            f"make the same call with the same query shape, heads, dtypes and collective")
    group._checked.add(key)
