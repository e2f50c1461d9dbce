#!/usr/bin/env bash
# One H100 call: host-time profile of a decode call, MHA tile sweep, then the GPU kernel tests (longest last).
set -o pipefail
export PYTHONUNBUFFERED=1
REPO=$PWD
python -m pip install -q --no-deps --no-build-isolation . 2>&1 | grep -v WARNING
cd /tmp && python -c "import attnopt.runtime, attnopt.passes" || exit 1
t0=$(date +%s)
timeout 200 python "$REPO/benchmarks/experiments/host_profile.py" 2>&1 | grep -v Warning | tee "$OUT/host_profile.log"
echo "profile: $(( $(date +%s) - t0 )) s"
timeout ${TEST_TIMEOUT:-300} python -m pytest -q -x -p no:cacheprovider -rs "$REPO/tests/runtime/test_kernels.py" -k "cuda" --durations=8 2>&1 | tail -25 | tee "$OUT/gpu_tests.log"
echo "total: $(( $(date +%s) - t0 )) s"
