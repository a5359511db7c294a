#!/usr/bin/env bash
# Measure kvspec's bug-finding power on the bundled corpora (ETNA-style: every
# (patch, seed) pair is one trial with a timeout) and write the combined report:
# reports/patches.md, reports/patches.json and reports/patches_ttf.png, one section per
# target (a run replaces its own target's section).
#
#   benchmarks/run_patches.sh                       # impl, vllm, nanovllm: 10 seeds, 60 s (the committed report)
#   TARGETS=impl SEEDS=2 TIMEOUT=20 benchmarks/run_patches.sh   # a CI-sized run
#   CAMPAIGN=1 benchmarks/run_patches.sh            # the same matrix through `kvspec campaign` (PER_JOB=N patches
#                                                   # per Ray task, default 1: one task per patch, a slow patch's
#                                                   # seeds one task each; SEEDS_PER_JOB=N: every patch's seeds in
#                                                   # tasks of N instead; each task forked from
#                                                   # its Ray worker's warm kvspec process; CAMPAIGN_WARM=false: a
#                                                   # fresh process per task; RAY_ADDRESS=HEAD:6379 for a cluster;
#                                                   # resumable from RESULTS, default kvspec-campaign/run-patches),
#                                                   # same report. benchmarks/bench_campaign_vs_jobs.sh compares both.
#   REPORT_DIR=DIR ...                              # write the report there instead of reports/
# benchmarks/campaigns/patches.toml is the default run as a campaign file.
set -euo pipefail
cd "$(dirname "$0")/.."
TARGETS="${TARGETS:-impl vllm nanovllm}"
SEEDS="${SEEDS:-10}"
TIMEOUT="${TIMEOUT:-60}"
JOBS="${JOBS:-$(nproc)}"
REPORT_DIR="${REPORT_DIR:-reports}"
rc=0
if [ "${CAMPAIGN:-0}" != 0 ]; then
  if [ "$#" -gt 0 ]; then
    echo "run_patches.sh: CAMPAIGN=1 takes no extra kvspec patches options (got: $*); edit a campaign file instead" >&2
    exit 2
  fi
  RESULTS="${RESULTS:-kvspec-campaign/run-patches}"
  mkdir -p "$RESULTS"
  toml="$RESULTS/run_patches.toml"
  if [ -n "${SEEDS_PER_JOB:-}" ]; then split="seeds_per_job = $SEEDS_PER_JOB"; else split="per_job = ${PER_JOB:-1}"; fi
  { printf '[campaign]\nname = "run-patches"\npatches_report = "%s"\nwarm = %s\n' "$REPORT_DIR" "${CAMPAIGN_WARM:-true}"
    for target in $TARGETS; do
      printf '\n[[matrix]]\ncommand = "patches"\ntarget = "%s"\nonly = "each"\n%s\nseeds = %s\ntimeout = %s\n' \
        "$target" "$split" "$SEEDS" "$TIMEOUT"
    done; } > "$toml"
  start=$(date +%s)
  set +e
  kvspec campaign "$toml" --results "$RESULTS" ${RAY_ADDRESS:+--address "$RAY_ADDRESS"}
  rc=$?
  set -e
  echo "campaign --targets $TARGETS: wall time $(( $(date +%s) - start )) s on $(nproc) cores (exit $rc)"
  exit $rc
fi
for target in $TARGETS; do
  start=$(date +%s)
  set +e
  kvspec patches --target "$target" --seeds "$SEEDS" --timeout "$TIMEOUT" --jobs "$JOBS" --report-dir "$REPORT_DIR" "$@"
  r=$?
  set -e
  echo "--target $target: wall time $(( $(date +%s) - start )) s on $(nproc) cores (exit $r)"
  [ "$r" -gt "$rc" ] && rc=$r
done
exit $rc
