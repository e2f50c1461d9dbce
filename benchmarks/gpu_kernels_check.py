"""One GPU call for issue 3: the compiled kernel tests, then ``attnopt bench kernels``, summary printed last.

Run from the repository root on a CUDA machine::

    PYTHONUNBUFFERED=1 python benchmarks/gpu_kernels_check.py --out-dir "$OUT" [-- <bench kernels options>]

1. Makes sure ``attnopt`` imports (``pip install --no-deps --no-build-isolation -e .`` when it does not).
2. Runs the CUDA-marked kernel tests compiled (fp16/bf16/fp32 vs the float64 reference on odd shapes, CUDA-graph
   capture and replay with a growing valid length), in parallel processes when pytest-xdist is there.
3. Runs the benchmark, writing ``<out-dir>/kernels.json`` (and a copy of its log).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import time


def sh(cmd: list[str], timeout: float | None = None) -> int:
    print("+", " ".join(cmd), flush=True)
    t = time.time()
    try:
        rc = subprocess.run(cmd, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        rc = 124
    print(f"  -> rc {rc} in {time.time() - t:.0f}s", flush=True)
    return rc


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", default=os.environ.get("OUT", "."), help="where the JSON goes (default $OUT)")
    p.add_argument("--skip-tests", action="store_true")
    p.add_argument("--skip-bench", action="store_true")
    p.add_argument("--test-timeout", type=float, default=150)
    p.add_argument("bench_args", nargs="*", help="options passed to `attnopt bench kernels` (after --)")
    args = p.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    env_ok = True
    try:
        import attnopt.runtime.strategies  # noqa: F401
    except ImportError:
        env_ok = sh([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e", "."]) == 0
    if not env_ok:
        print("could not install attnopt", flush=True)
        return 1
    import torch
    import triton

    print(f"torch {torch.__version__}, triton {triton.__version__}, device "
          f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}", flush=True)
    rc_tests = 0
    if not args.skip_tests:
        cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", "-rfEs",
               "tests/runtime/test_kernels.py", "tests/runtime/test_kernel_strategies.py"]
        if importlib.util.find_spec("xdist") is not None:
            cmd += ["-n", "6"]
        rc_tests = sh(cmd, timeout=args.test_timeout)
    rc_bench = 0
    if not args.skip_bench:
        rc_bench = sh([sys.executable, "-m", "attnopt.bench.kernels", "--out",
                       os.path.join(args.out_dir, "kernels.json")] + list(args.bench_args))
    print(f"\ntests rc {rc_tests}, bench rc {rc_bench}", flush=True)
    return rc_tests or rc_bench


if __name__ == "__main__":
    sys.exit(main())
