# Sourced by the GPU session scripts: NCCL with NVLink multicast off, a regular install of this tree run from
# /tmp (a source checkout in the working directory would shadow the package-dir mapping), REPO set, t0 started.
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
REPO=$PWD
python -m pip install -q --no-deps --no-build-isolation . 2>&1 | grep -v WARNING
cd /tmp && python -c "import attnopt.runtime, attnopt.passes" || exit 1
t0=$(date +%s)
