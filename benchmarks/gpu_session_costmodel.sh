#!/usr/bin/env bash
# H100 calls for issue 4. STEP=calibrate: fit the cost model (anchors + random calibration shapes), keep the
# calibration measurements, and draw `explain --plot --measure`. STEP=validate: score the planner's choices with
# the cached calibrated profile (and the datasheet one) over the kernel bench grid plus 20 random shapes.
# The profile cache lives in the checkout (.attnopt-cache, git-ignored) so a warm machine keeps it between calls;
# STEP=calibrate also copies it to $OUT, to be carried back if the machine went cold.
set -o pipefail
export PYTHONUNBUFFERED=1
REPO=$PWD
python -m pip install -q --no-deps --no-build-isolation . 2>&1 | grep -v WARNING
export ATTNOPT_COMMIT=${ATTNOPT_COMMIT:-unknown} ATTNOPT_CACHE_DIR=$REPO/.attnopt-cache
cd /tmp && python -c "import attnopt.runtime, attnopt.passes" || exit 1
t0=$(date +%s)
case "${STEP:-calibrate}" in
  calibrate)
    timeout 560 attnopt calibrate --calibrate-budget ${CAL_BUDGET:-330} --samples-out "$OUT/calibration-samples.json" --quiet 2>&1 | grep -v Warning \
      | grep -v '^ *"' | tail -20 | tee "$OUT/calibrate.log"
    cp -r "$ATTNOPT_CACHE_DIR/profiles" "$OUT/" 2>/dev/null
    echo "calibrate: $(( $(date +%s) - t0 )) s"
    timeout 150 attnopt explain --batch 1 --heads 32/8 --head-dim 128 --context 131072 \
      --plot "$OUT/explain-32-8-d128-128k.png" --measure 2>&1 | grep -v Warning | tail -40 | tee "$OUT/explain.log"
    ;;
  validate)
    timeout 560 attnopt calibrate --validate --use-cached --budget ${VALIDATE_BUDGET:-400} --out "$OUT/cost_model.json" \
      --quiet 2>&1 | grep -v Warning | tail -30 | tee "$OUT/validate.log"
    ;;
esac
echo "total: $(( $(date +%s) - t0 )) s"
