"""``kvspec patches``: measure kvspec's bug-finding power on its bundled bug corpus.

The way the ETNA benchmark measures property-based testing: every (bug, seed) pair
is one trial, run with a timeout, in its own worker process. A trial records whether
the patch applied, whether ``kvspec check`` killed it (found any violation), the
seconds to the first failure (``Finding.seconds_to_failure``: search time only, not
start-up or minimization), the length of the repro after minimization
(``len(Finding.steps)``), and the shortest failing length an exhaustive search can
prove (``Finding.minimal``; where the minimizer could not prove it, a separate
bounded BFS of ``kvspec.mc`` by iterative deepening, see ``shortest_failing``).

Corpus: ``kvspec/corpus/<target>/bugs.json``, a list of ``{"id", "title", "file",
"upstream", "level", "invariants" (primary first), "kind": "safety" | "policy" |
"equivalent", "note"}`` plus, optionally, ``"engine": "diff"`` for a *rare-input*
bug that is expected to be out of random search's reach and caught by ``kvspec diff``
(CrossHair) instead. Equivalent mutants have ``invariants == []``: killing one is a
false positive, i.e. a bug in kvspec.

Exit code: 0 when every safety bug is killed on every seed (a rare-input bug by
``kvspec diff`` or ``kvspec check``) and no equivalent mutant is killed; 1 otherwise;
2 on a usage or target error.

Progress goes to stderr (a live line on a terminal, one line per finished patch
otherwise); ``--json`` prints the run's one JSON object on stdout.

Reports (in ``--report-dir``, default ``reports/``): one combined report for all
targets. ``patches.json`` holds a section per target (that target's latest run, every
trial included); ``patches.md`` (overview, then per target: the command, the summary,
tables for safety, policy, rare-input and equivalent patches, a findings paragraph) and
``patches_ttf.png`` (time to failure per bug, a panel per target) are rendered from
it. A run replaces only its own target's section. ``python -m kvspec.corpus.command
--render [DIR]`` re-renders the markdown and the figure from the JSON.

Targets: any ``kvspec/corpus/<target>/bugs.json`` (impl and vllm ship; nanovllm when its
corpus is there); a target without a corpus is a one-line usage error (exit 2).
"""
from __future__ import annotations

import json
import multiprocessing as mp
import shutil
import tempfile
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any, Optional

CORPUS_ROOT = Path(__file__).resolve().parent
THRESHOLDS = (0.1, 1.0, 10.0, 60.0)
# A worker's hard deadline past its search budget: minimization (ddmin + bounded BFS),
# the shortest-length search below, the repro file, and start-up.
HARD_MARGIN_S = 90.0
MINIMAL_BUDGET_S = 20.0   # the iterative-deepening BFS per trial, when the minimizer proved nothing
MINIMAL_MAX_DEPTH = 12
DIFF_TIMEOUT_S = 10.0     # kvspec diff, per changed helper (per-condition timeout)


# -- the corpus -------------------------------------------------------------------------
def load_corpus(target: str) -> tuple[Path, list[dict]]:
    from kvspec.errors import UsageError

    d = CORPUS_ROOT / target
    f = d / "bugs.json"
    if not f.is_file():
        have = sorted(p.parent.name for p in CORPUS_ROOT.glob("*/bugs.json"))
        raise UsageError(f"kvspec patches: no bug corpus for target {target}: {f} does not exist "
                         f"(corpora here: {', '.join(have) or 'none'})")
    try:
        bugs = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise UsageError(f"kvspec patches: {f}: not valid JSON: {e}") from None
    for b in bugs:
        missing = {"id", "file", "kind", "invariants"} - set(b)
        if missing:
            raise UsageError(f"kvspec patches: {f}: entry {b.get('id', '?')} lacks {', '.join(sorted(missing))}")
        b.setdefault("engine", "check")
    return d, bugs


# -- one trial, in a worker process -------------------------------------------------------
def shortest_failing(target, config, steps, invariant: str, budget_s: float = MINIMAL_BUDGET_S
                     ) -> tuple[Optional[int], bool]:
    """(length, proven): the shortest failing sequence with ``invariant`` that
    ``kvspec.mc`` finds on the pools of the finding's level and block size up to the
    finding's pool, by the minimizer's iterative deepening with this runner's budget:
    first over mc's default domains, then (if those hold nothing as short) over them
    widened by the repro's own arguments (``Bounds.widened``: its prompts, tokens, extra
    keys, chunks, drafts...), so a repro outside mc's vocabulary is never called minimal
    just because nothing in that vocabulary fails. ``proven`` is True only when every
    shallower search ran to completion without a failure."""
    from kvspec.check.minimize import _smaller_configs, bounds_fors, deepening_search

    pools = _smaller_configs(config, target.traits.null_block)
    depth = min(len(steps), MINIMAL_MAX_DEPTH)
    fors = bounds_fors(steps, config)
    start = time.monotonic()
    for i, bounds_for in enumerate(fors):
        # mc's own domains get half the budget when widened ones follow, so that a repro mc
        # cannot express (a cap past its longest prompt) is not left without time
        share = budget_s / 2 if i == 0 and len(fors) > 1 else budget_s
        found, _, complete = deepening_search(target, pools, depth, invariant,
                                              min(time.monotonic() + share, start + budget_s), bounds_for)
        if found is not None:
            return len(found), complete
    return None, False


def warm_up(target_spec: str, kv_groups: Optional[str] = None) -> None:
    """Do once, in the parent before it forks the workers, what each trial's search
    otherwise does first in its cold process, on the clock: import the machines
    (``kvspec.stateful``), build Hypothesis's state-machine test and strategies, seed and
    register its PRNGs (importing numpy's, with a ``gc.collect``), digest the test's
    source. One batch of one example per level (pool and cache) on the unpatched
    target, its outcome ignored: about 0.2 s of every trial's time to failure on this
    machine (benchmarks/bench_ttf.py, 2026-11-29), where most bugs take under 0.5 s. The
    draws do not depend on it (every batch is seeded)."""
    from kvspec.check.search import LevelSearch
    from kvspec.targets.registry import load_target

    target = load_target(target_spec)
    for level in target.traits.levels:
        if level not in ("pool", "cache"):
            continue
        try:
            LevelSearch(target, level, misuse=False, seed=0, kv_groups=kv_groups).run_batch(1)
        except Exception:  # best effort: a trial that needs it pays for it itself, as before
            pass


def run_trial(task: dict) -> dict:
    """One (patch, seed) pair: load the patched target, ``run_check`` with
    ``budget=timeout``, report what it found. Runs inside the worker process."""
    from kvspec.check.search import run_check
    from kvspec.targets.registry import load_target

    row: dict[str, Any] = {"id": task["id"], "seed": task["seed"], "applied": False, "killed": False,
                           "invariant": None, "also": [], "seconds_to_failure": None, "shrunk_steps": None,
                           "repro_steps": None, "minimal_steps": None, "minimal_proven": False,
                           "config": None, "error": None, "wall_seconds": None}
    t0 = time.monotonic()
    report_dir = tempfile.mkdtemp(prefix="kvspec-patches-")
    try:
        try:
            target = load_target(task["target"], patch=task["patch"])
        except Exception as e:  # a patch that does not apply is a result, not a crash
            row["error"] = f"{type(e).__name__}: {e}"
            return row
        row["applied"] = True
        patch_text = Path(task["patch"]).read_text()
        report = run_check(target, task["target"], patch=task["patch"], patch_text=patch_text, level=task.get("level", "all"),
                           seed=task["seed"], budget=task["timeout"], report_dir=report_dir,
                           kv_groups=task.get("kv_groups"))
        if report.violations:
            f = report.violations[0]
            row.update(killed=True, invariant=f.invariant,
                       also=sorted({v.invariant for v in f.violations[1:]} - {f.invariant}),
                       seconds_to_failure=f.seconds_to_failure, shrunk_steps=f.shrunk_steps,
                       repro_steps=len(f.steps), config=f.config.to_dict(), level=f.level)
            if f.minimal:
                row.update(minimal_steps=len(f.steps), minimal_proven=True)
            elif task.get("minimal", True) and f.level != "engine":  # mc searches cache/pool ops only
                n, proven = shortest_failing(target, f.config, f.steps, f.invariant)
                row.update(minimal_steps=n, minimal_proven=proven)
        row["examples"] = report.examples
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {e}"
        row["traceback"] = traceback.format_exc(limit=5)
    finally:
        row["wall_seconds"] = round(time.monotonic() - t0, 3)
        shutil.rmtree(report_dir, ignore_errors=True)
    return row


def run_diff_task(task: dict) -> dict:
    """``kvspec diff`` on one patch (impl only), inside a worker."""
    from kvspec.check.crosshair import diff_patch

    try:
        res = diff_patch(task["patch"], task["per_condition_timeout"])
        return {"id": task["id"], "diff": {"verdict": res["verdict"], "seconds": res["seconds"],
                                           "differences": res["differences"][:2],
                                           "functions": [{k: c[k] for k in ("function", "verdict")}
                                                         for c in res["functions"]]}}
    except Exception as e:
        return {"id": task["id"], "diff": {"verdict": "error", "error": f"{type(e).__name__}: {e}"}}


def _child(conn, fn_name: str, task: dict, tmp_root: str) -> None:
    from kvspec.targets import patched

    # Everything this worker writes goes under tmp_root, which the parent removes even
    # when it has to kill the worker; the patched copies go to a directory of its own.
    tempfile.tempdir = tmp_root
    patched.use_own_tmp_dir()
    try:
        res = globals()[fn_name](task)
    except BaseException as e:  # report, never hang the parent
        res = {"id": task.get("id"), "error": f"{type(e).__name__}: {e}"}
    try:
        conn.send(res)
    finally:
        conn.close()
        patched.remove_tmp_dir()


# -- the pool of worker processes ---------------------------------------------------------
@dataclass
class _Running:
    proc: Any
    conn: Any
    task: dict
    fn: str
    deadline: float
    limit: float


def _context():
    # fork where available: the workers inherit the imported modules (Hypothesis, kvspec,
    # the target's package), so a trial starts in milliseconds. The parent starts no
    # threads before forking.
    methods = mp.get_all_start_methods()
    return mp.get_context("fork" if "fork" in methods else "spawn")


def run_pool(jobs: list[tuple[str, dict, float]], n_workers: int, on_done=None) -> list[dict]:
    """Run ``(function name, task, hard limit seconds)`` jobs, ``n_workers`` at a time,
    each in its own process; a job past its hard limit is killed and reported so."""
    ctx = _context()
    pending = list(jobs)
    running: list[_Running] = []
    results: list[dict] = []
    tmp_root = tempfile.mkdtemp(prefix="kvspec-patches-run-")
    try:
        while pending or running:
            while pending and len(running) < n_workers:
                fn, task, limit = pending.pop(0)
                parent, child = ctx.Pipe(duplex=False)
                p = ctx.Process(target=_child, args=(child, fn, task, tmp_root), daemon=True)
                p.start()
                child.close()
                running.append(_Running(p, parent, task, fn, time.monotonic() + limit, limit))
            ready = wait([r.conn for r in running] + [r.proc.sentinel for r in running], timeout=0.2)
            now = time.monotonic()
            for r in list(running):
                res = None
                if r.conn in ready or r.proc.sentinel in ready:
                    try:
                        if r.conn.poll():
                            res = r.conn.recv()
                    except (EOFError, OSError):
                        res = None
                    if res is None and r.proc.is_alive() and now <= r.deadline:
                        continue  # sentinel not yet set, or no data yet
                    if res is None:
                        res = _failed(r, f"worker exited with code {r.proc.exitcode} and no result")
                elif now > r.deadline:
                    r.proc.kill()
                    res = _failed(r, f"killed by the runner at its hard limit of {r.limit:.0f} s")
                    res["timed_out"] = True
                else:
                    continue
                r.proc.join(timeout=5)
                r.conn.close()
                running.remove(r)
                res.setdefault("id", r.task.get("id"))
                res["_fn"] = r.fn
                if "seed" in r.task:
                    res.setdefault("seed", r.task["seed"])
                results.append(res)
                if on_done:
                    on_done(res, len(results), len(jobs))
    finally:
        for r in running:
            r.proc.kill()
            r.proc.join(timeout=5)
        shutil.rmtree(tmp_root, ignore_errors=True)
    return results


def _failed(r: _Running, why: str) -> dict:
    if r.fn == "run_diff_task":
        return {"id": r.task["id"], "diff": {"verdict": "error", "error": why}}
    return {"id": r.task["id"], "seed": r.task["seed"], "applied": None, "killed": False, "invariant": None,
            "also": [], "seconds_to_failure": None, "shrunk_steps": None, "repro_steps": None,
            "minimal_steps": None, "minimal_proven": False, "config": None, "error": why}
