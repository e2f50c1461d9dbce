#!/usr/bin/env bash
# Multi-GPU session, first call (carries .smol/partaa and .whl): tree vs ring at P = 4 and P = 2 on one host
# (issue 6; P = 2 again on the same machine so that ring/tree can be compared across P), NCCL with NVLink
# multicast off. Usage on the device: bash benchmarks/gpu_session_multigpu.sh [P...]
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cp .smol/partaa /tmp/partaa 2>/dev/null || echo "no .smol/partaa carried"
# A regular install, run from /tmp: a source checkout in the working directory would shadow the package-dir
# mapping (attnopt.runtime / attnopt.passes live in runtime/ and passes/).
REPO=$PWD
python -m pip install -q --no-deps --no-build-isolation . 2>&1 | grep -v WARNING
cd /tmp && python -c "import attnopt.runtime, attnopt.passes; print('attnopt from', attnopt.__file__)" || exit 1
commit=${ATTNOPT_COMMIT:-$(git -C "$REPO" rev-parse HEAD 2>/dev/null || echo unknown)}
nvidia-smi topo -m | head -8 | tee "$OUT/topo.txt"
gpus=$(nvidia-smi -L | wc -l)
for P in ${@:-4 2}; do
  [ "$P" -le "$gpus" ] || { echo "skip P=$P: $gpus GPUs"; continue; }
  budget=$(( P >= 4 ? 200 : 110 ))
  timeout $(( budget + 120 )) torchrun --standalone --nproc-per-node "$P" -m attnopt.cli bench multigpu \
    --shapes llama3-8b,mha16 --lengths "${LENGTHS:-128k,512k,1M,2M}" --topology "${P}x-h200-nvlink" --hardware h200 \
    --time-budget "$budget" --timeout 90 --commit "$commit" --out "$OUT/multigpu-${P}xh200.json" 2>&1 \
    | grep -v "Warning\|warn(" | tee "$OUT/multigpu-${P}.log" | grep -v "^ " | tail -60
done
python3 - "$OUT" <<'PY'
import glob, json, sys
print(f"{'P':>2} {'case':18s} {'tree(g)':>8s} {'ring(g)':>8s} {'ring/tree g':>11s} {'ring/tree e':>11s} {'ovh g':>7s} {'ovh e':>7s} {'vs best local e':>15s} {'pick':>5s} {'est err':>7s}")
for f in sorted(glob.glob(sys.argv[1] + "/multigpu-*xh200.json")):
    d = json.load(open(f))
    for case, s in d.get("summary", {}).items():
        rg = min([r["us"] for r in d["rows"] if r["case"] == case and r["method"].startswith("ring:") and r["mode"] == "graph" and r["us"]] or [float("nan")])
        print(f"{d['world_size']:>2} {case:18s} {s.get('best_tree_us_graph', float('nan')):8.1f} {rg:8.1f} "
              f"{s.get('ring_over_tree_graph', float('nan')):11.2f} {s.get('ring_over_tree_eager', float('nan')):11.2f} "
              f"{s.get('tree_overhead_us_graph', float('nan')):7.1f} {s.get('tree_overhead_us_eager', float('nan')):7.1f} {s.get('tree_over_best_local_us_eager', float('nan')):15.1f} {str(s.get('model_pick_ok')):>5s} {s.get('est_abs_log_err_median', float('nan')):7.2f}")
PY
