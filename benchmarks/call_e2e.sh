#!/usr/bin/env bash
# One device call: issue 16's end-to-end runs through the public API, HF's compiled path beside attnopt's documented
# fast path (mode="reduce-overhead"): SmolLM2's shape at 1k/8k/32k (step, generate(), profiles, first call), then
# llama3-8b-shaped layers at 32k/128k; and, where STAGE=1, the first part of the SmolLM2 GGUF for a following
# `gpu_session_e2e_smollm2.sh run` call (carry .devcarry_a); then the step graphs' CUDA tests in the time left.
# Usage on the GPU: ATTNOPT_COMMIT=<sha> bash benchmarks/call_e2e.sh
[ "${STAGE:-0}" = 1 ] && bash "$(dirname "$0")/gpu_session_e2e_smollm2.sh" stage > /dev/null
. "$(dirname "$0")/gpu.sh"
export ATTNOPT_BENCH_GPU_LOCK=/tmp/gpu.lock TORCHINDUCTOR_COMPILE_THREADS=4
cd /tmp
timeout ${SMOL_TIMEOUT:-320} python -m attnopt.cli bench e2e --out $OUT/e2e-smol.json --isolate --parallel 6 \
  --model smollm2-135m --contexts ${SMOL_CONTEXTS:-1k,8k,32k} --methods hf-compiled,attnopt-ro --generate --profile \
  --steps 30 --warmup 4 > $OUT/e2e-smol.log 2>&1
echo "smol rc=$? $(( $(date +%s) - t0 )) s (commit $ATTNOPT_COMMIT)"
timeout ${LLAMA_TIMEOUT:-150} python -m attnopt.cli bench e2e --out $OUT/e2e-llama.json --isolate --parallel 4 \
  --model llama3-8b --layers 4 --contexts 32k,128k --methods hf-compiled,attnopt-ro --profile --steps 20 \
  > $OUT/e2e-llama.log 2>&1
echo "llama rc=$? $(( $(date +%s) - t0 )) s"
# the step graphs' CUDA tests in the time left (RUN_TESTS=0 skips them)
left=$(( ${CALL_S:-560} - 5 - ($(date +%s) - t0) ))
if [ "${RUN_TESTS:-1}" = 1 ] && [ $left -gt 60 ]; then
  (cd $REPO && TESTS="tests/models/test_cuda_graphs.py tests/attnopt/test_tuning_procs.py tests/attnopt/test_timer_proc.py tests/attnopt/test_tuning_defer.py
   tests/attnopt/test_tuning_cost.py::test_the_gpu_timer_times_a_low_fill_in_the_measured_cache" \
   TEST_TIMEOUT=$left SUITE_TIMEOUT=$left bash benchmarks/gpu.sh tests \
    > $OUT/tests.log 2>&1; tail -3 $OUT/tests.log)
fi
echo "elapsed $(( $(date +%s) - t0 )) s"
grep -v "Warning\|warn" $OUT/e2e-smol.log | tail -8
grep -v "Warning\|warn" $OUT/e2e-llama.log | tail -5
cd $OUT && tar czf all.tgz $(ls) && find . -mindepth 1 ! -name all.tgz -delete 2>/dev/null; ls $OUT
