# Call 3 (issue 16): regression test, e2e on SmolLM2's shape (1k/8k/32k, steps + generate + profile), the cudagraphs
# inner backend at 8k, llama3-8b layers at 32k/128k; CUDA kernel tests with what time is left.
. benchmarks/device_prelude.sh
export TORCHINDUCTOR_COMPILE_THREADS=4 ATTNOPT_BENCH_GPU_LOCK=/tmp/gpu.lock
(timeout 430 python -m pytest -q -p no:cacheprovider -rs "$REPO/tests/models/test_cuda_graphs.py" > $OUT/cuda_graph_tests.log 2>&1; echo "tests rc $?" >> $OUT/cuda_graph_tests.log) &
E="python -m attnopt.cli bench e2e --isolate --timeout 420"
timeout 440 $E --model smollm2-135m --contexts 1k,8k,32k --methods hf-eager,hf-compiled,attnopt-ro --generate --profile --steps 30 --warmup 4 --parallel 5 --out $OUT/e2e-smollm2.json > $OUT/e2e-smollm2.log 2>&1 &
timeout 440 $E --model smollm2-135m --contexts 8k --methods attnopt-cg --steps 20 --warmup 4 --out $OUT/e2e-smollm2-cudagraphs.json > $OUT/e2e-cg.log 2>&1 &
timeout 440 $E --model llama3-8b --layers 4 --contexts 32k,128k --methods hf-compiled,attnopt-ro --profile --steps 20 --warmup 4 --parallel 4 --out $OUT/e2e-llama3-8b-4layers.json > $OUT/e2e-llama3.log 2>&1 &
wait
echo "benches and test done $(( $(date +%s) - t0 )) s"
left=$(( 570 - ($(date +%s) - t0) ))
if [ $left -gt 100 ]; then JOBS=14 timeout $left bash -c ". $REPO/benchmarks/device_prelude.sh >/dev/null; parallel_pytest $OUT/cuda_kernel_tests.txt -m cuda $REPO/tests/runtime" > $OUT/cuda_kernel_tests.log 2>&1; tail -5 $OUT/cuda_kernel_tests.log; fi
tail -3 $OUT/cuda_graph_tests.log
for f in e2e-smollm2 e2e-cg e2e-llama3; do grep -v "^{" $OUT/$f.log | grep -v "W11\|Warn\|warn\|^  \|^Traceback" | tail -11; done
python - <<'PY'
import json, os
for f in ("e2e-smollm2.json", "e2e-smollm2-cudagraphs.json", "e2e-llama3-8b-4layers.json"):
    try: d = json.load(open(os.environ["OUT"] + "/" + f))
    except Exception as e: print(f, e); continue
    for r in d["rows"]:
        if "error" in r: print("ERROR", f, r["context"], r["method"], r["error"], r["stderr_tail"][-600:])
        p = r.get("profile")
        if p and "gpu_by_class" in p:
            print(r["context"], r["method"], "kernels", round(p["kernels_per_step"]), "gpu us", round(p["gpu_us_per_step"]),
                  {k[:24]: round(v["gpu_us_per_step"], 1) for k, v in p["gpu_by_class"].items()}, "standalone", r.get("standalone_attention"))
PY
echo "elapsed $(( $(date +%s) - t0 )) s"
