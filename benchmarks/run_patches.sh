#!/usr/bin/env bash
# Measure kvspec's bug-finding power on the bundled corpus (ETNA-style: every
# (patch, seed) pair is one trial with a timeout) and write reports/patches.{md,json}
# and reports/time_to_failure.png.
#
#   benchmarks/run_patches.sh                 # the committed report: 10 seeds, 60 s
#   SEEDS=2 TIMEOUT=20 benchmarks/run_patches.sh   # the CI-sized run
#   TARGET=vllm benchmarks/run_patches.sh     # reports/patches_vllm.*
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET="${TARGET:-impl}"
SEEDS="${SEEDS:-10}"
TIMEOUT="${TIMEOUT:-60}"
JOBS="${JOBS:-$(nproc)}"
start=$(date +%s)
set +e
kvspec patches --target "$TARGET" --seeds "$SEEDS" --timeout "$TIMEOUT" --jobs "$JOBS" --report-dir reports "$@"
rc=$?
set -e
echo "wall time: $(( $(date +%s) - start )) s on $(nproc) cores (exit $rc)"
exit $rc
