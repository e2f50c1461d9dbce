#!/usr/bin/env bash
# Multi-GPU session, second call right after the first (carries .smol/partab and .whl): SmolLM2 generation with
# the cache sharded over 2 and 4 ranks (NCCL) against one device, through attnopt.optimize(process_group=...)
# and the explicit tree plan; fp32 tokens must be identical, bf16 logits within tolerance.
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# A regular install, run from /tmp: a source checkout in the working directory would shadow the package-dir
# mapping (attnopt.runtime / attnopt.passes live in runtime/ and passes/).
REPO=$PWD
python -m pip install -q --no-deps --no-build-isolation . 2>&1 | grep -v WARNING
cd /tmp && python -c "import attnopt.runtime, attnopt.passes; print('attnopt from', attnopt.__file__)" || exit 1
python3 -m pip install -q --no-index --no-deps --target /tmp/site "$REPO"/.whl/*.whl && export PYTHONPATH=/tmp/site
mkdir -p /tmp/smol && cat /tmp/partaa "$REPO/.smol/partab" > /tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf || exit 1
export ATTNOPT_SMOLLM2_GGUF=/tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf ATTNOPT_CACHE_DIR=/tmp/attnopt-cache
gpus=$(nvidia-smi -L | wc -l)
run() {  # P dtype plan
  [ "$1" -le "$gpus" ] || { echo "skip P=$1"; return; }
  echo "=== P=$1 $2 $3"
  timeout 240 torchrun --standalone --nproc-per-node "$1" "$REPO/examples/distributed_generate.py" --dtype "$2" --plan "$3" \
    --max-new-tokens 24 2>&1 | grep -v "Warning\|warn\|^W11\|^\[rank\|Loading weights" | tee -a "$OUT/generate.log" | tail -9
  echo "rc=$?"
}
run 2 float32 auto
run 2 float32 tree:all_gather
run 2 bfloat16 auto
run 4 float32 auto
run 4 bfloat16 tree:all_reduce
