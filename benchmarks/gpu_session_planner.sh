#!/usr/bin/env bash
# H100, one call for issue 19: the CUDA test of the measured choice (the real GPU timer, the tuner's choice and its
# cache), then `attnopt bench planner`: the planner's pick through optimize() (datasheet profile, tuning on, a fresh
# tuning cache, so first-call times include tuning) against SDPA flash and cuDNN, CUDA-graph timing with L2 rotated,
# on the issue's shapes and a sampled grid. JSON to $OUT. Pass ATTNOPT_COMMIT=<sha>.
. "$PWD/benchmarks/device_prelude.sh"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout 120 python -m pytest -q -p no:cacheprovider -m cuda -rs "$REPO/tests/attnopt/test_tuning.py" 2>&1 | tail -4 | tee "$OUT/tuning_tests.log"
fi
t1=$(date +%s)
timeout $(( ${BENCH_LIMIT:-330} )) attnopt bench planner --time-budget ${BENCH_BUDGET:-230} --grid ${GRID:-28} \
  --commit "${ATTNOPT_COMMIT:-unknown}" --out "$OUT/planner.json" 2>&1 | grep -v "Warning\|return F.scaled" > "$OUT/bench.log"
echo "bench: $(( $(date +%s) - t1 )) s"
python - "$OUT/planner.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(f"{d['device']} read {d['read_bw_TBps']} TB/s, profile {d['profile']}, commit {d['commit'][:8]}")
print(f"{'case':44s} {'peer':10s} {'peer us':>8s} {'ours us':>8s} {'ratio':>6s} {'roof':>5s} {'first s':>7s} choice plan")
for s in d["summary"]:
    print(f"{s['case'][:44]:44s} {str(s.get('best_peer'))[:10]:10s} {s.get('best_peer_us') or 0:8.1f} "
          f"{s.get('attnopt_us') or 0:8.1f} {s.get('ratio_to_best_peer') or 0:6.3f} {s.get('frac_of_roofline') or 0:5.2f} "
          f"{s.get('compile_s') or 0:7.1f} {s.get('choice')} {str(s.get('plan'))[:70]} {s.get('error') or ''}")
print("overall", d.get("overall"), "skipped", len(d.get("skipped_cases", [])))
PY
