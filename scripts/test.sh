#!/usr/bin/env bash
# Every test: set-up from nothing (scripts/setup.sh), then pytest and the Catch2 C++ tests.
# On a machine without a GPU the CUDA tests skip; scripts/gpu_check.sh runs them on a GPU machine.
source "$(dirname "$0")/setup.sh"

echo "== C++ tests (Catch2 against LibTorch)"
mkdir -p build
# A CPU-only extension build (setup.sh's choice without a GPU) left its objects where setup.py
# keeps them: the C++ tests link those instead of compiling the same sources again.
objects=""
if [ -n "${SPEEDTORCH_OPS_CPU_ONLY:-}" ] && [ "${SPEEDTORCH_OPS_CPU_ONLY}" != 0 ]; then
  tag=$("$PY" -c 'import sys; print(sys.implementation.cache_tag)')
  objects=${SPEEDTORCH_OPS_BUILD_DIR:-$ROOT/build/ext-$tag}
fi
cmake -S . -B build/cpp -G Ninja -DCMAKE_PREFIX_PATH="$("$PY" -c 'import torch; print(torch.utils.cmake_prefix_path)')" \
  -DPython3_EXECUTABLE="$PY" -DSPEEDTORCH_OPS_OBJECTS="$objects" >build/cmake.log 2>&1 ||
  { tail -40 build/cmake.log; exit 1; }
cmake --build build/cpp -j "$(nproc)" >>build/cmake.log 2>&1 || { tail -40 build/cmake.log; exit 1; }
(cd build/cpp && ctest --output-on-failure)

echo "== pytest"
"$PY" -m pytest -q -rs tests "$@"
