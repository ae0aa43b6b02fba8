#!/bin/sh
# The CLI's output files: `moekit --version`; `bench --json -` writes the JSON alone to standard output; a
# --json path that is a FIFO is written in place, not renamed over; a regular file is replaced whole.
# usage: cli_output_test.sh MOEKIT WORKDIR
set -eu
moekit=$1
work=$2
rm -rf "$work" && mkdir -p "$work"
bench() { "$moekit" bench --dims 32,16,4,2 --tokens 1 --backends eager --quiet --iters 1 --min-iters 1 \
  --min-time 0 --peak-tflops 1 --bandwidth-gbps 1 "$@"; }

"$moekit" --version | grep -Eq '^moekit [0-9]+\.[0-9]+\.[0-9]+$' || { echo "FAIL: moekit --version"; exit 1; }

bench --json - 2>/dev/null >"$work/stdout.json"
head -c 1 "$work/stdout.json" | grep -q '{' || { echo "FAIL: --json - does not start with the JSON"; exit 1; }
tail -n 2 "$work/stdout.json" | grep -q '^}' || { echo "FAIL: --json - has more than the JSON"; exit 1; }

mkfifo "$work/fifo"
cat "$work/fifo" >"$work/from_fifo.json" &
reader=$!
# One open of the FIFO for the whole report: a second open after the reader has gone would block.
timeout 60 "$moekit" bench --dims 32,16,4,2 --tokens 1,2 --backends eager --quiet --iters 1 --min-iters 1 \
  --min-time 0 --peak-tflops 1 --bandwidth-gbps 1 --json "$work/fifo" >/dev/null 2>&1 ||
  { kill $reader 2>/dev/null; echo "FAIL: bench --json FIFO"; exit 1; }
wait $reader
[ -p "$work/fifo" ] || { echo "FAIL: the FIFO was replaced"; exit 1; }
[ "$(grep -c "\"records\"" "$work/from_fifo.json")" = 1 ] || { echo "FAIL: not one report through the FIFO"; exit 1; }
[ ! -e "$work/fifo.tmp" ] || { echo "FAIL: a temporary file was left"; exit 1; }

bench --json "$work/out.json" >/dev/null 2>&1
grep -q '"records"' "$work/out.json" || { echo "FAIL: --json FILE"; exit 1; }
[ ! -e "$work/out.json.tmp" ] || { echo "FAIL: a temporary file was left"; exit 1; }
echo "cli output OK"
