#!/usr/bin/env bash
# First of two back-to-back GPU calls: compiled kernel tests + `attnopt bench kernels`; stashes GGUF part 1.
set -o pipefail
export PYTHONUNBUFFERED=1
cp .smol/partaa /tmp/partaa 2>/dev/null || echo "no .smol/partaa carried"
pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING
commit=${ATTNOPT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
timeout 420 python benchmarks/gpu_kernels_check.py --out-dir "$OUT" -- --timing both --commit "$commit" 2>&1 \
  | grep -v "Warning\|return F.scaled" | tee "$OUT/session_a.log"
