# Kept for scripts written before benchmarks/gpu.sh (the lead's benchmarks/tmp probes): sourcing it installs the
# checkout and sets REPO, OUT and t0 as gpu.sh does (cwd /tmp), and defines parallel_pytest RC_FILE ARGS... and
# nccl_tests. New work: bash benchmarks/gpu.sh SUITE...
. "$(dirname "${BASH_SOURCE[0]}")/gpu.sh"
nccl_tests() { run_suite nccl-tests 2>&1 | tee "$OUT/nccl-tests.log"; }
