#!/usr/bin/env bash
# The session's last device call, after `gpu_session_e2e_smollm2.sh stage`: the SAAP build timing (short quality
# run), then the whole CUDA test suite, a short SAAP speed run, and the variants bench if time is left.
# Usage on the GPU: ATTNOPT_COMMIT=<sha> bash benchmarks/call_final.sh  (carry .devcarry_b)
start=$(date +%s)
left() { echo $(( 585 - ($(date +%s) - start) )); }
ARGS_saap_quality="--clusters 2048rn:2 --methods centroids --train-sequences 4 --eval-sequences 4 --passkey-trials 0 --budget-s 120" \
  timeout 200 bash benchmarks/gpu_session_e2e_smollm2.sh saap-quality > "$OUT/quality.txt" 2>&1
tail -6 "$OUT/quality.txt"
TEST_TIMEOUT=240 timeout $(( $(left) - 90 )) bash benchmarks/gpu.sh tests > "$OUT/tests.txt" 2>&1
tail -4 "$OUT/tests.txt"
. benchmarks/gpu.sh > /dev/null
cd /tmp
if [ "$(left)" -gt 60 ]; then
  timeout $(( $(left) - 5 )) python -m attnopt.cli bench saap --out "$OUT/saap.json" --cases llama3-8b-128k,llama3-8b-512k \
    --targets 0.05 --saap-fuse select,none --saap-splits 0,66 --no-mlp > "$OUT/saap.log" 2>&1
  grep "need" "$OUT/saap.log" | tail -12
fi
if [ "$(left)" -gt 60 ]; then
  timeout $(( $(left) - 5 )) python -m attnopt.cli bench variants --out "$OUT/variants.json" > "$OUT/variants.log" 2>&1
  tail -12 "$OUT/variants.log"
fi
echo "elapsed $(( $(date +%s) - start ))s"
cd "$OUT" && tar czf all.tgz $(ls) && find . -mindepth 1 ! -name all.tgz -delete
