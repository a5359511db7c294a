"""Time to failure on a bug corpus, several kvspec trees side by side.

    python benchmarks/bench_ttf.py --tree after=. --tree before=/tmp/before [--tree old=/tmp/old]
        [--target impl] [--only a,b] [--kind safety] [--seeds 0,1,2] [--budget 20] [--json OUT]

For each patch of the corpus (of ``--kind``, or ``--only``), and each tree in turn
(alternating, so a change in the machine's load hits every tree alike), one process
with ``PYTHONPATH=TREE`` loads the patched target and runs ``run_check`` on each seed
as ``kvspec patches`` does (levels pool and cache round-robin, valid use, ``--budget``
seconds; each trial in a fresh fork of a process that has loaded the target and
imported the search, as ``kvspec patches``' workers are, warmed up by the tree's own
``kvspec.corpus.runner.warm_up`` where it has one; ``BENCH_TTF_WARM=0``: not), with minimization and the repro file switched off: only the search is timed.
Per trial it prints the examples run when the first violation stopped the search
(deterministic for a tree, patch and seed: batches of 25 examples alternate the
levels), the search seconds to it (wall clock, from the search's own start; the
machine's load shows there), and the invariant. A patch a tree's corpus lacks is
skipped for that tree. The summary gives, per tree, the median examples and seconds to
failure over the killed trials, and the trials not killed within the budget.

Works on trees from f8e3ee5 (kvspec.checker) on as well as the current layout
(kvspec.check.search).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = r'''
import json, sys, time
tree, target_name, patch, seeds, budget, level = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), float(sys.argv[5]), sys.argv[6]
import importlib.util, os
import kvspec
for sub in ("impl", "kernels", "stateful"):  # an old tree without kvspec/__init__.py: its own, not the installed ones
    init = os.path.join(tree, sub, "__init__.py")
    if not os.path.isdir(os.path.join(tree, "kvspec", sub)) and os.path.isfile(init):
        spec = importlib.util.spec_from_file_location("kvspec." + sub, init,
                                                      submodule_search_locations=[os.path.dirname(init)])
        mod = importlib.util.module_from_spec(spec)
        sys.modules["kvspec." + sub] = mod
        spec.loader.exec_module(mod)
        setattr(kvspec, sub, mod)
import kvspec.stateful, kvspec.impl
assert kvspec.stateful.__file__.startswith(tree) and kvspec.impl.__file__.startswith(tree), (kvspec.stateful.__file__, tree)
assert all(x.startswith(tree) for x in kvspec.__path__), (kvspec.__path__, tree)
try:
    import kvspec.check.search as S
    S._cut_down = lambda *a, **k: None
    S.write_repro_or_warn = lambda *a, **k: None
    run_check = S.run_check
except ImportError:  # f8e3ee5 and before
    import kvspec.checker as S
    S.minimize_finding = lambda target, config, steps, inv, **k: (steps, None, config)
    S.write_repro = lambda *a, **k: None
    S.run_steps = lambda *a, **k: type("R", (), {"failed": False})()
    run_check = S.run_check
from kvspec.targets.registry import load_target
load_target(target_name)  # as kvspec patches' parent does before it forks a worker per trial
try:
    from kvspec.check import minimize  # noqa: F401
    from kvspec.mc import search as mc_search  # noqa: F401
except ImportError:
    import kvspec.minimize, kvspec.mc  # noqa: F401
try:  # the tree's own parent warm-up, where it has one (kvspec patches does it before forking)
    from kvspec.corpus.runner import warm_up
except ImportError:
    warm_up = None
if warm_up is not None and os.environ.get("BENCH_TTF_WARM", "1") != "0":
    warm_up(target_name)
for seed in seeds:
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # one trial in a fresh fork of the warm parent, as kvspec patches runs it
        os.close(rfd)
        target = load_target(target_name, patch=patch)
        t0 = time.process_time()
        r = run_check(target, target_name, patch=patch, seed=seed, budget=budget, report_dir="/tmp",
                      **({"level": level} if level != "all" else {}))
        f = r.violations[0] if r.violations else None
        os.write(wfd, (json.dumps({"seed": seed, "killed": f is not None, "examples": r.examples,
                                   "seconds": None if f is None else round(f.seconds_to_failure, 4),
                                   "cpu": round(time.process_time() - t0, 4),
                                   "invariant": None if f is None else f.invariant,
                                   "level": None if f is None else f.level}) + "\n").encode())
        os._exit(0)
    os.close(wfd)
    with os.fdopen(rfd) as fh:
        line = fh.read().strip()
    os.waitpid(pid, 0)
    print(line or json.dumps({"seed": seed, "killed": False, "examples": 0, "error": "no result"}), flush=True)
'''


def corpus(tree: Path, target: str) -> dict:
    d = tree / "kvspec" / "corpus" / target
    return {b["id"]: dict(b, path=str(d / b["file"])) for b in json.loads((d / "bugs.json").read_text())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", action="append", required=True, help="NAME=PATH (first: whose corpus lists the patches)")
    ap.add_argument("--target", default="impl")
    ap.add_argument("--only", default="")
    ap.add_argument("--kind", default="safety")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--budget", type=float, default=20.0)
    ap.add_argument("--level", default="all", help="run_check's level (default: all, as kvspec patches)")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    trees = [(n, Path(p).resolve()) for n, p in (t.split("=", 1) for t in a.tree)]
    seeds = [int(s) for s in a.seeds.split(",")]
    corpora = {n: corpus(p, a.target) for n, p in trees}
    first = corpora[trees[0][0]]
    ids = a.only.split(",") if a.only else [i for i, b in first.items()
                                              if b["kind"] == a.kind and b.get("engine", "check") == "check"]
    rows = []
    print(f"{'patch':28} " + " ".join(f"{n + ' ex / s / inv':>44}" for n, _ in trees), flush=True)
    for pid in ids:
        per = {}
        for name, tree in trees:
            if pid not in corpora[name]:
                continue
            env = dict(os.environ, PYTHONPATH=str(tree))
            out = subprocess.run([sys.executable, "-c", CHILD, str(tree), a.target, corpora[name][pid]["path"],
                                  json.dumps(seeds), str(a.budget), a.level], env=env, capture_output=True, text=True,
                                 cwd="/tmp")
            trials = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
            if out.returncode or len(trials) != len(seeds):
                print(f"{pid} {name}: rc {out.returncode}\n{out.stderr[-2000:]}", file=sys.stderr)
            per[name] = trials
            for t in trials:
                rows.append(dict(t, patch=pid, tree=name))
        cells = []
        for name, _ in trees:
            ts = per.get(name)
            if not ts:
                cells.append(f"{'-':>44}")
                continue
            ex = "/".join(str(t["examples"]) if t["killed"] else "x" for t in ts)
            sec = "/".join(f"{t['seconds']:.2f}" if t["killed"] else "x" for t in ts)
            inv = ",".join(sorted({t["invariant"] for t in ts if t["killed"]}))
            cells.append(f"{ex + ' ' + sec + ' ' + inv[:14]:>44}")
        print(f"{pid:28} " + " ".join(cells), flush=True)
    print()
    for name, _ in trees:
        mine = [r for r in rows if r["tree"] == name]
        k = [r for r in mine if r["killed"]]
        if not k:
            continue
        print(f"{name}: {len(k)}/{len(mine)} killed; examples to failure median {statistics.median(r['examples'] for r in k)}"
              f" max {max(r['examples'] for r in k)}; seconds median {statistics.median(r['seconds'] for r in k):.3f}"
              f" max {max(r['seconds'] for r in k):.3f}; within 10 s {sum(r['seconds'] <= 10 for r in k)}/{len(mine)}")
    # paired: on the patches every tree has
    common = [p for p in ids if all(any(r["patch"] == p and r["tree"] == n for r in rows) for n, _ in trees)]
    if len(trees) > 1 and common:
        print(f"on the {len(common)} patches every tree has:")
        for name, _ in trees:
            k = [r for r in rows if r["tree"] == name and r["patch"] in common and r["killed"]]
            if k:
                print(f"  {name}: examples median {statistics.median(r['examples'] for r in k)}, "
                      f"seconds median {statistics.median(r['seconds'] for r in k):.3f}, "
                      f"seconds/example median {statistics.median(r['seconds'] / r['examples'] for r in k):.4f}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
