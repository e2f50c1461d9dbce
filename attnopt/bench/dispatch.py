"""``attnopt bench dispatch``: the host cost of one ``torch.ops.attnopt.decode_attention`` call.

It times, on tiny inputs (so the kernel itself is negligible), a direct SDPA call against the attnopt op
running the dense plan (which makes that same SDPA call), in one process. The difference is what the op adds:
the dispatcher entry, the plan lookup, the prepared-state lookup and the call counter.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from attnopt.checks import int_at_least

from .common import format_table, host_us, results_header, write_results


def _host_us(fn: Callable[[], object], calls: int, repeats: int, sync: Callable[[], None]) -> float:
    """Wall time per call up to a sync (``host_us`` with the sync in the window), after a long warm-up."""
    return host_us(fn, calls, repeats=repeats, warmup=max(50, calls // 10), sync=sync, sync_in_timing=True)


def measure(device: str, calls: int = 2000, repeats: int = 7) -> dict:
    import attnopt.runtime.ops  # noqa: F401  (registers torch.ops.attnopt)
    from attnopt.plan import DensePlan

    q = torch.randn(1, 8, 1, 64, device=device)
    k = torch.randn(1, 8, 32, 64, device=device)
    v = torch.randn(1, 8, 32, 64, device=device)
    plan = DensePlan().runtime_key()
    op = torch.ops.attnopt.decode_attention.default
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    with torch.inference_mode():
        sdpa = _host_us(lambda: F.scaled_dot_product_attention(q, k, v, scale=0.125), calls, repeats, sync)
        ours = _host_us(lambda: op(q, k, v, None, None, 0.125, False, plan, "bench:dispatch"), calls, repeats, sync)
    return {"case": "dispatch", "device_kind": device, "sdpa_us": sdpa, "attnopt_op_us": ours,
            "overhead_us": ours - sdpa}


def register(suites) -> None:
    p = suites.add_parser("dispatch", help="host cost of one attnopt op call against a direct SDPA call")
    p.add_argument("--out", help="write the results JSON here")
    p.add_argument("--calls", type=int_at_least(1), default=2000, help="timed calls per repeat (default 2000)")
    p.set_defaults(func=run)


def run(args) -> int:
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    results = results_header("dispatch")
    results["rows"] = [measure(d, calls=args.calls) for d in devices]
    if args.out:
        write_results(args.out, results)
    print(format_table(results["rows"], [("device_kind", "device", ""), ("sdpa_us", "SDPA µs", ".1f"),
                                         ("attnopt_op_us", "attnopt op µs", ".1f"), ("overhead_us", "overhead µs", ".1f")]))
    return 0
