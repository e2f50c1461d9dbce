#!/usr/bin/env bash
# 2xH200, issue 5: the replayed whole tree step. NCCL tests (whole-step graphs, per-rank captures, the replayed
# combine, stalled-peer timeout), the host cost of each piece (benchmarks/experiments/nccl_host.py), the tree/ring
# benchmark at P=2 (eager and graph columns), then distributed optimize() tokens against one device.
. "$PWD/benchmarks/device_prelude.sh"
timeout 200 python -m pytest -q -p no:cacheprovider -m "multigpu or cuda" -rs -x "$REPO/tests/runtime/test_distributed.py" 2>&1 | tail -15 | tee "$OUT/multigpu_tests.log"
echo "tests: $(( $(date +%s) - t0 )) s"
timeout 100 torchrun --standalone --nproc-per-node 2 "$REPO/benchmarks/experiments/nccl_host.py" 2>&1 | grep -E "^\{'all_gather|^local_|^tree_" | tee "$OUT/nccl_host.log"
echo "experiment: $(( $(date +%s) - t0 )) s"
cd "$REPO" && LENGTHS=${LENGTHS:-32k,128k} bash benchmarks/gpu_session_multigpu.sh 2 2>&1 | grep -v "^W11\|^\*\*\*\|OMP_NUM" | tail -14
echo "bench: $(( $(date +%s) - t0 )) s"
cd /tmp && timeout $(( 570 - ($(date +%s) - t0) )) torchrun --standalone --nproc-per-node 2 "$REPO/benchmarks/experiments/distributed_compile.py" 2>&1 | grep "^rank" | tee "$OUT/distributed_compile.log"
echo "total: $(( $(date +%s) - t0 )) s"
