#!/usr/bin/env bash
# The demo on the GPU machine: tables bigger than a GPU-memory budget train from pinned host
# memory, and the same training with the whole tables on the GPU in plain PyTorch is timed.
# Run after scripts/gpu_check.sh (which builds the extension). Output: $OUT/demo_gpu.log
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# Default corpus size, trained on the GPU: quality and speed at the demo's own scale.
python3 -m speedtorch_ops.demo --device cuda 2>&1 | grep -v "step/s]$" | tee "$OUT/demo_gpu.log"
# 4 M words x 128: 2 GiB per table, 12 GiB with Adam state, against a 1.5 GiB GPU budget.
python3 -m speedtorch_ops.demo --device cuda --vocab 4000000 --dim 128 --batch 8192 \
  --steps 300 --tokens 4000000 --gpu-budget-mb 1536 --baseline --reuse-batches 2>&1 |
  grep -v "step/s]$" | tee -a "$OUT/demo_gpu.log"
# The same training through the SpeedTorch-compatible factories (the default above is the
# HostEmbedding modules with a GPU row cache): colocated rows, 0.1.6's calls only, prefetch.
for mode in colocated plain prefetch; do
  python3 -m speedtorch_ops.demo --device cuda --vocab 4000000 --dim 128 --batch 8192 \
    --steps 300 --tokens 4000000 --gpu-budget-mb 1536 --reuse-batches --engine factories \
    --switching $mode 2>&1 |
    grep -v "step/s]$" | sed "s/^/[$mode] /" | tee -a "$OUT/demo_gpu.log"
done
