"""How much a thread pool gains when the tuner compiles its candidates' split-KV kernels for sm_90, on a machine
without a GPU (the compile-for-a-target path of ``tests/runtime/test_compile_sm90.py``).

Records, in the Triton interpreter, the split-KV launches of the measured choice's candidates at SmolLM2's 1k static
site (9/3 heads, D=64, 1088 keys, a valid-length mask; fp16, as bf16 does not run in the interpreter; pointer tiles,
as the interpreter never takes the TMA path), then compiles them for ``cuda:90`` in a subprocess without
``TRITON_INTERPRET``: one after another, then from a thread pool, each time into a fresh Triton cache.

    /work/venv-NAME/bin/python benchmarks/parallel_compile_cpu.py [--workers 2]

Prints one JSON line: serial and parallel wall seconds, CPU seconds in the process and in ptxas, the speed-up, the
CPU count and load, and a GIL probe (one compile on a thread while the main thread spins: how long it was blocked).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap

#: (block_n, num_warps, num_stages, num_splits) of the candidates the tuner times at SmolLM2's 1k static site.
FAMILIES = ((256, 8, 2, 5), (64, 4, 3, 17), (256, 4, 3, 5), (128, 4, 2, 9), (128, 8, 3, 9), (128, 4, 3, 8))

_COMPILE = textwrap.dedent("""
    import importlib, json, os, sys, tempfile, threading, time
    from concurrent.futures import ThreadPoolExecutor
    jobs, workers = json.load(sys.stdin), int(sys.argv[1])
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-warm-")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    target = GPUTarget("cuda", 90, 32)

    def build(job):
        fn = getattr(importlib.import_module(job["module"]), job["name"])
        triton.compile(ASTSource(fn=fn, signature=job["sig"], constexprs=job["consts"]), target=target,
                       options=job["options"])

    build({**jobs[0], "options": {"num_warps": 2, "num_stages": 1}})  # imports and the backend's first use, untimed
    out = {}
    for mode in ("serial", "parallel"):
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-" + mode + "-")
        triton.knobs.cache.dir = os.environ["TRITON_CACHE_DIR"]
        start, cpu, kids = time.perf_counter(), time.process_time(), os.times().children_user
        if mode == "serial":
            for job in jobs:
                build(job)
        else:
            with ThreadPoolExecutor(workers) as pool:
                list(pool.map(build, jobs))
        out[mode + "_s"] = round(time.perf_counter() - start, 3)
        # CPU seconds of this process's threads (over the wall time: above 1 only where compiles ran at once outside
        # the GIL) and of its children (ptxas)
        out[mode + "_cpu_s"] = round(time.process_time() - cpu, 3)
        out[mode + "_ptxas_cpu_s"] = round(os.times().children_user - kids, 3)
    # the GIL: one compile on a thread while this thread spins; a stretch of over 20 ms between two of its
    # iterations is time the compile (or the OS) kept it from running. A compile stage that held the GIL would show
    # as a stretch as long as that stage (LLVM's optimisation and code generation take 0.4 s each here)
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-gil-")
    triton.knobs.cache.dir = os.environ["TRITON_CACHE_DIR"]
    worker = threading.Thread(target=build, args=(max(jobs, key=lambda j: j["options"].get("num_stages", 0)),))
    start = prev = time.perf_counter()
    worker.start()
    gaps = []
    while worker.is_alive():
        now = time.perf_counter()
        gaps.append(now - prev)
        prev = now
    out.update(gil_probe_compile_s=round(prev - start, 3), gil_probe_blocked_s=round(sum(g for g in gaps if g > 0.02), 3),
               gil_probe_longest_block_s=round(max(gaps), 3))
    print(json.dumps(out))
""")


def record_jobs() -> list[dict]:
    """The distinct kernel launches of the candidates, recorded in the interpreter."""
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from triton.runtime.interpreter import InterpretedFunction

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "runtime"))
    from test_compile_sm90 import _OPTIONS, _signature

    from attnopt.runtime.kernels.split_kv import split_kv_decode, split_kv_workspace

    recorded: dict[tuple, dict] = {}
    original = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        launch = {k: v for k, v in kwargs.items() if k not in _OPTIONS + ("num_ctas", "launch_pdl", "maxnreg")}
        sig, consts = _signature(self, args, launch)
        key = (self.fn.__name__, json.dumps(sig, sort_keys=True), json.dumps(consts, sort_keys=True, default=str),
               json.dumps({k: kwargs[k] for k in _OPTIONS if k in kwargs}))
        recorded.setdefault(key, {"module": self.fn.__module__, "name": self.fn.__name__, "sig": sig, "consts": consts,
                                  "options": {k: kwargs[k] for k in _OPTIONS if k in kwargs}})
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run
    B, Hq, Hkv, L, N, D = 1, 9, 3, 1, 1088, 64
    q, k, v = (torch.randn(B, h, n, D, dtype=torch.float16) for h, n in ((Hq, L), (Hkv, N), (Hkv, N)))
    valid = torch.tensor([N], dtype=torch.int32)
    mask = torch.ones(B, 1, L, N, dtype=torch.bool)
    for block_n, warps, stages, splits in FAMILIES:
        out, lse = torch.empty(B, Hq, L, D, dtype=q.dtype), torch.empty(B, Hq, L)
        split_kv_decode(q, k, v, out, lse, workspace=split_kv_workspace(splits, q, k, v), attn_mask=mask,
                        valid_len=valid, num_splits=splits, block_n=block_n, num_warps=warps, num_stages=stages)
    InterpretedFunction.run = original
    return list(recorded.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    args = parser.parse_args()
    jobs = record_jobs()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE, str(args.workers)], input=json.dumps(jobs, default=str),
                          text=True, capture_output=True, env=env, timeout=1800)
    if proc.returncode:
        sys.exit(proc.stderr[-4000:])
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result.update(kernels=len(jobs), workers=args.workers, cpus=os.cpu_count(), load=os.getloadavg()[0],
                  speedup=round(result["serial_s"] / result["parallel_s"], 2))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
