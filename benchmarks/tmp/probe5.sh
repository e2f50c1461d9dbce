# Call 5 (issue 16): e2e with the cost model's plans, eager HF prefill; then the CUDA tests.
. benchmarks/device_prelude.sh
export TORCHINDUCTOR_COMPILE_THREADS=4 ATTNOPT_BENCH_GPU_LOCK=/tmp/gpu.lock
E="python -m attnopt.cli bench e2e --isolate --timeout 380"
timeout 400 $E --model smollm2-135m --contexts 1k,8k,32k --methods hf-eager,hf-compiled,attnopt-ro --generate --profile --steps 30 --warmup 4 --parallel 5 --out $OUT/e2e-smollm2.json > $OUT/e2e-smollm2.log 2>&1 &
timeout 400 $E --model llama3-8b --layers 4 --contexts 32k,128k --methods hf-compiled,attnopt-ro --profile --steps 20 --warmup 4 --parallel 4 --out $OUT/e2e-llama3-8b-4layers.json > $OUT/e2e-llama3.log 2>&1 &
wait
echo "benches done $(( $(date +%s) - t0 )) s"
left=$(( 560 - ($(date +%s) - t0) ))
(timeout $left python -m pytest -q -p no:cacheprovider -rs $REPO/tests/models/test_cuda_graphs.py > $OUT/cuda_graph_tests.log 2>&1; echo "rc $?" >> $OUT/cuda_graph_tests.log) &
JOBS=12 parallel_pytest $OUT/cuda_kernel_tests.txt -m cuda $REPO/tests/runtime/test_kernels.py $REPO/tests/runtime/test_kernel_strategies.py $REPO/tests/runtime/test_ops.py > $OUT/cuda_kernel_tests.log 2>&1 &
kpid=$!; (sleep $(( left > 10 ? left - 5 : 5 )); kill $kpid 2>/dev/null) &
wait $kpid
tail -3 $OUT/cuda_graph_tests.log 2>/dev/null
head -4 $OUT/cuda_kernel_tests.log
for f in e2e-smollm2 e2e-llama3; do grep -v "^{" $OUT/$f.log | grep -v "W11\|Warn\|warn\|^  \|^Traceback" | tail -11; done
python - <<'PY'
import json, os
for f in ("e2e-smollm2.json", "e2e-llama3-8b-4layers.json"):
    try: d = json.load(open(os.environ["OUT"] + "/" + f))
    except Exception as e: print(f, e); continue
    for r in d["rows"]:
        if "error" in r: print("ERROR", f, r["context"], r["method"], r["error"], r["stderr_tail"][-600:])
        p = r.get("profile")
        if p and "gpu_by_class" in p:
            a = p["gpu_by_class"].get("attnopt attention kernels", {})
            o = p["gpu_by_class"].get("other aten kernels (in attnopt steps: the valid length)", {})
            print(r["context"], r["method"], "kernels", round(p["kernels_per_step"]), "gpu us", round(p["gpu_us_per_step"]),
                  "attn busy", round(a.get("busy_us_per_step", 0), 1), "other busy", round(o.get("busy_us_per_step", 0), 1),
                  "standalone", round((r.get("standalone_attention") or {}).get("us", 0), 2), "host ops", list(p["host_ops"])[:3])
PY
echo "elapsed $(( $(date +%s) - t0 )) s"
