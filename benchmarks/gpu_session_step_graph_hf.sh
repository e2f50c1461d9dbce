#!/usr/bin/env bash
# 2xH200, issue 5: whole tree steps replayed inside Hugging Face generation on NCCL. The HF NCCL test (a tiny
# head_dim-64 Llama, fp32 tokens and bf16 logits against one device, through hf_sharded_attention and optimize with
# the tree forced), then distributed optimize() on a 30-layer SmolLM2-shaped Llama with the tree forced (tokens
# against one device, step graphs, time), then the whole multi-GPU test file again.
. "$PWD/benchmarks/device_prelude.sh"
timeout 300 python -m pytest -q -p no:cacheprovider -m "multigpu or cuda" -rs -s "$REPO/tests/runtime/test_distributed_hf.py" 2>&1 | grep -v "^W11\|Warn\|return func" | tail -12 | tee "$OUT/multigpu_hf_tests.log"
echo "hf tests: $(( $(date +%s) - t0 )) s"
timeout 200 torchrun --standalone --nproc-per-node 2 "$REPO/benchmarks/experiments/distributed_compile.py" --force-plan tree --new 16 2>&1 | grep "^rank" | tee "$OUT/distributed_compile.log"
echo "compile: $(( $(date +%s) - t0 )) s"
timeout $(( 580 - ($(date +%s) - t0) )) python -m pytest -q -p no:cacheprovider -m "multigpu or cuda" -rs "$REPO/tests/runtime/test_distributed.py" 2>&1 | tail -4 | tee "$OUT/multigpu_tests.log"
echo "total: $(( $(date +%s) - t0 )) s"
