"""``attnopt bench e2e --isolate`` and ``--parallel``: each (context, method) in a worker process of its own (a crash
is a row with its exit signal), up to N at a time, taking turns (``turns``) so that no timed section runs beside
anything another worker does."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from .turns import LOCK_ENV, WORKER_BOOT


def isolated(args, context: int, method: str) -> list[dict[str, Any]]:
    """``run_one`` in a subprocess: a crash (a signal, an exception) becomes a row that says so."""
    import tempfile

    with tempfile.NamedTemporaryFile("r", suffix=".json", delete=False) as fh:
        out = fh.name
    # the boot takes the shared turn before the worker imports anything (``turns``)
    cmd = [sys.executable, "-X", "faulthandler", "-c", WORKER_BOOT, "bench", "e2e", "--model", args.model,
           "--contexts", str(context), "--methods", method, "--dtype", args.dtype, "--cache", args.cache,
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--device", args.device,
           "--prefill-chunk", str(args.prefill_chunk), "--generate-tokens", str(args.generate_tokens),
           "--generate-repeats", str(args.generate_repeats), "--rows-out", out]
    cmd += ["--layers", str(args.layers)] if args.layers else []
    cmd += ["--generate"] if args.generate else []
    cmd += ["--profile"] if args.profile else []
    # an empty attnopt cache per run: its first call tunes as a new user's does (no measurements from another run)
    env = dict(os.environ, ATTNOPT_CACHE_DIR=tempfile.mkdtemp(prefix="attnopt-e2e-"))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
    except subprocess.TimeoutExpired as e:
        tail = (e.stderr or b"")[-3000:]
        return [{"method": method, "context": context, "cache": args.cache, "error": f"timeout after {args.timeout} s",
                 "stderr_tail": tail.decode(errors="replace") if isinstance(tail, bytes) else tail}]
    if proc.returncode == 0:
        return json.loads(Path(out).read_text())
    sig = -proc.returncode if proc.returncode < 0 else None
    return [{"method": method, "context": context, "cache": args.cache, "error":
             f"exit {proc.returncode}" + (f" (signal {sig})" if sig else ""),
             "stderr_tail": proc.stderr[-3000:]}]


def print_row(r: dict[str, Any]) -> None:
    print(json.dumps({k: v for k, v in r.items() if k not in ("tokens", "profile", "stderr_tail")}), flush=True)


def run_parallel(args, contexts: list[int], methods: list[str]) -> list[dict[str, Any]]:
    """Isolated runs, up to ``args.parallel`` at a time: they compile concurrently and time in turn (``turns``).

    The methods of one context run as a group that starts together, so HF's compile and attnopt's run beside the same
    load and their first-call times compare; a context's group starts when an earlier one ends."""
    import tempfile
    from concurrent.futures import ThreadPoolExecutor

    os.environ.setdefault(LOCK_ENV, tempfile.NamedTemporaryFile(suffix=".lock", delete=False).name)
    per_group = min(len(methods), args.parallel)
    groups = max(1, args.parallel // per_group)

    concurrent = per_group * min(groups, len(contexts))
    printing = threading.Lock()

    def one(context: int, method: str) -> list[dict[str, Any]]:
        got = isolated(args, context, method)
        with printing:  # each row as its worker ends (a suite stopped by a timeout still shows the finished ones)
            for r in got:
                r["concurrent_compiles"] = concurrent
                print_row(r)
        return got

    def group(context: int) -> list[list[dict[str, Any]]]:
        with ThreadPoolExecutor(per_group) as inner:
            return list(inner.map(lambda method: one(context, method), methods))

    with ThreadPoolExecutor(groups) as pool:
        return [r for ran in pool.map(group, contexts) for got in ran for r in got]
