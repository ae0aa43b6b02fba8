#!/usr/bin/env bash
# make demo: a tiny random checkpoint written by `moekit tiny` (with its tokenizer.json), greedy generation
# from a text prompt with every experts backend that runs on this machine's CPU (the tokens must be
# identical), timings per backend, the generated text (random weights: gibberish), and the backends table.
#   scripts/demo.sh [BUILD_DIR]
#   MOEKIT_DEMO_ARCH   model_type of the checkpoint (default qwen3_moe; `moekit tiny --list` lists them)
#   MOEKIT_DEMO_DIR    where the checkpoint is written (default BUILD_DIR/demo)
set -euo pipefail
BUILD=${1:-build}
MOEKIT="$BUILD/bin/moekit"
ARCH=${MOEKIT_DEMO_ARCH:-qwen3_moe}
WORK=${MOEKIT_DEMO_DIR:-$BUILD/demo}
CKPT="$WORK/$ARCH"
PROMPT="The experts of a mixture of experts model"
NEW_TOKENS=32

step() { echo "[demo] $*" >&2; }
fail() { echo "[demo] error: $*" >&2; exit 1; }
[ -x "$MOEKIT" ] || fail "$MOEKIT not found; build first (make build)"

step "writing a tiny random $ARCH checkpoint to $CKPT (moekit tiny) ..."
"$MOEKIT" tiny --arch "$ARCH" --out "$CKPT" --seed 0 >/dev/null

# Backends that run on this CPU: the rows of `moekit backends` whose "runs" column says yes.
mapfile -t BACKENDS < <("$MOEKIT" backends --device cpu | awk 'NR > 1 && $2 == "yes" { print $1 }')
[ "${#BACKENDS[@]}" -gt 0 ] || fail "no experts backend runs on this CPU"

field() {  # field NAME JSON: a number from the JSON line
  sed -E "s/.*\"$1\":(-?[0-9.eE+-]+).*/\1/" <<<"$2"
}

echo
echo "moekit demo: greedy generation on a tiny $ARCH checkpoint ($CKPT)"
echo "prompt: \"$PROMPT\" ($("$MOEKIT" tokenize --model "$CKPT" --text "$PROMPT" | tr , ' ')); $NEW_TOKENS new tokens; timings after one warm-up run"
echo
printf '%-14s %12s %12s %12s\n' "backend" "prefill ms" "decode ms" "tokens/s"
FIRST_IDS=""
SAME=yes
declare -A IDS
for be in "${BACKENDS[@]}"; do
  step "generating with $be ..."
  json=$("$MOEKIT" run --quiet --model "$CKPT" --prompt "$PROMPT" --max-new-tokens "$NEW_TOKENS" \
    --min-new-tokens "$NEW_TOKENS" --experts "$be" --warmup 1 --json) || fail "moekit run failed with backend $be"
  ids=$(sed -E 's/.*"generated_ids":\[([^]]*)\].*/\1/' <<<"$json")
  IDS[$be]=$ids
  printf '%-14s %12.3f %12.3f %12.1f\n' "$be" "$(field prefill_ms "$json")" "$(field decode_ms "$json")" \
    "$(field tokens_per_s "$json")"
  if [ -z "$FIRST_IDS" ]; then FIRST_IDS=$ids; elif [ "$ids" != "$FIRST_IDS" ]; then SAME=no; fi
done
echo
if [ "$SAME" = yes ]; then
  echo "generated ids (identical with ${BACKENDS[*]}):"
  echo "  ${FIRST_IDS//,/ }"
else
  echo "generated ids DIFFER between backends:"
  for be in "${BACKENDS[@]}"; do printf '  %-12s %s\n' "$be" "${IDS[$be]//,/ }"; done
fi
echo
echo "generated text (${BACKENDS[0]}, streamed as generated; the weights are random):"
"$MOEKIT" run --quiet --model "$CKPT" --prompt "$PROMPT" --max-new-tokens "$NEW_TOKENS" --min-new-tokens "$NEW_TOKENS" \
  --experts "${BACKENDS[0]}" | sed -n 's/^text           /  /p'
echo
# Several prompts at once (one prefill over all of them, then one experts call per step for every unfinished
# sequence); the demo prompt's tokens must be the ones it gets alone.
BATCH_FILE="$WORK/prompts.txt"
printf '%s\n' "$PROMPT" "Hello" "A longer prompt about routing tokens to experts, one batch at a time" \
  '{"ids": [1, 2, 3]}' >"$BATCH_FILE"
step "generating 4 prompts together (--prompts-file --batch 4) ..."
batch=$("$MOEKIT" run --quiet --model "$CKPT" --prompts-file "$BATCH_FILE" --batch 4 --max-new-tokens "$NEW_TOKENS" \
  --min-new-tokens "$NEW_TOKENS" --experts "${BACKENDS[0]}" --json) || fail "moekit run --prompts-file failed"
batch_ids=$(head -n 1 <<<"$batch" | sed -E 's/.*"generated_ids":\[([^]]*)\].*/\1/')
batch_ms=$(field decode_ms "$(head -n 1 <<<"$batch")")
echo "4 prompts in one batch ($BATCH_FILE, ${BACKENDS[0]}): decode $(awk -v ms="$batch_ms" -v n="$NEW_TOKENS" \
  'BEGIN { printf "%.1f", 4 * (n - 1) * 1000 / ms }') tokens/s in all; the first prompt's tokens are" \
  "$([ "$batch_ids" = "${IDS[${BACKENDS[0]}]}" ] && echo "identical to" || echo "DIFFERENT from") its own run's"
[ "$batch_ids" = "${IDS[${BACKENDS[0]}]}" ] || fail "batched generation gave other tokens than generating alone"
echo
echo "experts backends on this machine (moekit backends):"
"$MOEKIT" backends
[ "$SAME" = yes ] || fail "backends generated different tokens"
