#!/usr/bin/env bash
# The CUDA checks on a GPU machine, from a build folder made elsewhere (tests, CLI):
#   tests/test_cuda_gpu_run.sh [BUILD_DIR] [quick]
# CUDA tests, compute-sanitizer memcheck and racecheck on a reduced filter, `moekit check --device
# cuda` on every experts fixture, `moekit run --device cuda` on a fixture model (decode-step switch,
# decode graphs), and the timing on the qwen3-30b-a3b shape. $OUT (or ./out) gets
# summary.txt and logs.tgz (every log); the summary is printed last.
set -uo pipefail
BUILD=${1:-build-cuda}
MODE=${2:-full}
DEST=${OUT:-$PWD/out}
OUT=$(mktemp -d)/logs
mkdir -p "$OUT" "$DEST"
ROOT=$PWD
# The test binaries find the fixtures and the CLI under the absolute source path they were built at.
SRC=$(sed -n 's/^CMAKE_HOME_DIRECTORY:INTERNAL=//p' "$BUILD/CMakeCache.txt")
if [ -n "$SRC" ] && [ "$SRC" != "$ROOT" ] && [ ! -e "$SRC" ]; then
  mkdir -p "$(dirname "$SRC")" && ln -s "$ROOT" "$SRC"
fi
# Libraries the build machine had and this one may lack (fmt, gomp) travel in $BUILD/lib; cuBLAS comes
# from the CUDA toolkit, or else from the Python wheels.
LIBS="$ROOT/$BUILD/lib:/usr/local/cuda/lib64"
if ! ldconfig -p | grep -q libcublas.so.13 && [ ! -e /usr/local/cuda/lib64/libcublas.so.13 ]; then
  W=$(python3 -c 'import nvidia.cublas, os; print(os.path.dirname(nvidia.cublas.__file__))' 2>/dev/null)
  [ -n "$W" ] && LIBS="$LIBS:$W/lib"
fi
export LD_LIBRARY_PATH="$LIBS:${LD_LIBRARY_PATH:-}"
BIN=$ROOT/$BUILD/bin
SUMMARY=$OUT/summary.txt
: > "$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }
run() {  # run NAME LIMIT_S CMD...: log to $OUT/NAME.log, record the status
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  say "$(printf '%-28s rc=%-3d %4ds  %s' "$name" "$rc" $((SECONDS - t0)) "$(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$OUT/$name.log" | tr '\n' ' ')")"
  return $rc
}

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv | tee -a "$SUMMARY"
ldd "$BIN/test_cuda_backends" "$BIN/moekit" | grep "not found" | tee -a "$SUMMARY"
"$BIN/moekit" backends --device cuda 2>&1 | tee -a "$SUMMARY" || "$BIN/moekit" backends 2>&1 | tee -a "$SUMMARY"
run test_cuda_backends 150 "$BIN/test_cuda_backends"
run test_cuda_graph 60 "$BIN/test_cuda_graph"
run test_cuda_grouped_gemm 200 "$BIN/test_cuda_grouped_gemm"
run test_cuda_model 300 "$BIN/test_cuda_model"
# The model runtime from the CLI: greedy tokens of a fixture model (transformers' are in its
# reference.safetensors), the experts map per phase, decode graphs.
M=tests/fixtures/models/qwen3_moe
for extra in "" "--cuda-graph"; do
  name="run_qwen3_moe${extra:+_graph}"
  run "$name" 60 "$BIN/moekit" run --model "$M" --device cuda --dtype f32 --experts grouped_mm \
    --prompt-ids 5,17,99,3,42,150,7,8 --max-new-tokens 12 --min-new-tokens 12 --json --quiet $extra
  say "  $(tail -1 "$OUT/$name.log")"
done
[ -x "$BIN/test_backends" ] && run test_backends 90 "$BIN/test_backends"
for f in tests/fixtures/experts/*.safetensors; do
  run "check_$(basename "$f" .safetensors)" 30 "$BIN/moekit" check --device cuda --case "$f"
done
if [ "$MODE" = full ]; then
  run timing 150 "$BIN/test_cuda_bench" --gtest_also_run_disabled_tests
  sed -n '/^qwen3/,/^\[/p' "$OUT/timing.log" | tee -a "$SUMMARY"
fi
if command -v compute-sanitizer > /dev/null; then
  FILTER='CudaBackends.SweepFlags:CudaBackends.BadIdsAreReported:CudaBackends.EveryKernelPathSmall:CudaBackends.DeterministicRunToRun:CudaBackends.MatchTheFixtures'
  run memcheck_backends 90 compute-sanitizer --tool memcheck --error-exitcode 9 "$BIN/test_cuda_backends" --gtest_filter="$FILTER"
  run memcheck_graph 45 compute-sanitizer --tool memcheck --error-exitcode 9 "$BIN/test_cuda_graph"
  MODELS='qwen3_moe:Models/CudaFixtureModel.*/gpt_oss:Models/CudaFixtureModel.*/deepseek_v3'
  [ "$MODE" = full ] || MODELS='qwen3_moe'
  run memcheck_model 240 compute-sanitizer --tool memcheck --error-exitcode 9 "$BIN/test_cuda_model" \
    --gtest_filter="CudaModelOps.*:Models/CudaFixtureModel.*/$MODELS"
  # The warp-specialised TMA grouped kernel (and deepgemm on it), on the small cases.
  run memcheck_grouped 120 compute-sanitizer --tool memcheck --error-exitcode 9 "$BIN/test_cuda_grouped_gemm" \
    --gtest_filter='CudaGroupedGemm.TmaKernelActOnlyAndOneExpert'
  run racecheck_grouped 120 compute-sanitizer --tool racecheck --error-exitcode 9 "$BIN/test_cuda_grouped_gemm" \
    --gtest_filter='CudaGroupedGemm.TmaKernelActOnlyAndOneExpert'
  run racecheck_model 120 compute-sanitizer --tool racecheck --error-exitcode 9 "$BIN/test_cuda_model" \
    --gtest_filter='CudaModelOps.Attention*:CudaModelOps.Rope*:CudaModelOps.Rmsnorm*:CudaModelOps.Router*'
  run racecheck_backends 60 compute-sanitizer --tool racecheck --error-exitcode 9 "$BIN/test_cuda_backends" \
    --gtest_filter='CudaBackends.EveryKernelPathSmall'
  run synccheck_backends 30 compute-sanitizer --tool synccheck --error-exitcode 9 "$BIN/test_cuda_backends" \
    --gtest_filter='CudaBackends.EveryKernelPathSmall'
  # sonicmoe's kernels alone (gathered A rows, weighted down rows, slot sum) on one small case.
  SONIC="bench --dims 264,136,8,3 --backends sonicmoe --device cuda --dtype bf16 --iters 1 --min-iters 1 --warmup 0
    --min-time 0 --peak-tflops 800 --bandwidth-gbps 4000 --quiet"
  run memcheck_sonicmoe 60 compute-sanitizer --tool memcheck --error-exitcode 9 "$BIN/moekit" $SONIC --tokens 5,333
  run racecheck_sonicmoe 90 compute-sanitizer --tool racecheck --error-exitcode 9 "$BIN/moekit" $SONIC --tokens 333
  for t in memcheck_backends memcheck_graph memcheck_model memcheck_grouped racecheck_grouped racecheck_backends racecheck_model synccheck_backends memcheck_sonicmoe racecheck_sonicmoe; do
    say "  $t: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/$t.log" | tail -1)"
  done
else
  say "compute-sanitizer: not found"
fi
for n in test_cuda_backends test_cuda_graph test_cuda_grouped_gemm test_cuda_model test_backends; do
  [ -f "$OUT/$n.log" ] && grep -E '^\[  FAILED  \]|Failure|rel L2' "$OUT/$n.log" | head -20 >> "$SUMMARY"
done
cp "$SUMMARY" "$DEST/summary.txt"
tar czf "$DEST/logs.tgz" -C "$(dirname "$OUT")" logs
echo "==== summary"; cat "$SUMMARY"
