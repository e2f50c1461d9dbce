#!/usr/bin/env bash
# The one driver for GPU measurements and GPU tests. On a GPU machine (torch and triton preinstalled, no network),
# from the repository root of this checkout:
#
#   ATTNOPT_COMMIT=<sha> OUT=<dir> bash benchmarks/gpu.sh SUITE...
#
# SUITE, run in the order given (a failing suite does not stop the next):
#   tests        the CUDA tests (pytest -m "cuda and not multigpu" over tests/), one pytest process per test id,
#                $JOBS at a time: Triton compiles each id's kernels on its own core (one process for all of them
#                ran out of time); per-id exit codes in $OUT/tests_rc.txt, the logs of failures in $OUT/tests/
#                The whole suite no longer fits one 600 s device call (H100, 7a6fe0b: 389 s + 309 s): run
#                TESTS=tests/runtime, then TESTS='tests/attnopt tests/models tests/passes' JOBS=7 (the tuner's
#                timing tests beside fewer compiles)
#   nccl-tests   the multi-GPU tests (pytest -m multigpu, NCCL over 2 GPUs), one pytest process per file
#   multigpu     `attnopt bench multigpu` under torchrun over $GPUS GPUs (default: all of them)
#   calibrate    `attnopt calibrate --validate`: fit the cost model to this GPU and score its choices
#   distributed-generate   examples/distributed_generate.py: SmolLM2 with its KV cache sharded over $GPUS (2) GPUs,
#                fp32 tokens equal to one device's, bf16 logits within tolerance ($GENERATE_RUNS: dtype:plan ...);
#                needs the GGUF that `smollm2 run` joins (/tmp/e2e/smol.gguf) and the gguf package in /tmp/site
#   <name>       any other name is `attnopt bench <name>` (kernels, dispatch, e2e, headroom, cascade, ...)
# and the SmolLM2 GGUF end to end, whose 98 MB file travels in two parts over two back-to-back device calls:
#   bash benchmarks/gpu.sh smollm2 prepare|stage|run|saap-quality   (benchmarks/gpu_session_e2e_smollm2.sh says how)
#
# Environment:
#   ATTNOPT_COMMIT  the commit measured, recorded in every result. Pass it: the device copy's git HEAD is stale.
#   OUT             where results and logs go (default ./gpu-out): <suite>.json, <suite>.log, summary.txt
#   ARGS_<suite>    extra options for one suite, e.g. ARGS_kernels="--quick" ARGS_multigpu="--lengths 128k"
#   JOBS            parallel test processes (default: CPU cores, at most 14); TEST_TIMEOUT seconds per test id (400)
#   TESTS           what `tests` collects, paths under the checkout (default: tests)
#   SUITE_TIMEOUT   seconds per suite (default 540: under a device call's 600 s limit)
#   GPUS            ranks for `multigpu` (default: every visible GPU)
#
# The checkout is installed as a regular package (pip, no index, no deps, no build isolation) and everything runs
# from /tmp, since a source checkout in the working directory would shadow the package-dir mapping (attnopt.runtime
# and attnopt.passes live in runtime/ and passes/). Where pip cannot build offline, a tree under /tmp that mirrors
# the installed layout goes on PYTHONPATH instead (then `torch.compile(backend="attnopt")` by name, an entry point,
# is unavailable; everything else runs). Sourced (`. benchmarks/gpu.sh`), it only installs and sets REPO, OUT, t0.
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
REPO=${REPO:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}  # the checkout this script is in, from any cwd
OUT=${OUT:-$REPO/gpu-out}
mkdir -p "$OUT"
export OUT ATTNOPT_CACHE_DIR=${ATTNOPT_CACHE_DIR:-/tmp/attnopt-cache}
if [ -z "${ATTNOPT_COMMIT:-}" ]; then
  echo "gpu.sh: ATTNOPT_COMMIT is not set; results record commit 'unknown' (the device copy's git HEAD is stale)" >&2
  export ATTNOPT_COMMIT=unknown
fi

install_checkout() {
  if (cd "$REPO" && python -m pip install -q --no-index --no-deps --no-build-isolation .) > "$OUT/install.log" 2>&1; then
    echo "installed with pip"
  else
    echo "pip could not install the checkout offline (see $OUT/install.log): running it from PYTHONPATH"
    rm -rf /tmp/attnopt-src && mkdir -p /tmp/attnopt-src && cp -r "$REPO/attnopt" /tmp/attnopt-src/ \
      && ln -s "$REPO/runtime" /tmp/attnopt-src/attnopt/runtime && ln -s "$REPO/passes" /tmp/attnopt-src/attnopt/passes \
      || return 1
    export PYTHONPATH=/tmp/attnopt-src${PYTHONPATH:+:$PYTHONPATH}
  fi
  cd /tmp && python -c "import attnopt, attnopt.runtime.ops, attnopt.passes; print('attnopt from', attnopt.__file__)"
}

if [ "${BASH_SOURCE[0]}" = "$0" ] && [ "${1:-}" = smollm2 ]; then  # its "prepare" step runs here, not on the GPU
  shift
  exec bash "$REPO/benchmarks/gpu_session_e2e_smollm2.sh" "$@"
fi
install_checkout || { echo "gpu.sh: attnopt does not import" >&2; exit 1; }
t0=$(date +%s)

# One pytest process per collected test id, JOBS at a time. Usage: parallel_pytest RC_FILE PYTEST_ARGS...
# Writes "exit-code test-id" lines to RC_FILE, prints the count of each exit code, copies the logs of failures to
# $OUT/tests/ (exit 5: the id selected no test). A collection that fails (a path not found, an import error: pytest
# then lists no id at all) is reported with its log and fails the suite.
parallel_pytest() {
  local rc_file=$1; shift
  local ids=/tmp/gpu-test-ids.txt logs=/tmp/gpu-test-logs
  python -m pytest -q --collect-only -p no:cacheprovider "$@" > /tmp/gpu-test-collect.txt 2>&1
  local collect_rc=$?
  grep "::" /tmp/gpu-test-collect.txt | sed "s#^#$REPO/#" > "$ids"
  echo "$(wc -l < "$ids") test ids"
  if [ $collect_rc -ne 0 ] && [ $collect_rc -ne 5 ]; then  # a path not found, an import error: say so, run nothing
    mkdir -p "$OUT/tests" && cp /tmp/gpu-test-collect.txt "$OUT/tests/collect.log"
    echo "collection failed (pytest exit $collect_rc, $OUT/tests/collect.log):"
    grep -i -m 5 "error\|not found" /tmp/gpu-test-collect.txt
    return 1
  fi
  rm -rf "$logs" && mkdir -p "$logs" "$OUT/tests"
  local jobs=${JOBS:-$(nproc)}
  [ "$jobs" -gt 14 ] && jobs=14
  # each id is one argument (test ids may hold spaces or quotes inside their brackets)
  xargs -d '\n' -P "$jobs" -n 1 sh -c 'n=$(printf %s "$1" | md5sum | cut -c1-8)
    timeout "${TEST_TIMEOUT:-400}" python -m pytest -q -p no:cacheprovider "$1" > "$0/$n.log" 2>&1
    rc=$?
    echo "$rc $1" >> "$0/rc.txt"
    [ $rc -eq 0 ] || [ $rc -eq 5 ] || cp "$0/$n.log" "$OUT/tests/"' "$logs" < "$ids"
  sort "$logs/rc.txt" | sed "s#$REPO/##" > "$rc_file"
  awk '{print $1}' "$rc_file" | sort | uniq -c | awk '{print "  exit " $2 ": " $1 " test ids"}'
  ! awk '$1 != 0 && $1 != 5 {bad = 1} END {exit !bad}' "$rc_file"  # 5: no test selected
}

run_suite() {  # SUITE: one suite's command, logged to $OUT/SUITE.log
  local suite=$1 args_var="ARGS_${1//-/_}"
  local extra=${!args_var:-}
  case "$suite" in
    tests)
      parallel_pytest "$OUT/tests_rc.txt" -m "cuda and not multigpu" $(for t in ${TESTS:-tests}; do echo "$REPO/$t"; done) ;;
    nccl-tests)
      local rc=0 f
      for f in $(grep -rl "mark.multigpu" "$REPO/tests" --include="test_*.py" | sort); do
        echo "== ${f#$REPO/}"
        timeout "${SUITE_TIMEOUT:-540}" python -m pytest -q -p no:cacheprovider -m multigpu -rs "$f" $extra 2>&1 \
          | grep -v "^W1\|Warning\|warn(" | tail -12 || rc=1
      done
      return $rc ;;
    multigpu)
      local gpus=${GPUS:-$(nvidia-smi -L | wc -l)}
      nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
      timeout "${SUITE_TIMEOUT:-540}" torchrun --standalone --nproc-per-node "$gpus" -m attnopt.cli bench multigpu \
        --commit "$ATTNOPT_COMMIT" --out "$OUT/multigpu-${gpus}gpu.json" $extra ;;
    distributed-generate)  # SmolLM2 with its KV cache sharded over 2 GPUs, tokens against one device
      export ATTNOPT_SMOLLM2_GGUF=${ATTNOPT_SMOLLM2_GGUF:-/tmp/e2e/smol.gguf} PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
      [ -f "$ATTNOPT_SMOLLM2_GGUF" ] || { echo "no GGUF at $ATTNOPT_SMOLLM2_GGUF: run 'gpu.sh smollm2 stage', then 'run'"; return 1; }
      local rc=0 spec
      for spec in ${GENERATE_RUNS:-float32:auto float32:tree:all_gather bfloat16:auto}; do
        echo "== ${spec%%:*} plan ${spec#*:}"
        timeout 240 torchrun --standalone --nproc-per-node "${GPUS:-2}" "$REPO/examples/distributed_generate.py" \
          --dtype "${spec%%:*}" --plan "${spec#*:}" --max-new-tokens 24 $extra 2>&1 | tail -9 || rc=1
      done
      return $rc ;;
    calibrate)
      timeout "${SUITE_TIMEOUT:-540}" python -m attnopt.cli calibrate --validate --out "$OUT/cost_model.json" \
        --quiet $extra ;;
    *)
      timeout "${SUITE_TIMEOUT:-540}" python -m attnopt.cli bench "$suite" --out "$OUT/$suite.json" $extra ;;
  esac
}

main() {
  [ $# -gt 0 ] || { sed -n '2,20p' "$REPO/benchmarks/gpu.sh"; exit 2; }
  python -c "import torch; c = torch.cuda; print('torch', torch.__version__, '|', c.get_device_name(0) if c.is_available() else 'no CUDA', 'x', c.device_count())" \
    | tee "$OUT/device.txt"
  echo "commit $ATTNOPT_COMMIT" >> "$OUT/device.txt"
  local suite start rc failed=0
  for suite in "$@"; do
    start=$(date +%s)
    echo "=== $suite"
    run_suite "$suite" 2>&1 | tee "$OUT/$suite.log" | grep -v "Warning\|warn(\|return F\.\|^W1[0-9]"
    rc=${PIPESTATUS[0]}
    echo "$suite rc=$rc $(( $(date +%s) - start ))s" | tee -a "$OUT/summary.txt"
    [ "$rc" = 0 ] || failed=1
  done
  echo "all: $(( $(date +%s) - t0 ))s"
  return $failed
}

# sourced: install and set REPO, OUT, t0 only (benchmarks/gpu_session_e2e_smollm2.sh uses this)
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  main "$@"
  exit $?
fi
