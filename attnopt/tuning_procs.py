"""The tuner's Triton compiles in worker processes: a background tuning's warm-up without the GIL of the process.

A background tuning (``attnopt.tuning_defer``) runs beside the inner backend's compile, and both are Python on one
GIL. Its warm-up (``GpuTimer.warm_up``) makes every candidate's first call, and a cold first call compiles the
candidate's Triton kernels: Triton's front end (the kernel's AST to its first IR) is Python, and its MLIR passes run
under the GIL too. On the H100 (e052280) that warm-up took 8-8.7 s on 4 threads, and inductor's compile of SmolLM2
ran 35-37 s beside the tuning against 26-28 s without it.

Here the same first calls run first in ``procs`` worker processes (``python -m attnopt.tuning_procs PAYLOAD``, the site and the plans in JSON), each on the
site's shape with the same input set, so Triton compiles each kernel exactly as the tuner's own first call would (same
source, specialisation, options and target) and writes it to its on-disk cache; the tuner's own first calls then find
the kernels there and only load them. The calling thread waits on the workers' pipes, which holds no GIL. The worker
processes make their own CUDA context on the same device and exit when done: nothing of theirs is left when the
model's first call runs.

Anything that goes wrong in a worker (no CUDA, a failed import, a kernel that does not compile) only costs the time:
the tuner's own first calls compile what is missing and report their own errors, as before.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

from .plan import Plan, plan_from_json
from .site import AttentionSite

#: Worker processes a background tuning compiles its candidates in (``$ATTNOPT_TUNE_COMPILE_PROCS``; 0: in-process
#: threads only, as before). Each costs an interpreter, torch's import and a CUDA context (2-4 s on the H100 host)
#: beside the compile, against about a second of Triton compile per candidate.
BACKGROUND_COMPILE_PROCS = 3
PROCS_ENV = "ATTNOPT_TUNE_COMPILE_PROCS"
#: Seconds the workers may take at most (then they are ended: the tuner's own first calls compile what is missing).
TIMEOUT_S = 120.0


def compile_procs(default: int = BACKGROUND_COMPILE_PROCS) -> int:
    """Worker processes for the warm-up's compiles: ``$ATTNOPT_TUNE_COMPILE_PROCS`` where set, else ``default``."""
    from .timer_calls import count_from_env

    return count_from_env(PROCS_ENV, default, "worker processes >= 0 (0: compile the tuner's candidates in this "
                                              "process)")


def split(plans: list[Plan], procs: int) -> list[list[Plan]]:
    """``plans`` dealt round-robin into at most ``procs`` non-empty groups (the candidates come ranked, so each
    worker gets some of the likeliest winners early)."""
    groups = [plans[i::procs] for i in range(max(1, min(procs, len(plans))))]
    return [g for g in groups if g]


def first_calls_in_processes(plans: list[Plan], site: AttentionSite, *, eager: bool = False, device: Any = None,
                             procs: int = BACKGROUND_COMPILE_PROCS, timeout_s: float = TIMEOUT_S) -> dict[str, Any]:
    """Make ``plans``' warm-up first calls in up to ``procs`` worker processes at once and wait for them.

    Returns ``{"procs": n, "procs_s": wall seconds, "errors": {runtime key: error text}}``: a plan's error is its
    first call's in the worker; a worker that failed as a whole gives each of its plans its error."""
    started = time.perf_counter()
    groups = split(list(plans), procs)
    workers = []
    for group in groups:
        payload = json.dumps({"site": site.to_dict(), "plans": [p.runtime_key() for p in group], "eager": eager,
                              "device": device})
        proc = subprocess.Popen([sys.executable, "-m", "attnopt.tuning_procs", payload], stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        workers.append((group, proc))
    errors: dict[str, str] = {}
    deadline = started + timeout_s
    for group, proc in workers:
        try:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.perf_counter()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            errors.update({p.runtime_key(): f"error: the compile worker took over {timeout_s:.0f} s" for p in group})
            continue
        got = _result(out)
        if proc.returncode != 0 or got is None:
            tail = (err or "").strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
            errors.update({p.runtime_key(): f"error: compile worker: {tail[0][:160]}" for p in group})
        else:
            errors.update({k: v for k, v in got.items() if v})
    return {"procs": len(groups), "procs_s": round(time.perf_counter() - started, 3), "errors": errors}


def _result(stdout: str) -> dict[str, str] | None:
    """The worker's answer: its last stdout line, a JSON object (None when there is none)."""
    for line in reversed((stdout or "").strip().splitlines()):
        try:
            got = json.loads(line)
        except ValueError:
            continue
        return got if isinstance(got, dict) else None
    return None


def run_first_calls(payload: dict[str, Any]) -> dict[str, str]:
    """In the worker: the warm-up's first call of each plan (``GpuTimer.warm_up``'s ``first_call``), on the site's
    input set; returns the error text of each, "" where it ran."""
    import torch
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from .timer import error_text, site_call, synthetic_inputs

    site = AttentionSite.from_dict(payload["site"])
    device_type = "cuda" if payload.get("device") is not None else "cpu"
    if device_type == "cuda":
        torch.cuda.set_device(int(payload["device"]))
    from attnopt.runtime.kernels.common import tma_as_captured

    with unset_fake_temporarily(), torch.no_grad():
        warm_set = synthetic_inputs(site, 0, device=device_type, reduce=False)
        errors = {}
        for key in payload["plans"]:
            try:
                plan = plan_from_json(key)
                with tma_as_captured():
                    site_call(plan, site, warm_set)()
                if payload.get("eager"):
                    site_call(plan, site, warm_set)()
                if device_type == "cuda":
                    torch.cuda.synchronize()
                errors[key] = ""
            except Exception as exc:  # noqa: BLE001 - reported; the tuner's own first call will say it again
                errors[key] = error_text(exc)
    return errors


def main() -> int:
    payload = json.loads(sys.argv[1])
    print(json.dumps(run_first_calls(payload)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
