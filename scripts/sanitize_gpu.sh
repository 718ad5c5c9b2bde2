#!/usr/bin/env bash
# compute-sanitizer (memcheck, racecheck, synccheck) over the CUDA tests of the ops, on the GPU
# machine, after scripts/gpu_check.sh built the extension. Logs: $OUT/sanitizer_<tool>.log
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
SEL=${SEL:-"tests/ops/test_pinned_gather.py tests/ops/test_pinned_scatter.py tests/ops/test_optimizer_state_swap.py tests/ops/test_bad_input.py"}
status=0
for tool in ${TOOLS:-memcheck racecheck synccheck}; do
  # racecheck and synccheck are slow: the dtype-parametrized tests with one store each.
  filter=${FILTER:-$([ "$tool" = memcheck ] && echo "pinned or cuda" || echo "(pinned or cuda) and (float32 or int64 or row_shapes or swap or bad)")}
  timeout ${TOOL_TIMEOUT:-280} compute-sanitizer --tool "$tool" --error-exitcode 86 --target-processes all \
    python3 -m pytest -q -x -p no:cacheprovider $SEL -k "$filter" >"$OUT/sanitizer_$tool.log" 2>&1
  rc=$?
  echo "$tool: exit $rc; $(grep -E 'ERROR SUMMARY|passed|failed' "$OUT/sanitizer_$tool.log" | tail -2 | tr '\n' ' ')"
  [ $rc -eq 0 ] || status=1
done
exit $status
