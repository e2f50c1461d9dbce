#!/usr/bin/env bash
# Second GPU call, right after the first (the machine stays warm ~30 s): the real model end to end, the
# cost-model calibration and validation, the dispatch cost.
set -o pipefail
export PYTHONUNBUFFERED=1
pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
mkdir -p /tmp/smol && cat /tmp/partaa .smol/partab > /tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf
sha256sum /tmp/smol/*.gguf
export ATTNOPT_COMMIT=${ATTNOPT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
export ATTNOPT_CACHE_DIR=/tmp/attnopt-cache
timeout 60 attnopt bench dispatch --out "$OUT/dispatch.json" 2>&1 | tee "$OUT/dispatch.log"
timeout 240 attnopt calibrate --validate --out "$OUT/cost_model.json" --quiet 2>&1 | tail -40 | tee "$OUT/calibrate.log"
G=/tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf
timeout 150 python benchmarks/gpu_e2e_smollm2.py --gguf $G --out "$OUT/e2e_fp32.json" --dtypes float32 \
  --plans auto,split_kv,stream_k 2>&1 | grep -v Warning | tail -12 | tee "$OUT/e2e_fp32.log"
timeout 120 python benchmarks/gpu_e2e_smollm2.py --gguf $G --out "$OUT/e2e_bf16.json" --dtypes bfloat16 \
  --plans auto,split_kv 2>&1 | grep -v Warning | tail -10 | tee "$OUT/e2e_bf16.log"
