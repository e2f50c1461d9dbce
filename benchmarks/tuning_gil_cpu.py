"""CPU measurement: how much a tuner's Triton compiles slow the Python of the inner compile beside them, on threads
of the same process (the warm-up before ``attnopt.tuning_procs``) against worker processes (with it).

    python benchmarks/tuning_gil_cpu.py [--kernels 8] [--procs 3] [--threads 4]

No GPU needed: Triton compiles for an sm_90 target (front end, MLIR passes, ptxas) on the CPU. The kernel is an
attention-like loop (two ``tl.dot`` per KV tile, an online softmax) in ``--kernels`` configurations (distinct
constexprs, so each compiles; every scenario gets an empty Triton cache). The "inner compile" is a fixed amount of
pure-Python work on the main thread (parsing and compiling Python source, as dynamo and inductor do much of).
Prints the main thread's work rate alone, beside compiles on ``--threads`` threads and beside compiles in ``--procs``
worker processes (each importing Triton and compiling its share), as a fraction of alone, and the compiles' wall
seconds. On a machine with fewer free cores than compiling threads and processes, CPU contention adds to both.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

KERNEL = '''
import triton
import triton.language as tl


@triton.jit
def attend(Q, K, V, O, N, BLOCK_N: tl.constexpr, D: tl.constexpr, SCALE: tl.constexpr):
    q = tl.load(Q + tl.arange(0, 16)[:, None] * D + tl.arange(0, D)[None, :])
    m = tl.full((16,), float("-inf"), tl.float32)
    l = tl.zeros((16,), tl.float32)
    acc = tl.zeros((16, D), tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        k = tl.load(K + cols[None, :] * D + tl.arange(0, D)[:, None], mask=cols[None, :] < N, other=0.0)
        s = tl.dot(q, k) * SCALE
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        v = tl.load(V + cols[:, None] * D + tl.arange(0, D)[None, :], mask=cols[:, None] < N, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        l = l * alpha + tl.sum(p, 1)
        m = m_new
    tl.store(O + tl.arange(0, 16)[:, None] * D + tl.arange(0, D)[None, :], (acc / l[:, None]).to(O.dtype.element_ty))
'''


def compile_configs(configs: list[tuple[int, int]]) -> None:
    """Compile ``attend`` for sm_90 at each (BLOCK_N, D) (in the calling process)."""
    import importlib.util

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    path = os.path.join(tempfile.mkdtemp(), "gil_kernel.py")
    with open(path, "w") as fh:
        fh.write(KERNEL)
    spec = importlib.util.spec_from_file_location("gil_kernel", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sig = {"Q": "*fp16", "K": "*fp16", "V": "*fp16", "O": "*fp16", "N": "i32", "BLOCK_N": "constexpr", "D": "constexpr",
           "SCALE": "constexpr"}
    for block_n, d in configs:
        src = ASTSource(fn=mod.attend, signature=sig, constexprs={"BLOCK_N": block_n, "D": d, "SCALE": 0.125})
        triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})


def python_work(until) -> float:
    """Units per second of pure-Python work (parse and compile a module's source) done until ``until()`` is true."""
    import inspect

    import argparse as big

    source = inspect.getsource(big)
    units, t0 = 0, time.perf_counter()
    while not until() or units < 3:
        compile(ast.parse(source), "<work>", "exec")
        units += 1
    return units / (time.perf_counter() - t0)


def configs(n: int) -> list[tuple[int, int]]:
    return [(16 << (i % 3), 64 if (i // 3) % 2 == 0 else 128) for i in range(n)][:n] if n <= 6 else \
        [(16 << (i % 3), (32, 64, 128, 256)[(i // 3) % 4]) for i in range(n)]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--kernels", type=int, default=8)
    p.add_argument("--procs", type=int, default=3)
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--alone-s", type=float, default=5.0, help="seconds of the work alone, for its rate")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        compile_configs([tuple(c) for c in json.loads(a.child)])
        return 0
    cfgs = configs(a.kernels)
    out: dict[str, float] = {}
    start = time.perf_counter()
    out["work_alone_per_s"] = python_work(lambda: time.perf_counter() - start > a.alone_s)

    def fresh_cache() -> dict[str, str]:
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="gil-triton-")
        return dict(os.environ)

    # compiles on threads of this process, beside the work
    fresh_cache()
    import triton  # noqa: F401  (imported before the clock, as in a process that has compiled already)

    groups = [cfgs[i::a.threads] for i in range(a.threads)]
    threads = [threading.Thread(target=compile_configs, args=(g,)) for g in groups if g]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    out["work_beside_threads_per_s"] = python_work(lambda: not any(t.is_alive() for t in threads))
    out["compiles_on_threads_wall_s"] = time.perf_counter() - t0
    # the same compiles in worker processes (each imports Triton: counted in their wall time)
    env = fresh_cache()
    groups = [cfgs[i::a.procs] for i in range(a.procs)]
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, __file__, "--child", json.dumps(g)], env=env) for g in groups if g]
    out["work_beside_procs_per_s"] = python_work(lambda: all(proc.poll() is not None for proc in procs))
    out["compiles_in_procs_wall_s"] = time.perf_counter() - t0
    out["work_rate_beside_threads"] = out["work_beside_threads_per_s"] / out["work_alone_per_s"]
    out["work_rate_beside_procs"] = out["work_beside_procs_per_s"] / out["work_alone_per_s"]
    print(json.dumps({k: round(v, 3) for k, v in out.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
