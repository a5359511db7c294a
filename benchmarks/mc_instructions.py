"""Instructions per model-checker transition, counted by valgrind (issue 33): a measure of
the search's speed that does not move with the machine's load.

    python benchmarks/mc_instructions.py [--trees DIR[,DIR...]] [--config pool:4:3:nosym]
                                         [--stages] [--jobs 2] [--out reports/mc_instructions.md]

On these shared 2-core machines a CPU-second figure moves by a quarter between two runs of
the same code (another process on the sibling core slows this one), so a change of a few
percent cannot be seen in it. Instruction counts do not move: each run here is
``model_check`` on target ``impl`` in a fresh interpreter under ``valgrind --tool=cachegrind
--cache-sim=no``, once at depth 0 (start-up, imports, the initial state) and once at the
configured depth; the difference over the transitions is the instructions one transition
costs (the per-state work, the state checks and saving new states, spread over the
transitions at that depth). Instructions are not seconds (a cache miss costs more than an
add), so the report pairs them with the side-by-side CPU-second runs of
``benchmarks/tlc/compare.py``.

``--trees``: the source trees to import, each in its own runs (this checkout by default;
a ``git worktree`` of an older commit to compare with). ``--stages``: what each hot stage
of a transition costs, found by running it twice per transition and counting the increase.
Only stages that can run twice without changing the search are doubled (reading the
target, the fast pool pass, putting a state back, the key memo's hit, one guarded call,
the seen-set probe, the state checks). Needs ``valgrind`` (exit 2 with one line without it).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Run inside each measured interpreter: stage doubling (KVSPEC_DOUBLE), then one search.
CHILD = r"""
import os, sys
stage = os.environ.get("KVSPEC_DOUBLE", "")
# What runs by the wall clock (memory samples, the caps' watch thread, the watchdog's poll)
# would count more instructions the slower the run goes: off, so that a count is the same
# on a loaded machine as on a quiet one. The search itself is unchanged.
import importlib
for _name, _knobs in (("kvspec.mc.budget", ("RSS_EVERY_S", "WATCH_S")), ("kvspec.targets.watchdog", ("POLL_S",)),
                      ("kvspec.check.watchdog", ("POLL_S",))):   # (the last: where an older tree kept it)
    try:
        _mod = importlib.import_module(_name)
    except ImportError:
        continue
    for _knob in _knobs:
        if hasattr(_mod, _knob):
            setattr(_mod, _knob, 1e9)

def twice(owner, name):
    orig = getattr(owner, name)
    def run(*a):
        orig(*a)
        return orig(*a)
    setattr(owner, name, run)

if stage == "observe":
    from kvspec.targets import impl_target
    twice(impl_target.ImplPoolDriver, "observe")
elif stage == "fast_pass":
    from kvspec.spec import fast_pool
    twice(fast_pool, "_clean")
elif stage == "load":
    from kvspec.mc import fork
    twice(fork.CompactFork, "load")
elif stage == "key_hit":
    from kvspec.mc import canonical
    twice(canonical.KeyMemo, "__call__")   # the second call always hits the memo
elif stage == "guarded_call":
    from kvspec.check import session
    orig = session.Session._call
    session.Session._call = lambda self, secs, fn, *a: (orig(self, secs, int), orig(self, secs, fn, *a))[1]
elif stage == "seen_probe":
    from kvspec.mc import fingerprint
    twice(fingerprint.FingerprintSet, "__contains__")
elif stage == "state_checks":
    from kvspec.mc import split
    orig = split.StepChecker.state_violations
    def again(self):
        ctx, found = self.ctx, self.found
        orig(self)
        self.ctx, self.found = ctx, found
        return orig(self)
    split.StepChecker.state_violations = again
elif stage:
    sys.exit(f"unknown stage {stage}")

from kvspec.mc import model_check
from kvspec.mc.enumerate_ops import Bounds
from kvspec.spec.config import Config
from kvspec.targets.registry import load_target
level, blocks, depth, sym = sys.argv[1:5]
r = model_check(load_target("impl"), Config(level=level, num_blocks=int(blocks) + 1), int(depth),
                Bounds(symmetry=sym == "sym"))
print("RESULT", r.states, r.transitions)
"""

STAGES = ["observe", "fast_pass", "load", "key_hit", "guarded_call", "seen_probe", "state_checks"]


def count(tree: Path, config: tuple, depth: int, stage: str = "") -> tuple[int, int, int]:
    """(instructions, states, transitions) of one run."""
    level, blocks, _, sym = config
    env = dict(os.environ, PYTHONPATH=str(tree), KVSPEC_DOUBLE=stage, PYTHONHASHSEED="0")  # (dict order and hash costs alike in every run)
    # setarch -R: no address randomization, so dicts keyed by object ids fill alike in every run
    fixed = ["setarch", os.uname().machine, "-R"] if shutil.which("setarch") else []
    cmd = fixed + ["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null",
           sys.executable, "-c", CHILD, level, str(blocks), str(depth), sym]
    p = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    ir = re.search(r"I\s+refs:\s+([\d,]+)", p.stderr)
    res = re.search(r"RESULT (\d+) (\d+)", p.stdout)
    if p.returncode != 0 or ir is None or res is None:
        raise SystemExit(f"mc_instructions: run failed ({tree}, depth {depth}, stage {stage!r}): "
                         f"{(p.stderr or p.stdout).strip().splitlines()[-1:]}")
    return int(ir.group(1).replace(",", "")), int(res.group(1)), int(res.group(2))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trees", default=str(ROOT))
    ap.add_argument("--config", default="pool:4:3:nosym", help="LEVEL:BLOCKS:DEPTH:sym|nosym")
    ap.add_argument("--stages", action="store_true")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if shutil.which("valgrind") is None:
        print("mc_instructions: needs valgrind on PATH", file=sys.stderr)
        return 2
    level, blocks, depth, sym = a.config.split(":")
    config = (level, int(blocks), int(depth), sym)
    trees = [Path(t).resolve() for t in a.trees.split(",")]
    jobs = [(t, 0, "") for t in trees] + [(t, int(depth), "") for t in trees]
    if a.stages:
        jobs += [(trees[-1], int(depth), s) for s in STAGES]
    with ThreadPoolExecutor(a.jobs) as pool:
        got = dict(zip(jobs, pool.map(lambda j: count(j[0], config, j[1], j[2]), jobs)))
    lines = [f"Command: `python benchmarks/mc_instructions.py --trees {a.trees} --config {a.config}"
             + (" --stages`" if a.stages else "`"), "",
             f"Target impl, {level} level, {blocks} blocks, depth {depth}, symmetry {'on' if sym == 'sym' else 'off'}; "
             "instructions counted by `valgrind --tool=cachegrind` (start-up subtracted: a depth-0 run).", "",
             "| tree | commit | states | transitions | instructions per transition |", "|---|---|---|---|---|"]
    per: dict = {}
    for t in trees:
        base, (ir, states, trans) = got[(t, 0, "")], got[(t, int(depth), "")]
        per[t] = (ir - base[0]) / trans
        lines.append(f"| {t} | {_commit(t)} | {states:,} | {trans:,} | {per[t]:,.0f} |")
    if len(trees) > 1:
        lines += ["", "Ratios (first tree / each): " + ", ".join(f"{per[trees[0]] / per[t]:.3f}" for t in trees[1:])]
    if a.stages:
        t = trees[-1]
        full = got[(t, int(depth), "")][0]
        trans = got[(t, int(depth), "")][2]
        lines += ["", f"Stages of {t} (each run twice per transition; the increase is one run's cost):", "",
                  "| stage | instructions per transition | share |", "|---|---|---|"]
        for s in STAGES:
            extra = (got[(t, int(depth), s)][0] - full) / trans
            lines.append(f"| {s} | {extra:,.0f} | {extra / per[t]:.0%} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        Path(a.out).write_text(text)
    return 0


def _commit(tree: Path) -> str:
    p = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return (p.stdout.strip() or "?") + (" + changes" if dirty else "")


if __name__ == "__main__":
    sys.exit(main())
