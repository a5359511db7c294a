#!/usr/bin/env bash
# Would compiling the model checker's hot modules close the gap to TLC (issue 33)?
# Builds a worktree of HEAD, compiles its hot modules with Cython (unchanged source, pure
# Python mode, annotations not enforced), checks that the search finds the same states,
# and counts instructions per transition of both trees (benchmarks/mc_instructions.py).
# Cython is not a kvspec dependency: it goes into its own folder, not the environment.
#
#   bash benchmarks/mc_compiled_trial.sh [CONFIG]    (CONFIG as mc_instructions: pool:4:3:nosym)
set -euo pipefail
root=$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)
config=${1:-pool:4:3:nosym}
work=$(mktemp -d)
trap 'git -C "$root" worktree remove --force "$work/tree" >/dev/null 2>&1 || true; rm -rf "$work"' EXIT
pip install -q --target "$work/cython" "cython==3.3.0"
git -C "$root" worktree add --detach "$work/tree" HEAD >/dev/null
cd "$work/tree"
for sub in impl kernels stateful; do [ -e "kvspec/$sub" ] || ln -s "../$sub" "kvspec/$sub"; done
hot=kvspec/mc/expand.py,kvspec/check/session.py,kvspec/targets/v1_driver.py,kvspec/spec/fast_pool.py
hot=$hot,kvspec/mc/canonical.py,kvspec/mc/fork.py,kvspec/targets/snapshot.py,kvspec/mc/split.py
hot=$hot,kvspec/spec/model/pool.py,impl/block_pool.py,impl/free_queue.py,impl/block.py
hot=$hot,kvspec/targets/watchdog.py,kvspec/mc/budget.py,kvspec/targets/impl_target.py
cat > "$work/setup.py" <<'PY'
import sys
from setuptools import setup
from Cython.Build import cythonize
mods = sys.argv.pop(1).split(",")
setup(ext_modules=cythonize(mods, language_level=3, quiet=True,
                            compiler_directives={"binding": True, "annotation_typing": False}),
      script_args=["build_ext", "--inplace"])
PY
PYTHONPATH="$work/cython" python "$work/setup.py" "$hot" >/dev/null 2>&1
echo "compiled: $(find kvspec impl -name '*.so' | wc -l) modules"
python "$root/benchmarks/mc_instructions.py" --trees "$root,$work/tree" --config "$config" --out "$work/out.md"
# the two trees must have run the same search: equal states and transitions in the table
python - "$work/out.md" <<'PY'
import sys
rows = [line.split("|") for line in open(sys.argv[1]) if line.startswith("| /")]
counts = {(r[3].strip(), r[4].strip()) for r in rows}
if len(rows) != 2 or len(counts) != 1:
    sys.exit(f"mc_compiled_trial: the compiled tree ran another search: {sorted(counts)}")
print(f"same search in both trees: {counts.pop()[0]} states")
PY
