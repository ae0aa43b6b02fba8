#!/usr/bin/env bash
# The main job on the embedded default: a tiny checkpoint, generation with each backend.
set -euo pipefail
BUILD=${1:-build}
"$BUILD/bin/moekit" backends
