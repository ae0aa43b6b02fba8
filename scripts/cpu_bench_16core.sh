#!/usr/bin/env bash
# CPU experts timings on a many-core host (written for the 16-core Xeon of the H200 machine), about 3 minutes:
# for qwen3-30b-a3b, mixtral-8x7b, then deepseek-v3 (while the time budget lasts), bf16, T = 1, 8, 64, 512, 2048:
#   1. moekit bench (grouped_mm; the ceilings are measured by the first run and reused by the others);
#   2. transformers' own experts backends on the same shape and token counts (scripts/hf_cpu_bench.py; needs torch and
#      transformers, skipped without them).
# Then one table: moekit's best median per (shape, T), its ratio to the roofline floor, transformers' best and the
# speed-up. FP8=1 adds moekit's FP8 experts at T = 1, 8 beside bf16.
#
# Usage: scripts/cpu_bench_16core.sh [BIN_DIR (default build-gpu/bin)] [OUT_DIR (default $OUT or /tmp/cpu_bench)]
# Environment: THREADS (default: the number of cores, at most 16), BUDGET_S (default 170: a shape starts only while
# the elapsed time is below BUDGET_S - 50), BACKENDS (moekit's, default grouped_mm: the best at every T on that
# host so far; batched_mm reads each pair's expert once per pair), TOKENS (default 1,8,64,512,2048), SHAPES (default
# qwen3-30b-a3b,mixtral-8x7b,deepseek-v3), HF (default 1: time transformers too), FP8 (default 0), HF_RESERVE_S
# (default 100: seconds of the budget kept for transformers' deepseek-v3 run, whose moekit run is cut short first),
# HF_IMPLS (transformers' implementations, comma-separated; default all three of scripts/hf_cpu_bench.py).
# AB_SHAPES (default qwen3-30b-a3b; empty: none): shapes also run at AB_TOKENS (default 512,2048) once per item
# LABEL:VAR=VALUE[,VAR=VALUE...] of AB_ENVS (space-separated; default overlap1:MOEKIT_AMX_OVERLAP=1) with those
# variables set, beside the default, as ab-SHAPE--LABEL. The switches: MOEKIT_AMX_OVERLAP=0|1|2 (the amx tile's
# order: single pass; k in chunks with the next panel pair prefetched into L2 by the row blocks after the first (1)
# or by all (2); by default 2 from 24 rows per expert on, else 0), MOEKIT_BF16_AHEAD=N (the AVX512-BF16 tile's
# prefetch distance in k pairs at decode sizes; default 32), MOEKIT_BF16_STREAMS=4|8 (its panels in lockstep at decode
# sizes; default 8), MOEKIT_AMX_KC, MOEKIT_AMX_PF_PAIRS, MOEKIT_AMX_AHEAD_MEM, MOEKIT_BF16_TASKS (README).
# deepseek-v3 for both engines in a ~4 minute call: SHAPES=deepseek-v3 BUDGET_S=200 (its 22.5 GB of experts take
# about 10 s to create in each engine). MOEKIT_CPU_HUGEPAGES=0: the packed experts in plain pages;
# MOEKIT_BF16_TAIL=N: the last decode tasks of each projection in quarters (README).
# SUMMARY_ONLY=1: no runs, only the table of the records in OUT_DIR (ab-SHAPE--LABEL.json files included).
# The table marks with "!" a cell that streamed more GB/s than the bandwidth ceiling (or ran above the peak).
set -uo pipefail
BIN=${1:-build-gpu/bin}
DIR=${2:-${OUT:-/tmp/cpu_bench}}
mkdir -p "$DIR"
MOEKIT="$BIN/moekit"
[ -x "$MOEKIT" ] || { echo "no moekit at $MOEKIT (give the bin folder of a build)" >&2; exit 2; }
HERE=$(cd "$(dirname "$0")" && pwd)
CORES=$(nproc)
THREADS=${THREADS:-$((CORES < 16 ? CORES : 16))}
BUDGET_S=${BUDGET_S:-170}
TOKENS=${TOKENS:-1,8,64,512,2048}
SHAPES=${SHAPES:-qwen3-30b-a3b,mixtral-8x7b,deepseek-v3}
HF=${HF:-1}
FP8=${FP8:-0}
HF_RESERVE_S=${HF_RESERVE_S:-100}
export OMP_NUM_THREADS=$THREADS OMP_PROC_BIND=close OMP_PLACES=cores
echo "moekit CPU bench: $THREADS threads on $CORES cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
echo "load: $(cut -d' ' -f1-3 /proc/loadavg); $(lscpu | grep -E '^(Thread|Core|Socket|NUMA node\(s\))' | tr -s ' ' | tr '\n' ';')"
echo "transparent huge pages: $(cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null || echo unknown);" \
     "defrag: $(cat /sys/kernel/mm/transparent_hugepage/defrag 2>/dev/null || echo unknown);" \
     "numactl: $(command -v numactl >/dev/null && numactl -H 2>/dev/null | head -1 || echo absent)"
if [ "$HF" = 1 ] && ! python3 -c 'import torch, transformers' 2>/dev/null; then
  echo "transformers: not installed here, skipped"; HF=0
fi

COMMON=(bench --device cpu --backends "${BACKENDS:-grouped_mm}" --warmup 1 --iters 20 --min-iters 3 --min-time 0.2
        --max-seconds 8 --check-macs 20000000 --quiet)
CEIL=()
run() {  # run NAME ARGS...: one bench call, records in $DIR/NAME.json, its table in $DIR/NAME.txt
  local name=$1; shift
  local s=$SECONDS left=$((BUDGET_S + 30 - SECONDS - ${RESERVE:-0}))
  [ $left -lt 45 ] && left=45
  timeout $left "$MOEKIT" "${COMMON[@]}" "${CEIL[@]}" "$@" --json "$DIR/$name.json" > "$DIR/$name.txt" 2>&1
  local rc=$?
  echo "$name: rc=$rc $((SECONDS - s)) s$([ $rc = 124 ] && echo ' (timed out: its finished shapes are in the json)')"
}

hf() {  # hf SHAPE: transformers' backends on SHAPE, records in $DIR/hf-SHAPE.json
  [ "$HF" = 1 ] || return
  local s=$SECONDS left=$((BUDGET_S + 30 - SECONDS))
  [ $left -lt 30 ] && left=30
  timeout $left python3 "$HERE/hf_cpu_bench.py" --json "$DIR/hf-$1.json" --shapes "$1" --tokens "$TOKENS" --min-time 0.2 \
    --budget-s $((left - 10)) $([ $first = 1 ] && echo --peak) ${HF_IMPLS:+--impls "$HF_IMPLS"} > "$DIR/hf-$1.txt" 2>&1
  echo "hf-$1: rc=$? $((SECONDS - s)) s"
}

first=1
[ "${SUMMARY_ONLY:-0}" = 1 ] && SHAPES=  # only the table of the records already in OUT_DIR
for shape in ${SHAPES//,/ }; do
  if [ $first = 0 ] && [ $SECONDS -ge $((BUDGET_S - 50)) ]; then
    echo "$shape: skipped (time budget)"
    continue
  fi
  RESERVE=0
  [ "$HF" = 1 ] && [ "$shape" = deepseek-v3 ] && RESERVE=$HF_RESERVE_S
  run "$shape-bf16" --shape "$shape" --tokens "$TOKENS"
  if [ $first = 1 ] && [ -s "$DIR/$shape-bf16.json" ]; then
    # The later runs reuse the ceilings measured by the first (same floor for every row, no time spent on them).
    # (Those of its end: the bench measures the CPU ceilings again after its run and keeps the better of the two.)
    read -r PEAK BW < <(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(d["peak_tflops"], d["copy_tbps"] * 1000)' "$DIR/$shape-bf16.json")
    [ -n "${PEAK:-}" ] && CEIL=(--peak-tflops "$PEAK" --bandwidth-gbps "$BW")
    grep -m1 '^ceilings' "$DIR/$shape-bf16.txt"
  fi
  case ",${AB_SHAPES-qwen3-30b-a3b}," in
    *",$shape,"*)
      for item in ${AB_ENVS-overlap1:MOEKIT_AMX_OVERLAP=1}; do
        (IFS=,; for kv in ${item#*:}; do export "$kv"; done; unset IFS
         run "ab-$shape--${item%%:*}" --shape "$shape" --tokens "${AB_TOKENS:-512,2048}")
      done ;;
  esac
  [ "$FP8" = 1 ] && run "$shape-fp8" --shape "$shape" --tokens 1,8 --quant fp8
  hf "$shape"
  first=0
done
echo "elapsed $SECONDS s"

python3 - "$DIR" <<'EOF'
import glob, json, os, sys
best, hf = {}, {}  # (shape, tokens, kind) -> moekit record; (shape, tokens) -> transformers' best record
meta, torch_peak, ab = None, 0.0, []
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    try:
        d = json.load(open(f))
    except Exception as e:
        print(f"{f}: unreadable ({e})")
        continue
    is_hf = os.path.basename(f).startswith("hf-")
    if os.path.basename(f).startswith("ab-"):  # AB_ENVS runs: their own table below
        mode = os.path.basename(f)[:-5].rsplit("--", 1)[-1]
        ab.extend((mode, r) for r in d.get("records", []))
        continue
    torch_peak = max(torch_peak, d.get("torch_bf16_gemm_tflops", 0.0))
    if not is_hf and "peak_tflops" in d:
        meta = meta or d
    for r in d.get("records", []):
        if is_hf:
            k = (r["shape"], r["tokens"])
            if "median_us" in r and (k not in hf or r["median_us"] < hf[k]["median_us"]):
                hf[k] = r
            continue
        kind = "fp8" if "fp8" in r.get("dtype", "") else "bf16"
        key = (r["shape"], r["tokens"], kind)
        if key not in best or r["median_us"] < best[key]["median_us"]:
            best[key] = r
if not best:
    sys.exit("no records")
print(f"\n{meta['card']}; peak {meta['peak_tflops']:.2f} TFLOP/s, bandwidth {meta['copy_tbps'] * 1000:.1f} GB/s")
print(f"({meta.get('ceilings_method', '')})")
# The floor's peak is the best bf16 GEMM measured on this host: moekit's or torch's (oneDNN), whichever is higher.
peak = max(meta["peak_tflops"], torch_peak)
bw = meta["copy_tbps"] * 1000
if torch_peak:
    print(f"torch bf16 GEMM {torch_peak:.2f} TFLOP/s; floor below with peak {peak:.2f} TFLOP/s, {bw:.1f} GB/s")
floor_us = lambda r: max(r["flops"] / (peak * 1e12), r["bytes"] / (bw * 1e9)) * 1e6
# A cell that streamed more GB/s than the bandwidth ceiling (or ran above the peak) is marked "!": its ratio is below
# 1 and says that the ceiling was measured too low (or, for experts that fit in the cache, that they were partly there).
over = lambda r: r["bytes"] / r["median_us"] / 1e3 > bw or r["flops"] / r["median_us"] / 1e6 > peak
print("| shape | T | moekit bf16 ms (backend) | GB/s | TFLOP/s | x floor | floor ms | transformers best ms (impl) | speed-up | FP8 ms | FP8 x floor |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for shape, t in sorted({(k[0], k[1]) for k in best} | set(hf), key=lambda x: (x[0], x[1])):
    b, q, h = best.get((shape, t, "bf16")), best.get((shape, t, "fp8")), hf.get((shape, t))
    mk = f"{b['median_us'] / 1000:.3g} ({b['backend']})" if b else "-"
    gb = f"{b['bytes'] / b['median_us'] / 1e3:.1f}" if b else "-"
    tf = f"{b['flops'] / b['median_us'] / 1e6:.2f}" if b else "-"
    fr = f"{b['median_us'] / floor_us(b):.2f}{' !' if over(b) else ''}" if b else "-"
    fl = f"{floor_us(b) / 1000:.3g}" if b else "-"
    hs = f"{h['median_us'] / 1000:.3g} ({h['impl']})" if h else "-"
    sp = f"{h['median_us'] / b['median_us']:.2f}x" if b and h else "-"
    qs = f"{q['median_us'] / 1000:.3g}" if q else "-"
    qf = f"{q['median_us'] / floor_us(q):.2f}" if q else "-"
    print(f"| {shape} | {t} | {mk} | {gb} | {tf} | {fr} | {fl} | {hs} | {sp} | {qs} | {qf} |")
n_over = sum(over(r) for r in best.values())
print(f"cells above a ceiling (marked !): {n_over} of {len(best)}")
if ab:
    print("\nAB_ENVS runs against the default, same call:")
    print("| shape | T | default ms | run | ms | / default | GB/s | x floor |")
    print("|---|---|---|---|---|---|---|---|")
    for mode, r in sorted(ab, key=lambda x: (x[1]["shape"], x[1]["tokens"], x[0])):
        b = best.get((r["shape"], r["tokens"], "bf16"))
        on = f"{b['median_us'] / 1000:.3g}" if b else "-"
        ratio = f"{r['median_us'] / b['median_us']:.2f}" if b else "-"
        print(f"| {r['shape']} | {r['tokens']} | {on} | {mode} | {r['median_us'] / 1000:.3g} | {ratio} | "
              f"{r['bytes'] / r['median_us'] / 1e3:.1f} | {r['median_us'] / floor_us(r):.2f}{' !' if over(r) else ''} |")
EOF
