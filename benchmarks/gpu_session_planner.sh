#!/usr/bin/env bash
# H100, one device call for issue 19 (about 9 minutes): the CUDA tests of the measured choice (the real GPU timer
# against the kernels bench's timing, the tuner's choice at SmolLM2's 1k static-cache site, its cache), then
# `attnopt bench planner`: the planner's pick through optimize() (datasheet profile, tuning on, a fresh tuning
# cache, so first-call times include tuning) and the cost model's pick alone, against SDPA flash / cuDNN /
# efficient and HF's compiled static-cache path, CUDA-graph timing, L2 rotated, on the shapes, corners, a
# 40-shape Latin-hypercube sample and 4 off-grid shapes. JSON to $OUT/planner.json. Pass ATTNOPT_COMMIT=<sha>.
#   bash benchmarks/gpu_session_planner.sh          (SKIP_TESTS=1 skips the tests; BENCH_BUDGET seconds of cases;
#                                                    PART=I/K runs every K-th case: K calls cover them all, then
#                                                    attnopt bench planner --merge p0.json p1.json --out all.json;
#                                                    CASES=a,b runs only those named cases, e.g. the e2e-* ones)
. "$PWD/benchmarks/device_prelude.sh"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout 150 python -m pytest -q -p no:cacheprovider -m cuda -rs "$REPO/tests/attnopt/test_tuning.py" \
    "$REPO/tests/attnopt/test_tuning_method.py" "$REPO/tests/attnopt/test_tuning_cost.py" 2>&1 | tail -6 | tee "$OUT/tuning_tests.log"
fi
t1=$(date +%s)
left=$(( 560 - (t1 - t0) ))
timeout $(( left > 60 ? left : 60 )) python -m attnopt.cli bench planner --time-budget ${BENCH_BUDGET:-$(( left - 90 ))} \
  ${PART:+--part $PART} ${CASES:+--cases $CASES --grid 0 --off-grid 0} --commit "${ATTNOPT_COMMIT:-unknown}" --out "$OUT/planner.json" 2>&1 \
  | grep -v "Warning\|return F.scaled" > "$OUT/bench.log"
echo "bench: $(( $(date +%s) - t1 )) s"
sed -n "/^summary (ratio/,\$p" "$OUT/bench.log"
