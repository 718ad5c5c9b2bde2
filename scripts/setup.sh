# Sourced by scripts/test.sh and scripts/demo.sh: sets up a fresh machine (idempotent).
# - Debian's cmake and catch2 for the C++ tests (installed with apt-get when missing)
# - a virtual environment in .venv with the pinned Python packages (requirements-dev.txt)
# - the extension built from source against that torch (CUDA kernels too when nvcc is found)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
VENV=${SPEEDTORCH_OPS_VENV:-$ROOT/.venv}
PY=$VENV/bin/python

if ! command -v cmake >/dev/null || [ ! -f /usr/include/catch2/catch.hpp ]; then
  echo "== installing Debian packages: cmake catch2"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq cmake catch2 >/dev/null
fi

if [ ! -x "$PY" ]; then
  echo "== creating $VENV"
  python3 -m venv "$VENV"
fi
if ! "$PY" -m pip install -q --disable-pip-version-check -r requirements-dev.txt; then
  echo "pip could not install requirements-dev.txt" >&2
  exit 1
fi

echo "== building speedtorch_ops ($("$PY" -c 'import torch; print("torch", torch.__version__)'))"
start=$(date +%s)
if ! "$PY" -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps -e . \
    >build.log 2>&1; then
  tail -40 build.log >&2
  exit 1
fi
echo "   built in $(( $(date +%s) - start )) s (log: build.log)"
