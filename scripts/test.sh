#!/usr/bin/env bash
# Every test: set-up from nothing (scripts/setup.sh), then pytest and the Catch2 C++ tests.
# On a machine without a GPU the CUDA tests skip; scripts/gpu_check.sh runs them on a GPU machine.
source "$(dirname "$0")/setup.sh"

echo "== C++ tests (Catch2 against LibTorch)"
mkdir -p build
cmake -S . -B build/cpp -G Ninja -DCMAKE_PREFIX_PATH="$("$PY" -c 'import torch; print(torch.utils.cmake_prefix_path)')" \
  -DPython3_EXECUTABLE="$PY" >build/cmake.log 2>&1 || { tail -40 build/cmake.log; exit 1; }
cmake --build build/cpp -j "$(nproc)" >>build/cmake.log 2>&1 || { tail -40 build/cmake.log; exit 1; }
(cd build/cpp && ctest --output-on-failure)

echo "== pytest"
"$PY" -m pytest -q -rs tests "$@"
