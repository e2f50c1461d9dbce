#!/usr/bin/env bash
# H100: Nsight Compute counters of the targets in ncu_targets.py (run from the repository root on the device).
. "$PWD/benchmarks/device_prelude.sh"
X="$REPO/benchmarks/experiments/ncu_targets.py"
which ncu || exit 1
timeout 420 ncu --profile-from-start off --clock-control none --print-units base --csv \
  --metrics "$(python "$X" --metrics)" python "$X" > "$OUT/ncu_raw.csv" 2> "$OUT/ncu_err.log"
echo "ncu rc $? after $(( $(date +%s) - t0 )) s"; grep -v "^\"" "$OUT/ncu_raw.csv" | tail -5; tail -5 "$OUT/ncu_err.log"
python "$X" --parse "$OUT/ncu_raw.csv" "$OUT/ncu_targets_names.json"
