#!/usr/bin/env bash
# One H100 call for issue 4: calibrate the cost model, validate the planner's choices over the kernel bench grid
# plus 20 random shapes (calibrated and datasheet profiles), and draw `explain --plot --measure`.
set -o pipefail
export PYTHONUNBUFFERED=1
REPO=$PWD
python -m pip install -q --no-deps --no-build-isolation . 2>&1 | grep -v WARNING
cd /tmp && python -c "import attnopt.runtime, attnopt.passes" || exit 1
export ATTNOPT_COMMIT=${ATTNOPT_COMMIT:-unknown} ATTNOPT_CACHE_DIR=/tmp/attnopt-cache
t0=$(date +%s)
timeout 430 attnopt calibrate --validate --budget ${VALIDATE_BUDGET:-270} --out "$OUT/cost_model.json" --quiet 2>&1 \
  | grep -v "Warning" | tail -40 | tee "$OUT/calibrate.log"
echo "calibrate+validate: $(( $(date +%s) - t0 )) s"
timeout 120 attnopt explain --batch 1 --heads 32/8 --head-dim 128 --context 131072 --plot "$OUT/explain-32-8-d128-128k.png" \
  --measure 2>&1 | grep -v Warning | tail -40 | tee "$OUT/explain.log"
