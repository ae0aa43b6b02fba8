#!/usr/bin/env bash
# The CUDA checks on a GPU machine, from a build folder made elsewhere (tests, CLI):
#   tests/test_cuda_gpu_run.sh [BUILD_DIR] [quick]
# CUDA tests, compute-sanitizer memcheck and racecheck on a reduced filter, `moekit check --device
# cuda` on every experts fixture, and the timing on the qwen3-30b-a3b shape. Logs go to $OUT (or
# ./out); the summary is printed last.
set -uo pipefail
BUILD=${1:-build-cuda}
MODE=${2:-full}
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
ROOT=$PWD
# The test binaries find the fixtures and the CLI under the absolute source path they were built at.
SRC=$(sed -n 's/^CMAKE_HOME_DIRECTORY:INTERNAL=//p' "$BUILD/CMakeCache.txt")
if [ -n "$SRC" ] && [ "$SRC" != "$ROOT" ] && [ ! -e "$SRC" ]; then
  mkdir -p "$(dirname "$SRC")" && ln -s "$ROOT" "$SRC"
fi
[ -d "$BUILD/lib" ] && export LD_LIBRARY_PATH="$ROOT/$BUILD/lib:${LD_LIBRARY_PATH:-}"
BIN=$ROOT/$BUILD/bin
SUMMARY=$OUT/summary.txt
: > "$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }
run() {  # run NAME CMD...: log to $OUT/NAME.log, record the status
  local name=$1; shift
  local t0=$SECONDS
  "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  say "$(printf '%-28s rc=%-3d %4ds  %s' "$name" "$rc" $((SECONDS - t0)) "$(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$OUT/$name.log" | tr '\n' ' ')")"
  return $rc
}

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv | tee -a "$SUMMARY"
run test_cuda_backends "$BIN/test_cuda_backends"
run test_cuda_graph "$BIN/test_cuda_graph"
[ -x "$BIN/test_backends" ] && run test_backends "$BIN/test_backends"
for f in tests/fixtures/experts/*.safetensors; do
  run "check_$(basename "$f" .safetensors)" "$BIN/moekit" check --device cuda --case "$f"
done
if command -v compute-sanitizer > /dev/null; then
  FILTER='CudaBackends.SweepOddAndLargeSizes:CudaBackends.BadIdsAreReported:CudaBackends.SweepFlags:CudaBackends.DeterministicRunToRun'
  run memcheck_backends compute-sanitizer --tool memcheck --error-exitcode 9 "$BIN/test_cuda_backends" --gtest_filter="$FILTER"
  run memcheck_graph compute-sanitizer --tool memcheck --error-exitcode 9 "$BIN/test_cuda_graph"
  run racecheck_backends compute-sanitizer --tool racecheck --error-exitcode 9 "$BIN/test_cuda_backends" \
    --gtest_filter='CudaBackends.SweepOddAndLargeSizes:CudaBackends.DeterministicRunToRun'
  run synccheck_backends compute-sanitizer --tool synccheck --error-exitcode 9 "$BIN/test_cuda_backends" \
    --gtest_filter='CudaBackends.SweepOddAndLargeSizes'
  for t in memcheck_backends memcheck_graph racecheck_backends synccheck_backends; do
    say "  $t: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/$t.log" | tail -1)"
  done
else
  say "compute-sanitizer: not found"
fi
if [ "$MODE" = full ]; then
  run timing "$BIN/test_cuda_bench" --gtest_also_run_disabled_tests
  sed -n '/^qwen3/,/^\[/p' "$OUT/timing.log" | tee -a "$SUMMARY"
fi
for n in test_cuda_backends test_cuda_graph test_backends; do
  [ -f "$OUT/$n.log" ] && grep -E '^\[  FAILED  \]|Failure|rel L2' "$OUT/$n.log" | head -20 >> "$SUMMARY"
done
echo "==== summary"; cat "$SUMMARY"
