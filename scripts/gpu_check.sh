#!/usr/bin/env bash
# Builds speedtorch_ops from source on a CUDA machine and runs every test there (the CUDA tests
# and opcheck skip on machines without a GPU). Logs go to $OUT (default bench/out).
#   bash scripts/gpu_check.sh            # on the GPU machine, with its own python3 + torch
#   bash scripts/gpu_check.sh tests/x.py # only these tests (pytest arguments)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0+PTX} MAX_JOBS=${MAX_JOBS:-16}
export PYTHONUNBUFFERED=1
{
  date -u +"%Y-%m-%d %H:%M UTC"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"
  nvcc --version | tail -1
} | tee "$OUT/env.txt"
start=$(date +%s)
# The GPU image sets CXX=/opt/gcc/bin/g++, a toolchain that links libstdc++ statically: an
# extension built with it gets its own copy of libstdc++ and crashes formatting an error message
# (seen on the GPU machine). Build with the system compiler, which links libstdc++ like torch does.
export CC=${SPEEDTORCH_OPS_CC:-gcc} CXX=${SPEEDTORCH_OPS_CXX:-g++}
# Every source compiled here: objects an earlier call left in setup.py's build directory were
# judged by file times that a tree copied from another machine need not keep in order.
rm -rf build/ext-*
"$PY" -m pip install --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1 ||
  "$PY" setup.py build_ext --inplace >>"$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
ldd speedtorch_ops/_C*.so | grep -q libstdc++ || { echo "_C links libstdc++ statically: set CXX"; exit 1; }
echo "build: $(( $(date +%s) - start )) s"
"$PY" -m pytest -q -rs -p no:cacheprovider "${@:-tests}" 2>&1 | tee "$OUT/pytest.log"
