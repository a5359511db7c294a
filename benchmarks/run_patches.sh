#!/usr/bin/env bash
# Measure kvspec's bug-finding power on the bundled corpora (ETNA-style: every
# (patch, seed) pair is one trial with a timeout) and write the combined report:
# reports/patches.md, reports/patches.json and reports/patches_ttf.png, one section per
# target (a run replaces its own target's section).
#
#   benchmarks/run_patches.sh                       # impl, vllm, nanovllm: 10 seeds, 60 s (the committed report)
#   TARGETS=impl SEEDS=2 TIMEOUT=20 benchmarks/run_patches.sh   # a CI-sized run
set -euo pipefail
cd "$(dirname "$0")/.."
TARGETS="${TARGETS:-impl vllm nanovllm}"
SEEDS="${SEEDS:-10}"
TIMEOUT="${TIMEOUT:-60}"
JOBS="${JOBS:-$(nproc)}"
rc=0
for target in $TARGETS; do
  start=$(date +%s)
  set +e
  kvspec patches --target "$target" --seeds "$SEEDS" --timeout "$TIMEOUT" --jobs "$JOBS" --report-dir reports "$@"
  r=$?
  set -e
  echo "--target $target: wall time $(( $(date +%s) - start )) s on $(nproc) cores (exit $r)"
  [ "$r" -gt "$rc" ] && rc=$r
done
exit $rc
