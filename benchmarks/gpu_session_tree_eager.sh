#!/usr/bin/env bash
# 2xH200, issue 5: multi-GPU tests on NCCL (replayed tree combine and whole step, stalled-peer timeout), the host cost of each
# step of tree_decode and each rank's host and synced wall time (benchmarks/experiments/nccl_host.py), the compile
# time of a distributed optimize() on a 30-layer SmolLM2-shaped Llama (distributed_compile.py), then the tree/ring
# benchmark at P=2 with the eager overhead column.
. "$PWD/benchmarks/device_prelude.sh"
timeout 420 python -m pytest -q -p no:cacheprovider -m "multigpu or cuda" -rs "$REPO/tests/runtime/test_distributed.py" "$REPO/tests/runtime/test_distributed_hf.py" 2>&1 | tail -15 | tee "$OUT/multigpu_tests.log"
echo "tests: $(( $(date +%s) - t0 )) s"
timeout 180 torchrun --standalone --nproc-per-node 2 "$REPO/benchmarks/experiments/nccl_host.py" 2>&1 | grep -E "^\{'all_gather|^local_|^tree_" | tee "$OUT/nccl_host.log"
timeout 240 torchrun --standalone --nproc-per-node 2 "$REPO/benchmarks/experiments/distributed_compile.py" 2>&1 | grep "^rank" | tee "$OUT/distributed_compile.log"
echo "experiments: $(( $(date +%s) - t0 )) s"
cd "$REPO" && LENGTHS=${LENGTHS:-32k,128k,512k} bash benchmarks/gpu_session_multigpu.sh 2 2>&1 | grep -v "^W1122\|^\*\*\*\|OMP_NUM" | tail -14
