# Call 2 (issue 16): the 30-layer CUDA-graph regression test, and bench e2e on SmolLM2's shape and llama3-8b layers.
. benchmarks/device_prelude.sh
export TORCHINDUCTOR_COMPILE_THREADS=4
(timeout 420 python -m pytest -q -p no:cacheprovider -x -rs "$REPO/tests/models/test_cuda_graphs.py" > $OUT/cuda_graph_tests.log 2>&1; echo "tests rc $?" >> $OUT/cuda_graph_tests.log) &
timeout 430 python -m attnopt.cli bench e2e --model smollm2-135m --contexts 1k,8k,32k --methods hf-eager,hf-compiled,attnopt-ro --generate --steps 30 --warmup 4 --isolate --parallel 5 --timeout 420 --out $OUT/e2e-smollm2.json > $OUT/e2e-smollm2.log 2>&1
echo "smollm2 done $(( $(date +%s) - t0 )) s"
timeout $(( 585 - ($(date +%s) - t0) )) python -m attnopt.cli bench e2e --model llama3-8b --layers 4 --contexts 32k,128k --methods hf-compiled,attnopt-ro --steps 20 --warmup 4 --isolate --parallel 4 --timeout 300 --prefill-chunk 4096 --out $OUT/e2e-llama3-8b-4layers.json > $OUT/e2e-llama3.log 2>&1
wait
tail -3 $OUT/cuda_graph_tests.log
grep -v "^{" $OUT/e2e-smollm2.log | grep -v "W11\|Warn\|warn" | tail -12
grep -v "^{" $OUT/e2e-llama3.log | grep -v "W11\|Warn\|warn" | tail -6
python - <<'PY'
import json, os
for f in ("e2e-smollm2.json", "e2e-llama3-8b-4layers.json"):
    try: d = json.load(open(os.environ["OUT"] + "/" + f))
    except Exception as e: print(f, e); continue
    for r in d["rows"]:
        if "error" in r: print("ERROR", f, r["context"], r["method"], r["error"], r["stderr_tail"][-800:])
PY
echo "elapsed $(( $(date +%s) - t0 )) s"
