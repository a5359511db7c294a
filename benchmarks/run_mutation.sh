#!/usr/bin/env bash
# Mutation testing of impl/ with cosmic-ray; kvspec's stateful machines (and impl's unit
# tests) are the killing suite. tools/mutate.py makes one working copy of impl/ and tests/
# per worker (the checkout's impl/ is never mutated), runs `cosmic-ray init`, `baseline`
# and `exec` with the http distributor (one `cosmic-ray http-worker` per copy), and writes
# reports/mutation.json and reports/mutation.md (raw score, and the score adjusted for the
# survivors judged equivalent in tests/mutation/equivalent.json).
#
#   benchmarks/run_mutation.sh                 # the committed report (about an hour on 2 cores)
#   BUDGET=1 benchmarks/run_mutation.sh --only free_queue.py
#   # kvspec's own checker (see reports/mutation.md, second part, for the committed run):
#   JOBS=1 BUDGET=0.5 benchmarks/run_mutation.sh --module invariants --module minimize --module session \
#       --sample 0.25 --seed 13 --timeout 60
#
# Not part of the default pytest run: cosmic-ray is not a kvspec dependency.
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import cosmic_ray" 2>/dev/null || pip install cosmic-ray==8.7.0
JOBS="${JOBS:-$(nproc)}"
BUDGET="${BUDGET:-2}"
python tools/mutate.py --jobs "$JOBS" --budget "$BUDGET" "$@"
