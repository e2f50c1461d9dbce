#!/usr/bin/env bash
# One device call: where a generate() token's time goes at CONTEXT (HF compiled vs attnopt-ro, profiler timeline
# and traces), then the CUDA test suite in the time left. Usage on the GPU: ATTNOPT_COMMIT=<sha> bash benchmarks/call_timeline.sh
. "$(dirname "$0")/gpu.sh" > /dev/null
cd /tmp
timeout ${TIMELINE_TIMEOUT:-220} python $REPO/benchmarks/generate_timeline.py --context ${CONTEXT:-1024} --tokens 40 \
  --out $OUT/timeline.json --traces $OUT/traces > $OUT/timeline.log 2>&1
echo "timeline rc=$? $(( $(date +%s) - t0 )) s"; grep '^{' $OUT/timeline.log
cd $REPO
left=$(( 575 - ($(date +%s) - t0) ))
TEST_TIMEOUT=300 SUITE_TIMEOUT=$left bash benchmarks/gpu.sh tests > $OUT/tests.log 2>&1; tail -4 $OUT/tests.log
echo "elapsed $(( $(date +%s) - t0 )) s"
cd $OUT && tar czf all.tgz $(ls) && find . -mindepth 1 ! -name all.tgz -delete 2>/dev/null
