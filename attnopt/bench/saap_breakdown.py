"""Per-launch device time of a SAAP call for ``attnopt bench saap``: torch.profiler over eager calls, each kernel
by name into its stage (scoring, selection, attention, merge, other), launched unchained; and the selection launch
alone at several widths."""
from __future__ import annotations

import contextlib
import os
from typing import Any

#: Breakdown fields of a SAAP row -> the kernel names (substrings) whose device time they sum; first match wins.
STAGES = {"scoring_us": ("_saap_rows_kernel",), "selection_us": ("_saap_select_kernel",),
          "attention_us": ("_saap_kernel",), "merge_us": ("_merge_states_kernel",), "other_us": ("",)}


def stage_of(kernel: str) -> str:
    """The ``STAGES`` field a kernel's device time goes to."""
    return next(stage for stage, names in STAGES.items() if any(n in kernel for n in names))


@contextlib.contextmanager
def unchained():
    """Launch without programmatic dependent launch for the duration (``ATTNOPT_PDL=0``)."""
    saved = os.environ.get("ATTNOPT_PDL")
    os.environ["ATTNOPT_PDL"] = "0"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("ATTNOPT_PDL")
        else:
            os.environ["ATTNOPT_PDL"] = saved


def kernel_times(fn, calls: int = 20) -> list[tuple[str, float]]:
    """(kernel name, device µs) of every kernel that ``calls`` eager calls of ``fn`` launch, under torch.profiler
    after three warm-up calls. The launches are not chained here (``ATTNOPT_PDL=0``), so each kernel's time is its
    own work, not also its wait for the one before."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    # without programmatic dependent launch: a chained kernel starts early and its time would include its wait
    with unchained():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
    return [(e.name, e.time_range.elapsed_us()) for e in prof.events()
            if str(getattr(e, "device_type", "")).endswith("CUDA")]


def launch_breakdown(fn, calls: int = 20) -> dict[str, float]:
    """Device time per call of each SAAP launch (``STAGES``) over ``calls`` eager calls of ``fn``
    (``kernel_times``), and the kernels per call."""
    out = {stage: 0.0 for stage in STAGES}
    times = kernel_times(fn, calls)
    for name, us in times:
        out[stage_of(name)] += us / calls
    out["kernels_per_call"] = len(times) / calls
    return out


#: Widths of the selection launch timed once per case and target (``selection_us_by_warps``).
SELECT_WARPS = (8, 16, 32)


def selection_by_warps(index, layer: int, state, s: dict[str, Any], probes: int, scale: float, sink: int,
                       warps: tuple[int, ...] = SELECT_WARPS, calls: int = 20) -> dict[str, float]:
    """Device µs per call of the selection launch alone (its one program per head) at each width of ``warps``, on
    one input set's query and clusters after its scoring launch (not counted): the width the selection should
    take."""
    from attnopt.runtime.kernels.saap_select import saap_select, select_workspace
    from attnopt.runtime.saap.decode import kernel_scorer

    q = s["q"]
    B, Hq, L, _ = q.shape
    Hkv = state.offsets.shape[1]
    scorer = kernel_scorer(index, layer)
    if state.centroids is not None:  # refined at prefill: what the op scores with
        scorer = scorer._replace(centroids=state.centroids)
    ws = select_workspace(B, Hkv, Hq // Hkv * L, scorer.clusters, scorer.hidden, q.device)
    out = {}
    for w in warps:
        def call(w=w):
            saap_select(q, state.offsets, state.ends, ws, probes=probes, scale=scale, n_keys=s["k"].shape[2],
                        sink=sink, scorer=scorer, num_warps=w)
        out[str(w)] = sum(us for name, us in kernel_times(call, calls) if "_saap_select_kernel" in name) / calls
    return out
