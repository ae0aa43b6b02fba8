#!/usr/bin/env bash
# CPU experts timings on a many-core host (written for the 16-core Xeon of the H200 machine), about 3 minutes:
#   1. qwen3-30b-a3b, bf16, T = 1, 8, 64, 512, 2048 (grouped_mm, batched_mm): prefill against the floor;
#   2. qwen3-30b-a3b, FP8 (128 x 128 block-scaled e4m3), T = 1, 8: decode against bf16 (fewer bytes, less time?);
#   3. while the time budget lasts: mixtral-8x7b, then deepseek-v3, bf16 and FP8 at T = 1, 8, 64.
# Then one table: best median per (shape, T, kind), its backend, FP8 / bf16 and the ratio to the roofline floor.
#
# Usage: scripts/cpu_bench_16core.sh [BIN_DIR (default build-gpu/bin)] [OUT_DIR (default $OUT or /tmp/cpu_bench)]
# Environment: THREADS (default: the number of cores, at most 16), BUDGET_S (default 170: the optional shapes start
# only while the elapsed time is below BUDGET_S - 60).
set -uo pipefail
BIN=${1:-build-gpu/bin}
DIR=${2:-${OUT:-/tmp/cpu_bench}}
mkdir -p "$DIR"
MOEKIT="$BIN/moekit"
[ -x "$MOEKIT" ] || { echo "no moekit at $MOEKIT (give the bin folder of a build)" >&2; exit 2; }
CORES=$(nproc)
THREADS=${THREADS:-$((CORES < 16 ? CORES : 16))}
BUDGET_S=${BUDGET_S:-170}
export OMP_NUM_THREADS=$THREADS OMP_PROC_BIND=close OMP_PLACES=cores
echo "moekit CPU bench: $THREADS threads on $CORES cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
echo "load: $(cut -d' ' -f1-3 /proc/loadavg)"

COMMON=(bench --device cpu --backends grouped_mm,batched_mm --warmup 2 --iters 30 --min-iters 3 --min-time 0.3
        --max-seconds 8 --check-macs 20000000 --quiet)
CEIL=()
run() {  # run NAME ARGS...: one bench call, records in $DIR/NAME.json, its table in $DIR/NAME.txt
  local name=$1; shift
  local s=$SECONDS left=$((BUDGET_S + 30 - SECONDS))
  [ $left -lt 45 ] && left=45
  timeout $left "$MOEKIT" "${COMMON[@]}" "${CEIL[@]}" "$@" --json "$DIR/$name.json" > "$DIR/$name.txt" 2>&1
  local rc=$?
  echo "$name: rc=$rc $((SECONDS - s)) s$([ $rc = 124 ] && echo ' (timed out: its finished shapes are in the json)')"
}

run qwen3-bf16 --shape qwen3-30b-a3b --tokens 1,8,64,512,2048
# The later runs reuse the ceilings measured by the first (same floor for every row, and no time spent on them).
if [ -s "$DIR/qwen3-bf16.json" ]; then
  read -r PEAK BW < <(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(d["peak_tflops"], d["copy_tbps"] * 1000)' "$DIR/qwen3-bf16.json")
  [ -n "${PEAK:-}" ] && CEIL=(--peak-tflops "$PEAK" --bandwidth-gbps "$BW")
fi
run qwen3-fp8 --shape qwen3-30b-a3b --tokens 1,8 --quant fp8
for shape in mixtral-8x7b deepseek-v3; do
  if [ $SECONDS -lt $((BUDGET_S - 60)) ]; then
    run "$shape-bf16" --shape "$shape" --tokens 1,8,64
    run "$shape-fp8" --shape "$shape" --tokens 1,8 --quant fp8
  else
    echo "$shape: skipped (time budget)"
  fi
done
echo "elapsed $SECONDS s"

python3 - "$DIR" <<'EOF'
import glob, json, os, sys
best = {}  # (shape, tokens, kind) -> record
meta = None
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    try:
        d = json.load(open(f))
    except Exception as e:
        print(f"{f}: unreadable ({e})")
        continue
    meta = meta or d
    for r in d.get("records", []):
        kind = "fp8" if "fp8" in r.get("dtype", "") else "bf16"
        key = (r["shape"], r["tokens"], kind)
        if key not in best or r["median_us"] < best[key]["median_us"]:
            best[key] = r
if not best:
    sys.exit("no records")
print(f"\n{meta['card']}; peak {meta['peak_tflops']:.2f} TFLOP/s, copy {meta['copy_tbps'] * 1000:.0f} GB/s")
print("| shape | T | bf16 ms (backend) | bf16 x floor | FP8 ms (backend) | FP8 x floor | FP8 / bf16 |")
print("|---|---|---|---|---|---|---|")
for shape, t in sorted({(k[0], k[1]) for k in best}, key=lambda x: (x[0], x[1])):
    b, q = best.get((shape, t, "bf16")), best.get((shape, t, "fp8"))
    cell = lambda r: (f"{r['median_us'] / 1000:.3g} ({r['backend']})", f"{r['floor_ratio']:.2f}") if r else ("-", "-")
    ratio = f"{q['median_us'] / b['median_us']:.2f}" if b and q else "-"
    print(f"| {shape} | {t} | {cell(b)[0]} | {cell(b)[1]} | {cell(q)[0]} | {cell(q)[1]} | {ratio} |")
EOF
