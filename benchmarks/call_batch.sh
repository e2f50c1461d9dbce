#!/usr/bin/env bash
# One device call serving several helpers' requests (tests, then suites), each section under its own timeout.
. "$(dirname "$0")/gpu.sh" > /dev/null
cd $REPO
TESTS="$BATCH_TESTS" TEST_TIMEOUT=200 SUITE_TIMEOUT=200 bash benchmarks/gpu.sh tests > $OUT/tests.log 2>&1; tail -3 $OUT/tests.log
echo "tests done $(( $(date +%s) - t0 )) s"
ARGS_saap="$SAAP_ARGS" SUITE_TIMEOUT=140 bash benchmarks/gpu.sh saap > $OUT/saap-run.log 2>&1
echo "saap done $(( $(date +%s) - t0 )) s"
(cd /tmp && timeout 100 python $REPO/benchmarks/static_mask.py --out $OUT/static-mask.json > $OUT/static-mask.log 2>&1)
echo "static-mask rc=$? $(( $(date +%s) - t0 )) s"
left=$(( 570 - ($(date +%s) - t0) ))
SKIP_TESTS=1 BENCH_BUDGET=$(( left - 50 )) CASES=$PLANNER_CASES timeout $left bash benchmarks/gpu_session_planner.sh > $OUT/planner.log 2>&1
echo "planner rc=$? $(( $(date +%s) - t0 )) s"
tail -5 $OUT/planner.log
cd $OUT && tar czf all.tgz $(ls) && find . -mindepth 1 ! -name all.tgz -delete 2>/dev/null
