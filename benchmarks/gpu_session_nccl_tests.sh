#!/usr/bin/env bash
# 2xH200: the NCCL tests only (the HF test through optimize() and the attention interface, fp32 tokens and bf16
# logits, replayed tree steps; and test_distributed.py's NCCL tests). Pass ATTNOPT_COMMIT=<sha>.
. "$PWD/benchmarks/device_prelude.sh"
nccl_tests
echo "commit ${ATTNOPT_COMMIT:-unknown}, total: $(( $(date +%s) - t0 )) s"
