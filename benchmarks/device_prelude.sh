# Sourced by the GPU session scripts: NCCL with NVLink multicast off, a regular install of this tree run from
# /tmp (a source checkout in the working directory would shadow the package-dir mapping), REPO set, t0 started.
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
REPO=$PWD
python -m pip install -q --no-deps --no-build-isolation . 2>&1 | grep -v WARNING
cd /tmp && python -c "import attnopt.runtime, attnopt.passes" || exit 1
t0=$(date +%s)

# One pytest process per collected test id, JOBS at a time: Triton compiles each id's kernels on its own CPU core,
# where one process took over 240 s for the 29 CUDA kernel tests on 2xH200. Usage: parallel_pytest RC_FILE ARGS...
# writes "exit-code test-id" per line to RC_FILE and prints the count of each exit code and the first failure logs.
parallel_pytest() {
  local rc_file=$1; shift
  python -m pytest -q --collect-only -p no:cacheprovider "$@" 2>/dev/null | grep "::" | sed "s#^#$REPO/#" > /tmp/ids.txt
  echo "$(wc -l < /tmp/ids.txt) test ids"
  rm -rf /tmp/tlogs && mkdir -p /tmp/tlogs
  xargs -P "${JOBS:-14}" -I{} sh -c 'n=$(echo "{}" | md5sum | cut -c1-8); timeout 400 python -m pytest -q -p no:cacheprovider "{}" > /tmp/tlogs/$n.log 2>&1; echo "$? {}" >> /tmp/tlogs/rc.txt' < /tmp/ids.txt
  sort /tmp/tlogs/rc.txt | sed "s#$REPO/##" > "$rc_file"
  awk '{print $1}' "$rc_file" | sort | uniq -c
  grep -l "failed\|Error" /tmp/tlogs/*.log | head -3 | xargs -r tail -30
}

# The NCCL tests (2 GPUs): the HF test through optimize() and the attention interface (fp32 tokens, bf16 logits,
# replayed tree steps), then test_distributed.py's NCCL tests within 200 s, or until $1 seconds after t0 when given.
# Logs to $OUT.
nccl_tests() {
  timeout 150 python -m pytest -q -p no:cacheprovider -m multigpu -rs -s "$REPO/tests/runtime/test_distributed_hf.py" 2>&1 | grep -v "^W11\|Warn\|return func" | tail -8 | tee "$OUT/hf_tests.log"
  local limit=200
  [ -n "${1:-}" ] && limit=$(( $1 - ($(date +%s) - t0) ))
  timeout "$limit" python -m pytest -q -p no:cacheprovider -m "multigpu or cuda" -rs "$REPO/tests/runtime/test_distributed.py" 2>&1 | tail -4 | tee "$OUT/multigpu_tests.log"
}
