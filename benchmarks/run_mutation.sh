#!/usr/bin/env bash
# Mutation testing of impl/ with kvspec's stateful machines as the killing suite.
# tools/mutate.py generates AST-located mutants of impl/*.py, applies each through the
# patched-import path kvspec uses for --patch, and kills it by: import failure, then
# kvspec's machines (pool + cache level, valid use and misuse, BUDGET s each, seed 0),
# then `pytest tests/mutation/test_kill.py` + impl's unit tests with the mutant swapped
# in for kvspec.impl. Writes reports/mutation.json; reports/mutation.md is its reading
# (raw score, and the score adjusted for the survivors judged equivalent).
set -euo pipefail
cd "$(dirname "$0")/.."
JOBS="${JOBS:-$(nproc)}"
BUDGET="${BUDGET:-2}"
python tools/mutate.py --jobs "$JOBS" --budget "$BUDGET" --out reports/mutation.json "$@"
