#!/usr/bin/env bash
# The foundation issue's benchmark: for each of the ten self-test bug patches of impl
# (those marked "foundation": true in kvspec/corpus/impl/bugs.json), the seconds to the
# first failure (median of 5 seeds) and the shrunk step count. Output:
# reports/foundation/patches.{md,json} and patches_ttf.png.
#
#   benchmarks/run_foundation.sh            # 5 seeds, 30 s per trial (the committed report)
#   SEEDS=2 benchmarks/run_foundation.sh
set -euo pipefail
cd "$(dirname "$0")/.."
SEEDS="${SEEDS:-5}"
TIMEOUT="${TIMEOUT:-30}"
JOBS="${JOBS:-1}"   # one trial at a time: times to failure are the point here
ONLY=$(python -c "import json; print(','.join(b['id'] for b in json.load(open('kvspec/corpus/impl/bugs.json')) if b.get('foundation')))")
mkdir -p reports/foundation
start=$(date +%s)
kvspec patches --target impl --only "$ONLY" --seeds "$SEEDS" --timeout "$TIMEOUT" --jobs "$JOBS" --report-dir reports/foundation "$@"
echo "wall time $(( $(date +%s) - start )) s on $(nproc) cores"
