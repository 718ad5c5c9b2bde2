#!/usr/bin/env bash
# Every test: set-up from nothing (scripts/setup.sh), then pytest and the Catch2 C++ tests.
# On a machine without a GPU the CUDA tests skip; scripts/gpu_check.sh runs them on a GPU machine.
source "$(dirname "$0")/setup.sh"

echo "== the house's limits (scripts/check_house.py: sizes, layers, private calls, positions)"
"$PY" scripts/check_house.py

echo "== C++ tests (Catch2 against LibTorch; built by scripts/setup.sh)"
(cd build/cpp && ctest --output-on-failure)

echo "== pytest"
# -rfExX: failures, errors and expected failures listed one by one; skips (the CUDA tests on a
# machine without a GPU) counted by reason, a line each (tests/conftest.py). -rs lists them all.
"$PY" -m pytest -q -rfExX tests "$@"
