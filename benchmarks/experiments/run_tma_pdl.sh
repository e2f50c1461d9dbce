#!/usr/bin/env bash
# One H100 call: GPU kernel tests (TMA, PDL, fused merge, graph replay), then the TMA/PDL/stages sweep.
set -o pipefail
export PYTHONUNBUFFERED=1
REPO=$PWD
python -m pip install -q --no-deps --no-build-isolation . 2>&1 | grep -v WARNING
cd /tmp && python -c "import attnopt.runtime, attnopt.passes" || exit 1
export ATTNOPT_COMMIT=${ATTNOPT_COMMIT:-unknown}
t0=$(date +%s)
timeout 200 python -m pytest -q -x -p no:cacheprovider "$REPO/tests/runtime/test_kernels.py" -k "cuda" 2>&1 | tail -15 | tee "$OUT/gpu_tests.log"
echo "tests: $(( $(date +%s) - t0 )) s"
timeout 330 python "$REPO/benchmarks/experiments/tma_pdl_sweep.py" ${SWEEP_ARGS:-} 2>&1 | grep -v Warning | tee "$OUT/sweep.log" | tail -150
echo "total: $(( $(date +%s) - t0 )) s"
