#!/usr/bin/env bash
# 2xH200: the NCCL tests only (the HF test through optimize() and the attention interface, fp32 tokens and bf16
# logits, replayed tree steps; and test_distributed.py's NCCL tests). Pass ATTNOPT_COMMIT=<sha>.
. "$PWD/benchmarks/device_prelude.sh"
timeout 150 python -m pytest -q -p no:cacheprovider -m multigpu -rs -s "$REPO/tests/runtime/test_distributed_hf.py" 2>&1 | grep -v "^W11\|Warn\|return func" | tail -8 | tee "$OUT/hf_tests.log"
timeout 200 python -m pytest -q -p no:cacheprovider -m "multigpu or cuda" -rs "$REPO/tests/runtime/test_distributed.py" 2>&1 | tail -4 | tee "$OUT/multigpu_tests.log"
echo "commit ${ATTNOPT_COMMIT:-unknown}, total: $(( $(date +%s) - t0 )) s"
