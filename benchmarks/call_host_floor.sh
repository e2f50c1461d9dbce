#!/usr/bin/env bash
# One device call: the host-floor experiment (benchmarks/host_floor.py, six modes side by side, timed sections in
# turns), the short-static-prompt crash under a few inductor settings (benchmarks/repro_short_static.py), then the
# CUDA tests named in $TESTS. Usage on the GPU: ATTNOPT_COMMIT=<sha> bash benchmarks/call_host_floor.sh
. "$(dirname "$0")/gpu.sh"
export ATTNOPT_BENCH_GPU_LOCK=/tmp/gpu.lock TORCHINDUCTOR_COMPILE_THREADS=2
mkdir -p $OUT/floor $OUT/repro
for m in ${MODES:-hf ro hf-freeze ro-freeze graph hf-graph}; do
  (timeout 300 python $REPO/benchmarks/host_floor.py $m ${CTX:-1024} $OUT/floor/$m.json > $OUT/floor/$m.log 2>&1; echo "$m rc=$?" >> $OUT/floor/rc.txt) &
done
repro() {  # NAME ENV... -- ARGS
  local name=$1; shift
  (env "$@" timeout 240 python -X faulthandler $REPO/benchmarks/repro_short_static.py bfloat16 7 32 ${WHO:-hf} > $OUT/repro/$name.log 2>&1; echo "$name rc=$?" >> $OUT/repro/rc.txt) &
}
repro default A=1
repro nopartition TORCHINDUCTOR_GRAPH_PARTITION=0
repro nostatic TORCHINDUCTOR_USE_STATIC_CUDA_LAUNCHER=0
WHO=attnopt repro attnopt-nopartition TORCHINDUCTOR_GRAPH_PARTITION=0
wait
cat $OUT/floor/rc.txt $OUT/repro/rc.txt
for f in $OUT/floor/*.log; do tail -1 $f; done
for f in $OUT/repro/*.log; do echo "== $f"; grep -v Warning $f | tail -4; done
[ -n "${TESTS:-}" ] && TEST_TIMEOUT=${TEST_TIMEOUT:-300} run_suite tests 2>&1 | tail -15
cd $OUT && tar czf all.tgz $(ls) && find . -mindepth 1 ! -name all.tgz -delete 2>/dev/null; ls $OUT
