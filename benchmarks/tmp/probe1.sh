# Probe 1 (issue 16): where a decode step goes, and whether reduce-overhead crashes; bisect the crash if it does.
. benchmarks/device_prelude.sh
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
B="python -m attnopt.cli bench e2e --model smollm2-135m --contexts 8k --steps 20 --warmup 4 --isolate --timeout 280"
timeout 560 $B --methods hf-eager,hf-compiled,attnopt,attnopt-ro --profile --out $OUT/probe1.json 2>&1 | grep -v "^W11\|Warn\|warn" | tail -12
python - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/probe1.json"))
for r in d["rows"]:
    if "error" in r:
        print("ERROR", r["method"], r["error"]); print(r["stderr_tail"][-2500:])
    prof = r.get("profile")
    if prof:
        print(r["method"], "kernels/step", prof["kernels_per_step"], "gpu us/step", prof["gpu_us_per_step"])
        for k, v in list(prof["ops"].items())[:12]:
            print("   ", k[:70], {a: round(b, 1) for a, b in v.items()})
PY
echo "elapsed $(( $(date +%s) - t0 )) s"
