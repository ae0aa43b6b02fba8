#!/usr/bin/env bash
# The side-by-side run on the H200 machine, in one call: moekit's CUDA backends on every preset
# shape, then transformers' own experts backends (tools/hf_bench.py) on the same shapes, then the
# merge into h200.json and the table for docs/perf.md.
#
# Runs from the repository root on the GPU machine (no installs there: it needs the moekit binary
# built here with CUDA, and python3 with torch and transformers, which that machine has):
#   scripts/bench_h200.sh [OUT_DIR]
# Environment: MOEKIT_BIN (default build-bench/bin/moekit), HF_BENCH (default .device/bench/hf_bench.py),
# MOEKIT_LIBS (extra shared libraries for the binary, default .device/bench/lib), BENCH_SECONDS and
# HF_SECONDS (time limits of the two runs), SHAPES, TOKENS.
set -uo pipefail
out=${1:-${OUT:-out/h200}}
mkdir -p "$out"
bin=${MOEKIT_BIN:-build-bench/bin/moekit}
hf=${HF_BENCH:-.device/bench/hf_bench.py}
shapes=${SHAPES:-qwen3-30b-a3b,qwen1.5-moe-a2.7b,mixtral-8x7b,gpt-oss-20b,olmoe-1b-7b,deepseek-v3}
tokens=${TOKENS:-1,8,64,512,4096,16384}
export LD_LIBRARY_PATH="${MOEKIT_LIBS:-$PWD/.device/bench/lib}:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
t0=$SECONDS

{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv; lscpu | head -20; } \
  >"$out/machine.txt" 2>&1

echo "== moekit bench ($((SECONDS - t0)) s)"
if ldd "$bin" | grep -q "not found"; then  # CUDA libraries outside the default paths: look for them
  for lib in $(ldd "$bin" | awk '/not found/ {print $1}'); do
    found=$(find /usr/local /usr/lib /opt -name "$lib" -print -quit 2>/dev/null)
    [ -n "$found" ] && export LD_LIBRARY_PATH="$(dirname "$found"):$LD_LIBRARY_PATH"
  done
fi
ldd "$bin" | grep "not found" && echo "moekit: missing shared libraries (set MOEKIT_LIBS)"
"$bin" backends --device cuda | tee "$out/moekit.log"
# Graph replays where capturable up to T = 512, plain calls always. Each case is limited by
# --max-seconds; the whole run by BENCH_SECONDS (the JSON is rewritten after each shape).
timeout "${BENCH_SECONDS:-200}" "$bin" bench --shape "$shapes" --tokens "$tokens" --backends all --device cuda \
  --dtype bf16 --graph --graph-max-tokens 512 --iters 40 --min-iters 5 --min-time 0.1 --max-seconds 3 \
  --json "$out/moekit.json" >>"$out/moekit.log" 2>&1
echo "moekit bench exit $? ($((SECONDS - t0)) s)"
tail -n 60 "$out/moekit.log"

echo "== transformers (hf_bench.py) ($((SECONDS - t0)) s)"
PYTHONUNBUFFERED=1 timeout "${HF_SECONDS:-200}" python3 "$hf" --json "$out/hf.json" --shapes "$shapes" \
  --tokens "$tokens" --impls eager,batched_mm,grouped_mm --max-gb 20 >"$out/hf.log" 2>&1
echo "hf_bench exit $? ($((SECONDS - t0)) s)"
tail -n 5 "$out/hf.log"

echo "== merge ($((SECONDS - t0)) s)"
python3 bench/merge_results.py --ours "$out/moekit.json" --anchor "$out/hf.json" --anchor-log "$out/hf.log" \
  --out "$out/h200.json" --table "$out/h200_table.md"
echo "done ($((SECONDS - t0)) s)"
