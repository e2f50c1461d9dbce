#!/usr/bin/env bash
# H100, one call for issue 3: the CUDA kernel tests compiled (bf16 included, the direct launcher's exactness test
# among them; one pytest process per test id in parallel), the eager host-time profile of one split-KV call, then
# `attnopt bench kernels` in graph and eager timing. JSON to $OUT. Pass ATTNOPT_COMMIT=<sha>.
. "$PWD/benchmarks/device_prelude.sh"
if [ "${SKIP_TESTS:-0}" != 1 ]; then  # SKIP_TESTS=1: the kernels are unchanged since a run whose tests passed
  parallel_pytest "$OUT/gpu_tests_rc.txt" "$REPO/tests/runtime/test_kernels.py" "$REPO/tests/runtime/test_kernel_strategies.py" -m cuda
  echo "tests: $(( $(date +%s) - t0 )) s"
fi
# EXPERIMENT=path/to/script.py runs that experiment (in $REPO/benchmarks/experiments) instead of the host profile
if [ "${EXPERIMENT:-}" = none ]; then
  :
elif [ -n "${EXPERIMENT:-}" ]; then
  timeout 150 python "$REPO/benchmarks/experiments/$EXPERIMENT" 2>&1 | grep -v "Warning\|return F.scaled" | tail -40
else
  python "$REPO/benchmarks/experiments/launch_overhead.py" > "$OUT/launch_overhead.log" 2>&1; tail -22 "$OUT/launch_overhead.log"
fi
t1=$(date +%s)
timeout $(( ${BENCH_LIMIT:-300} )) attnopt bench kernels --timing both --time-budget ${BENCH_BUDGET:-220} \
  --commit "${ATTNOPT_COMMIT:-unknown}" --out "$OUT/kernels.json" 2>&1 | grep -v "Warning\|return F.scaled" > "$OUT/bench.log"
echo "bench: $(( $(date +%s) - t1 )) s"
python - "$OUT/kernels.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(f"{d['device']} copy {d['copy_bw_TBps']} TB/s read {d['read_bw_TBps']} TB/s")
print(f"{'case':18s} {'peer':11s} {'peer us':>8s} {'ours us':>8s} {'ratio':>6s} {'roof':>5s} {'plan us':>8s} | {'peer eag':>8s} {'ours eag':>8s} {'ratio':>6s}")
for s in d["summary"]:
    r = (s.get("best_peer_us") or 0) / (s.get("best_attnopt_us") or 1)
    print(f"{s['case'][:18]:18s} {str(s.get('best_peer'))[:11]:11s} {s.get('best_peer_us') or 0:8.1f} {s.get('best_attnopt_us') or 0:8.1f} "
          f"{r:6.3f} {s['floor_us'] / (s.get('best_attnopt_us') or 1):5.2f} {s.get('planner_us') or 0:8.1f} | {s.get('best_peer_us_eager') or 0:8.1f} "
          f"{s.get('best_attnopt_us_eager') or 0:8.1f} {s.get('speedup_best_eager') or 0:6.3f}")
PY
