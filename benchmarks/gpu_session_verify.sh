#!/usr/bin/env bash
# 2xH200 (Hopper, the TMA path): verify a tree built this session on a GPU before relying on it. The CUDA kernel
# tests (the tile that crosses the valid length is read by pointer loads after the TMA loop, 2459f11), the tree's
# local split-KV in graph mode (compare with the local:split_kv graph rows of multigpu-2xh200-stepgraph-0c072be.json:
# 23.03 / 67.40 / 37.37 / 125.44 us), the HF NCCL test (fp32 tokens, bf16 logits up to the first flip, replayed
# steps), and the NCCL tests of test_distributed.py. Pass ATTNOPT_COMMIT=<sha>: the device copy's git HEAD is stale.
. "$PWD/benchmarks/device_prelude.sh"
parallel_pytest "$OUT/kernel_tests_rc.txt" "$REPO/tests/runtime/test_kernels.py" "$REPO/tests/runtime/test_kernel_strategies.py" -m cuda
echo "kernel tests: $(( $(date +%s) - t0 )) s"
timeout 60 python "$REPO/benchmarks/experiments/local_split_kv_graph.py" 2>&1 | tail -4
nccl_tests 580
echo "total: $(( $(date +%s) - t0 )) s"
