# Sourced by scripts/test.sh and scripts/demo.sh: sets up a fresh machine (idempotent).
# - Debian's cmake and catch2 for the C++ tests (installed with apt-get when missing)
# - a virtual environment in .venv with the pinned Python packages (requirements-dev.txt; with
#   SPEEDTORCH_OPS_INTEROP=1 the TorchRec extra too, requirements-interop.txt)
# - the extension built from source against that torch (CUDA kernels too when nvcc is found and
#   a GPU is present, or SPEEDTORCH_OPS_WITH_CUDA=1), again only when its sources or build
#   settings changed, and then only what changed
# - the C++ tests (Catch2 against LibTorch) in build/cpp, likewise
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
# The optional TorchRec extra (its interop tests skip without it); CI asks for it.
if [ "${SPEEDTORCH_OPS_INTEROP:-0}" = 1 ] &&
    ! "$PY" -m pip install -q --disable-pip-version-check --no-deps -r requirements-interop.txt; then
  echo "pip could not install requirements-interop.txt" >&2
  exit 1
fi

# The extension: built again only when something it is built from changed since its last build
# (a file under csrc/, setup.py or pyproject.toml newer than the stamp taken when that build
# started, or another torch, compiler or build setting), or when it does not load. A rebuild
# recompiles only what changed: setup.py keeps the objects in build/ext-*, and ninja tracks
# each source's headers and compile command.
# Without a GPU the CUDA tests skip, and compiling their kernels would take most of a fresh
# machine's set-up (minutes on two cores): the CPU kernels only, unless
# SPEEDTORCH_OPS_WITH_CUDA=1 asks for the CUDA ones too (CI does, to compile them).
if [ "${SPEEDTORCH_OPS_WITH_CUDA:-0}" = 0 ] && [ -z "${SPEEDTORCH_OPS_CPU_ONLY:-}" ] &&
    ! nvidia-smi -L >/dev/null 2>&1; then
  export SPEEDTORCH_OPS_CPU_ONLY=1
fi

STAMP=build/speedtorch_ops.stamp
build_key() {  # what the build depends on outside the tree
  "$PY" - <<'EOF'
import importlib.util, os, shutil, sys
torch_dir = os.path.dirname(importlib.util.find_spec("torch").origin)
with open(os.path.join(torch_dir, "version.py")) as f:
    print(sys.executable, " ".join(f.read().split()), shutil.which("nvcc"))
for k in ("CUDA_HOME", "SPEEDTORCH_OPS_CPU_ONLY", "SPEEDTORCH_OPS_BUILD_DIR",
          "TORCH_CUDA_ARCH_LIST", "CC", "CXX", "CFLAGS", "CXXFLAGS", "LDFLAGS"):
    print(k, os.environ.get(k, ""))
EOF
}
key=$(build_key)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$key" ] && compgen -G "speedtorch_ops/_C*.so" >/dev/null &&
    [ -z "$(find csrc setup.py pyproject.toml -newer "$STAMP" -print -quit)" ] &&
    (cd / && "$PY" -c "import speedtorch_ops" 2>/dev/null); then
  echo "== speedtorch_ops is up to date (nothing under csrc/, setup.py or pyproject.toml is newer than $STAMP)"
else
  echo "== building speedtorch_ops ($("$PY" -c 'import torch; print("torch", torch.__version__)'))"
  start=$(date +%s)
  mkdir -p build
  rm -f "$STAMP"
  touch "$STAMP.started"  # a file changed from here on is newer than the stamp: built next time
  if ! "$PY" -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps -e . \
      >build.log 2>&1; then
    tail -40 build.log >&2
    exit 1
  fi
  echo "$key" >"$STAMP"
  touch -r "$STAMP.started" "$STAMP"
  rm -f "$STAMP.started"
  echo "   built in $(( $(date +%s) - start )) s (log: build.log)"
fi

# The C++ tests, built here with the extension: the test command then finds them built when the
# demo command ran first (ninja rebuilds only what changed). A CPU-only extension build
# (without a GPU) left its objects where setup.py keeps them: the C++ tests link those instead
# of compiling the same sources again.
objects=""
if [ -n "${SPEEDTORCH_OPS_CPU_ONLY:-}" ] && [ "${SPEEDTORCH_OPS_CPU_ONLY}" != 0 ]; then
  tag=$("$PY" -c 'import sys; print(sys.implementation.cache_tag)')
  objects=${SPEEDTORCH_OPS_BUILD_DIR:-$ROOT/build/ext-$tag}
fi
configure=(-S . -B build/cpp -G Ninja
           -DCMAKE_PREFIX_PATH="$("$PY" -c 'import importlib.util, os
print(os.path.join(os.path.dirname(importlib.util.find_spec("torch").origin), "share", "cmake"))')"
           -DPython3_EXECUTABLE="$PY" -DSPEEDTORCH_OPS_OBJECTS="$objects")
mkdir -p build/cpp
if [ ! -f build/cpp/build.ninja ] || [ "$(cat build/cpp/configured 2>/dev/null)" != "${configure[*]}" ]; then
  echo "== configuring the C++ tests"
  cmake "${configure[@]}" >build/cmake.log 2>&1 || { tail -40 build/cmake.log; exit 1; }
  echo "${configure[*]}" >build/cpp/configured
fi
start=$(date +%s)
cmake --build build/cpp -j "$(nproc)" >>build/cmake.log 2>&1 || { tail -40 build/cmake.log; exit 1; }
echo "== C++ tests built ($(( $(date +%s) - start )) s; log: build/cmake.log)"
