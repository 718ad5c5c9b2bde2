#!/usr/bin/env bash
# The whole speed benchmark in one command. On the GPU machine (after scripts/gpu_check.sh built the
# extension): the SpeedTorch README table with 16 and 2 CPU threads, the sweeps (row bytes, table
# span up to 24 GiB, batch size, index order, dtype, the Adam state swap, GPU-resident tables),
# and the CPU-only comparison. On a machine without a GPU: the CPU-only comparison.
# Output: printed tables, and seed_table.json, sweep.json, sweep.png, cpu_ops.txt in $OUT.
#   bash bench/speed.sh            # MAX_GIB=8 for a machine with less host memory than 32 GiB
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  "$PY" bench/seed_table.py --threads 16 2 --reps 30 --out "$OUT"
  "$PY" bench/sweep.py --max-gib "${MAX_GIB:-24}" --out "$OUT"
fi
"$PY" bench/cpu_ops.py | tee "$OUT/cpu_ops.txt"
