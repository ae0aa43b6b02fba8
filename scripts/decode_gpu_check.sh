#!/usr/bin/env bash
# The decode step's fused forms on a GPU, in about a minute: test_cuda_model (every layer op against the CPU,
# the fused kernel against the unfused ops, the fixture models against transformers with the decode step fused
# and unfused), then the decode step of a 4-layer Qwen3-30B-A3B-shaped bf16 checkpoint (scripts/model_bench.py's
# make_checkpoint) timed with `moekit run --cuda-graph`: fused (default), fused one step at a time
# (MOEKIT_DECODE_AHEAD=0), fused with plain launches (MOEKIT_PDL=0), fused with the first forms of the GEMV kernels
# (MOEKIT_GEMV_STREAM=0 MOEKIT_PAIR_GEMV_DIRECT=0 MOEKIT_COMBINE_STREAM=0) and unfused (MOEKIT_FUSED_DECODE=0).
# The test log's "decode step kernels" lines count the kernel nodes of one recorded decode step per fixture model.
#
#   scripts/decode_gpu_check.sh BUILD_DIR      (needs BUILD_DIR/bin/test_cuda_model and BUILD_DIR/bin/moekit;
#                                               python3 with torch and transformers for the checkpoint)
# Logs under $OUT/decode_gpu_check (or /tmp/decode_gpu_check). Exit status 0 when the tests pass and both
# timings ran. DECODE_CHECK_TESTS=0 skips the test; DECODE_CHECK_CKPT names an existing checkpoint.
set -uo pipefail
BUILD=${1:?usage: scripts/decode_gpu_check.sh BUILD_DIR}
B=$BUILD/bin
ROOT=$(cd "$(dirname "$0")/.." && pwd)
LOG=${OUT:-/tmp}/decode_gpu_check
mkdir -p "$LOG"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
status=0

# The tests read tests/fixtures under the source folder the build was configured from.
if [ -f "$BUILD/CMakeCache.txt" ]; then
  SRC=$(sed -n 's/^CMAKE_HOME_DIRECTORY:INTERNAL=//p' "$BUILD/CMakeCache.txt")
  if [ -n "$SRC" ] && [ ! -e "$SRC" ]; then mkdir -p "$(dirname "$SRC")" && ln -s "$ROOT" "$SRC"; fi
  [ -d "$SRC/tests/fixtures/models" ] || echo "WARNING: no fixture models under $SRC/tests/fixtures/models"
fi

# DECODE_CHECK_TESTS=0: the timings only (the tests ran elsewhere).
if [ "${DECODE_CHECK_TESTS:-1}" != 0 ]; then
  s=$SECONDS
  timeout 75 "$B/test_cuda_model" > "$LOG/test_cuda_model.log" 2>&1
  rc=$?
  [ $rc -eq 0 ] || status=1
  echo "test_cuda_model rc=$rc $((SECONDS - s))s $(grep -E '^\[  (PASSED|FAILED|SKIPPED) +\] [0-9]+ tests?' "$LOG/test_cuda_model.log" | tr '\n' ' ')"
  grep -qE '^\[  PASSED  \] 0 tests' "$LOG/test_cuda_model.log" && { echo "WARNING: no test ran (no GPU?)"; status=1; }
  grep -E '^\[  FAILED  \] [A-Za-z]|^\[       OK \] .*(Fused|FixtureModel)' "$LOG/test_cuda_model.log" | head -24
  grep -E 'decode step kernels' "$LOG/test_cuda_model.log"
fi

# The decode timing: one checkpoint, two runs (same prompt, 64 new tokens greedy, graphs on).
# DECODE_CHECK_CKPT: an existing checkpoint instead; DECODE_CHECK_DEVICE: cpu to try the script without a GPU.
# (about 5 GB: under /tmp, not with the logs)
CKPT=${DECODE_CHECK_CKPT:-${TMPDIR:-/tmp}/moekit_decode_check/qwen3_moe_30b_shapes_4l}
DEVICE=${DECODE_CHECK_DEVICE:-cuda}
GRAPH=$([ "$DEVICE" = cpu ] || echo --cuda-graph)
s=$SECONDS
if [ ! -f "$CKPT/config.json" ]; then
  timeout 120 python3 - "$ROOT/scripts" "$CKPT" > "$LOG/checkpoint.log" 2>&1 <<'EOF'
import sys
sys.path.insert(0, sys.argv[1])
from model_bench import make_checkpoint
make_checkpoint(sys.argv[2], 4, 32000, 0)
EOF
  rc=$?
  echo "checkpoint rc=$rc $((SECONDS - s))s"
  [ $rc -eq 0 ] || tail -3 "$LOG/checkpoint.log"
fi
VOCAB=$(python3 -c "import json, sys; c = json.load(open(sys.argv[1])); print(c.get('text_config', c)['vocab_size'])" "$CKPT/config.json" 2>/dev/null || echo 32000)
IDS=$(python3 -c "import random, sys; r = random.Random(1); print(','.join(str(r.randrange(int(sys.argv[1]))) for _ in range(128)))" "$VOCAB")
# label and environment of each run
for run in "1 MOEKIT_FUSED_DECODE=1" "1_step MOEKIT_DECODE_AHEAD=0" "1_plain MOEKIT_PDL=0" \
  "1_first MOEKIT_GEMV_STREAM=0 MOEKIT_PAIR_GEMV_DIRECT=0 MOEKIT_COMBINE_STREAM=0" "0 MOEKIT_FUSED_DECODE=0"; do
  fused=${run%% *}
  s=$SECONDS
  env ${run#* } timeout 60 "$B/moekit" run --model "$CKPT" --device "$DEVICE" --dtype bf16 \
    --experts grouped_mm --prompt-ids "$IDS" --max-new-tokens 64 --min-new-tokens 64 --json --quiet --warmup 2 \
    $GRAPH > "$LOG/run_fused$fused.json" 2> "$LOG/run_fused$fused.err"
  rc=$?
  [ $rc -eq 0 ] || { status=1; tail -5 "$LOG/run_fused$fused.err"; }
  echo "moekit run ${run#* } rc=$rc $((SECONDS - s))s"
done
python3 - "$LOG" <<'EOF'
import json, sys
log = sys.argv[1]
runs = {}
for f in ("1", "1_step", "1_plain", "1_first", "0"):
    try:
        runs[f] = json.loads(open(f"{log}/run_fused{f}.json").read().strip().splitlines()[-1])
    except Exception as e:
        print(f"fused={f}: no result ({e})")
for f, j in runs.items():
    t = j["timings"]
    n = len(j["generated_ids"])
    print(f"decode fused={f}: {t['tokens_per_s']:.1f} tok/s, {t['decode_ms'] / max(1, n - 1) * 1e3:.0f} us per step, "
          f"prefill {t['prefill_ms']:.1f} ms, graph replays {j.get('cuda_graph', {}).get('replays')}")
for other in ("1_step", "1_plain", "1_first"):
    if "1" in runs and other in runs:
        same = runs["1"]["generated_ids"] == runs[other]["generated_ids"]
        print(f"greedy tokens fused={other} {'==' if same else '!='} fused=1")
if "1" in runs and "0" in runs:
    a, b = runs["1"]["generated_ids"], runs["0"]["generated_ids"]
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    print(f"greedy tokens fused vs unfused: first {n}/{len(a)} equal (bf16: a late parting can be rounding)")
EOF
echo "decode_gpu_check status=$status"
exit $status
