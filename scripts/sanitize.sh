#!/usr/bin/env bash
# ASan + UBSan over the C++ (Catch2) tests and a Python smoke run of the ops, on the CPU.
# Needs the environment of scripts/setup.sh (run scripts/test.sh once first).
#   bash scripts/sanitize.sh
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PY=${SPEEDTORCH_OPS_VENV:-$ROOT/.venv}/bin/python
FLAGS="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined"
# torch's own CUDA libraries are loaded (not instrumented): leave the shadow gap unprotected.
export ASAN_OPTIONS=protect_shadow_gap=0:detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1

echo "== Catch2 tests under ASan + UBSan"
cmake -S . -B build/asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_PREFIX_PATH="$("$PY" -c 'import torch; print(torch.utils.cmake_prefix_path)')" \
  -DCMAKE_CXX_FLAGS="$FLAGS" -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" >/dev/null
cmake --build build/asan -j "$(nproc)" >/dev/null
ASAN_OPTIONS=protect_shadow_gap=0:detect_leaks=1 ./build/asan/cpp_tests

echo "== Python smoke run under ASan + UBSan (CPU-only build in a scratch copy)"
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
git ls-files -z | xargs -0 -I{} cp --parents {} "$scratch"
(cd "$scratch" && SPEEDTORCH_OPS_CPU_ONLY=1 CFLAGS="$FLAGS" LDFLAGS="-fsanitize=address,undefined" \
  "$PY" setup.py build_ext --inplace >build.log 2>&1) || { tail -30 "$scratch/build.log"; exit 1; }
cd "$scratch"
ldd speedtorch_ops/_C*.so | grep -q libasan || { echo "the scratch build is not instrumented"; exit 1; }
LD_PRELOAD="$(gcc -print-file-name=libasan.so):$(gcc -print-file-name=libubsan.so)" \
  PYTHONMALLOC=malloc "$PY" -m pytest -q -x -p no:cacheprovider \
  tests/ops/test_pinned_gather.py tests/ops/test_pinned_scatter.py tests/ops/test_optimizer_state_swap.py \
  tests/ops/test_bad_input.py tests/ops/test_properties.py
