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
it. A run replaces only its own target's section. ``python -m kvspec.corpus_runner
--render [DIR]`` re-renders the markdown and the figure from the JSON.

Targets: any ``kvspec/corpus/<target>/bugs.json`` (impl and vllm ship; nanovllm when its
corpus is there); a target without a corpus is a one-line usage error (exit 2).
"""
from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any, Optional

CORPUS_ROOT = Path(__file__).resolve().parent / "corpus"
THRESHOLDS = (0.1, 1.0, 10.0, 60.0)
# A worker's hard deadline past its search budget: minimization (ddmin + bounded BFS),
# the shortest-length search below, the repro file, and start-up.
HARD_MARGIN_S = 90.0
MINIMAL_BUDGET_S = 20.0   # the iterative-deepening BFS per trial, when the minimizer proved nothing
MINIMAL_MAX_DEPTH = 12
DIFF_TIMEOUT_S = 10.0     # kvspec diff, per changed helper (per-condition timeout)


# -- the corpus -------------------------------------------------------------------------
def load_corpus(target: str) -> tuple[Path, list[dict]]:
    from .cli import UsageError

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
    ``kvspec.mc`` (its default domains) finds on the pools of the finding's level and
    block size up to the finding's pool, by the minimizer's iterative deepening with
    this runner's budget. ``proven`` is True only when every shallower search ran to
    completion without a failure."""
    from .minimize import _smaller_configs, deepening_search

    pools = _smaller_configs(config, target.traits.null_block)
    found, _, complete = deepening_search(target, pools, min(len(steps), MINIMAL_MAX_DEPTH), invariant,
                                          time.monotonic() + budget_s)
    if found is not None:
        return len(found), complete
    return (len(steps), True) if complete else (None, False)


def run_trial(task: dict) -> dict:
    """One (patch, seed) pair: load the patched target, ``run_check`` with
    ``budget=timeout``, report what it found. Runs inside the worker process."""
    from .checker import run_check
    from .targets.registry import load_target

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
        report = run_check(target, task["target"], patch=task["patch"], patch_text=patch_text, level="all",
                           seed=task["seed"], budget=task["timeout"], report_dir=report_dir)
        if report.violations:
            f = report.violations[0]
            row.update(killed=True, invariant=f.invariant,
                       also=sorted({v.invariant for v in f.violations[1:]} - {f.invariant}),
                       seconds_to_failure=f.seconds_to_failure, shrunk_steps=f.shrunk_steps,
                       repro_steps=len(f.steps), config=f.config.to_dict(), level=f.level)
            if f.minimal:
                row.update(minimal_steps=len(f.steps), minimal_proven=True)
            elif task.get("minimal", True):
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
    from .crosshair_diff import diff_patch

    try:
        res = diff_patch(task["patch"], task["per_condition_timeout"])
        return {"id": task["id"], "diff": {"verdict": res["verdict"], "seconds": res["seconds"],
                                           "differences": res["differences"][:2],
                                           "functions": [{k: c[k] for k in ("function", "verdict")}
                                                         for c in res["functions"]]}}
    except Exception as e:
        return {"id": task["id"], "diff": {"verdict": "error", "error": f"{type(e).__name__}: {e}"}}


def _child(conn, fn_name: str, task: dict, tmp_root: str) -> None:
    from .targets import patched

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


# -- aggregation ---------------------------------------------------------------------------
def _median(xs: list[float]) -> Optional[float]:
    return statistics.median(xs) if xs else None


def _quantile(xs: list[float], q: float) -> Optional[float]:
    if not xs:
        return None
    s = sorted(xs)
    k = max(0, math.ceil(q * len(s)) - 1)  # nearest rank
    return s[k]


def _r(x: Optional[float], nd: int = 3) -> Optional[float]:
    return None if x is None else round(x, nd)


def patch_row(bug: dict, trials: list[dict], diff: Optional[dict]) -> dict:
    killed = [t for t in trials if t["killed"]]
    ttf = [t["seconds_to_failure"] for t in killed if t["seconds_to_failure"] is not None]
    found: dict[str, int] = {}
    for t in killed:
        found[t["invariant"]] = found.get(t["invariant"], 0) + 1
    ratios = [t["repro_steps"] / t["minimal_steps"] for t in killed
              if t["minimal_proven"] and t["minimal_steps"]]
    expected = bug["invariants"]
    caught_by = []
    if killed:
        caught_by.append("check")
    if diff and diff.get("verdict") == "different":
        caught_by.append("diff")
    return {
        "id": bug["id"], "title": bug.get("title", ""), "kind": bug["kind"], "level": bug.get("level"),
        "engine": bug.get("engine", "check"), "upstream": bug.get("upstream"), "expected": expected,
        "applied": all(t["applied"] for t in trials) if trials else None,
        "seeds": len(trials), "killed": round(len(killed) / len(trials), 3) if trials else 0.0,
        "kills": len(killed),
        "seconds_to_failure": _r(_median(ttf)), "seconds_to_failure_p90": _r(_quantile(ttf, 0.9)),
        "repro_steps": _median([t["repro_steps"] for t in killed]),
        "minimal_steps": _median([t["minimal_steps"] for t in killed if t["minimal_steps"] is not None]),
        "minimal_proven": sum(1 for t in killed if t["minimal_proven"]),
        "repro_over_minimal": _r(_median(ratios), 2),
        "found": found,
        "expected_found": (sum(n for inv, n in found.items() if inv in expected) / len(killed)) if killed and expected else None,
        "primary_found": (found.get(expected[0], 0) / len(killed)) if killed and expected else None,
        "errors": sorted({t["error"] for t in trials if t.get("error")}),
        "diff": diff, "caught_by": caught_by,
    }


def _class_summary(rows: list[dict], trials: list[dict], timeout: float) -> dict:
    ids = {r["id"] for r in rows}
    ts = [t for t in trials if t["id"] in ids]
    killed = [t for t in ts if t["killed"]]
    ttf = [t["seconds_to_failure"] for t in killed if t["seconds_to_failure"] is not None]
    ratios = [t["repro_steps"] / t["minimal_steps"] for t in killed if t["minimal_proven"] and t["minimal_steps"]]
    return {
        "bugs": len(rows), "trials": len(ts), "solved": len(killed),
        "solve_rate": round(len(killed) / len(ts), 4) if ts else None,
        "bugs_killed_every_seed": sum(1 for r in rows if r["seeds"] and r["kills"] == r["seeds"]),
        "bugs_killed_any_seed": sum(1 for r in rows if r["kills"]),
        "solved_within": {f"{t:g}": sum(1 for x in ttf if x <= t) for t in THRESHOLDS if t <= max(timeout, THRESHOLDS[0])},
        "median_seconds_to_failure": _r(_median(ttf)), "p90_seconds_to_failure": _r(_quantile(ttf, 0.9)),
        "max_seconds_to_failure": _r(max(ttf) if ttf else None),
        "median_repro_steps": _median([t["repro_steps"] for t in killed]),
        "median_minimal_steps": _median([t["minimal_steps"] for t in killed if t["minimal_steps"] is not None]),
        "median_repro_over_minimal": _r(_median(ratios), 2),
        "mean_repro_over_minimal": _r(statistics.fmean(ratios) if ratios else None, 2),
        "minimal_proven": f"{len(ratios)}/{len(killed)}",
    }


def summarize(target: str, bugs: list[dict], trials: list[dict], diffs: dict[str, dict], args_d: dict,
              wall: float) -> dict:
    by_id: dict[str, list[dict]] = {}
    for t in trials:
        by_id.setdefault(t["id"], []).append(t)
    rows = [patch_row(b, sorted(by_id.get(b["id"], []), key=lambda t: t["seed"]), diffs.get(b["id"])) for b in bugs]
    safety = [r for r in rows if r["kind"] == "safety" and r["engine"] != "diff"]
    rare = [r for r in rows if r["kind"] == "safety" and r["engine"] == "diff"]
    policy = [r for r in rows if r["kind"] == "policy"]
    equiv = [r for r in rows if r["kind"] == "equivalent"]
    timeout = args_d["timeout"]
    fp = [r for r in equiv if r["kills"]]
    safety_ok = all(r["kills"] == r["seeds"] and r["seeds"] for r in safety)
    rare_ok = all(r["caught_by"] for r in rare)
    summary = {
        "safety": _class_summary(safety, trials, timeout),
        "policy": _class_summary(policy, trials, timeout),
        "rare_input": {"bugs": len(rare), "caught_by_check": sum(1 for r in rare if "check" in r["caught_by"]),
                       "caught_by_diff": sum(1 for r in rare if "diff" in r["caught_by"]),
                       "ids": [r["id"] for r in rare]},
        "equivalent": {"mutants": len(equiv), "killed": len(fp),
                       "false_positives": f"{len(fp)}/{len(equiv)}", "killed_ids": [r["id"] for r in fp]},
        "expected_invariant_rate": _r(_ratio(sum(r["kills"] * (r["expected_found"] or 0) for r in safety + policy),
                                             sum(r["kills"] for r in safety + policy)), 4),
        "patches_not_applied": [r["id"] for r in rows if r["applied"] is False],
        "all_safety_killed": safety_ok and rare_ok,
        "wall_seconds": round(wall, 1),
    }
    return {"command": "patches", "target": target, "seeds": args_d["seeds"], "timeout": timeout,
            "jobs": args_d["jobs"], "patches": rows, "summary": summary, "trials": trials,
            "verdict": "pass" if (safety_ok and rare_ok and not fp) else "fail"}


def _ratio(a: float, b: float) -> Optional[float]:
    return a / b if b else None


# -- reports ----------------------------------------------------------------------------
# One report for every corpus: ``patches.json`` holds one section per target (the
# result object of that target's latest run, trials included), and ``patches.md`` and
# ``patches_ttf.png`` are rendered from it. A run replaces its own target's section and
# leaves the others as they were, so the impl and vllm runs can be made separately.
REPORT_JSON, REPORT_MD, REPORT_PNG = "patches.json", "patches.md", "patches_ttf.png"
TARGET_ORDER = ("impl", "vllm", "nanovllm")


def _fmt(x, nd=2, dash="-") -> str:
    if x is None:
        return dash
    if isinstance(x, float):
        return f"{x:.{nd}f}" if x < 100 else f"{x:.0f}"
    return str(x)


def _pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _target_key(t: str) -> tuple[int, str]:
    return (TARGET_ORDER.index(t) if t in TARGET_ORDER else len(TARGET_ORDER), t)


def load_report(report_dir: str | Path) -> dict:
    """The combined report in ``report_dir`` (an empty one when there is none yet)."""
    f = Path(report_dir) / REPORT_JSON
    try:
        doc = json.loads(f.read_text())
    except (OSError, ValueError):
        return {"report": "kvspec patches", "targets": {}}
    if not isinstance(doc, dict) or not isinstance(doc.get("targets"), dict):
        return {"report": "kvspec patches", "targets": {}}
    return doc


def write_reports(res: dict, report_dir: str) -> list[str]:
    """Put ``res`` (one run) in the combined report as its target's section, render it."""
    doc = load_report(report_dir)
    doc["targets"][res["target"]] = {k: v for k, v in res.items() if k != "reports"}
    return render_reports(doc, report_dir)


def render_reports(doc: dict, report_dir: str) -> list[str]:
    d = Path(report_dir)
    d.mkdir(parents=True, exist_ok=True)
    doc["targets"] = dict(sorted(doc["targets"].items(), key=lambda kv: _target_key(kv[0])))
    (d / REPORT_JSON).write_text(json.dumps(doc, indent=1, default=str) + "\n")
    written = [str(d / REPORT_JSON)]
    png = _figure(doc, d / REPORT_PNG)
    if png:
        written.append(png)
    (d / REPORT_MD).write_text(markdown(doc, REPORT_PNG if png else None))
    written.append(str(d / REPORT_MD))
    return written


def _class_lines(name: str, s: dict, timeout: float) -> list[str]:
    if not s["bugs"]:
        return [f"- **{name}**: none in this corpus."]
    within = ", ".join(f"{v}/{s['trials']} within {k} s" for k, v in s["solved_within"].items())
    return [
        f"- **{name}** ({s['bugs']} bugs x seeds = {s['trials']} trials): solve rate "
        f"**{_pct(s['solve_rate'] or 0)}** ({s['solved']}/{s['trials']}) within {timeout:g} s; "
        f"{s['bugs_killed_every_seed']}/{s['bugs']} bugs killed on every seed.",
        f"  - solved {within}.",
        f"  - time to failure: median {_fmt(s['median_seconds_to_failure'], 3)} s, p90 {_fmt(s['p90_seconds_to_failure'], 3)} s, "
        f"max {_fmt(s['max_seconds_to_failure'], 3)} s.",
        f"  - repro length: median {_fmt(s['median_repro_steps'])} steps; shortest possible (BFS) median "
        f"{_fmt(s['median_minimal_steps'])}; repro/minimal median **{_fmt(s['median_repro_over_minimal'])}**, "
        f"mean {_fmt(s['mean_repro_over_minimal'])} (over the {s['minimal_proven']} trials whose minimal length was "
        f"proven and is at least one step).",
    ]


def _overview(doc: dict) -> list[str]:
    out = ["| target | command | patches: safety / policy / rare input / equivalent | safety solved | "
           "safety solved within 0.1 / 1 / 10 / 60 s | safety ttf median / p90 s | safety repro/minimal median | "
           "policy solved | rare input caught by | equivalent mutants killed (false positives) | wall |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for t, res in doc["targets"].items():
        s = res["summary"]
        saf, pol, rare, eq = s["safety"], s["policy"], s["rare_input"], s["equivalent"]
        within = " / ".join(str(saf["solved_within"].get(f"{x:g}", "-")) for x in THRESHOLDS)
        caught = ("-" if not rare["bugs"] else
                  f"check {rare['caught_by_check']}/{rare['bugs']}, diff {rare['caught_by_diff']}/{rare['bugs']}")
        out.append(
            f"| {t} | `{res['command']}` | {saf['bugs']} / {pol['bugs']} / {rare['bugs']} / {eq['mutants']} | "
            f"{_pct(saf['solve_rate'])} ({saf['solved']}/{saf['trials']}) | {within} (of {saf['trials']}) | "
            f"{_fmt(saf['median_seconds_to_failure'], 3)} / {_fmt(saf['p90_seconds_to_failure'], 3)} | "
            f"{_fmt(saf['median_repro_over_minimal'])} | {_pct(pol['solve_rate'])} ({pol['solved']}/{pol['trials']}) | "
            f"{caught} | {eq['false_positives']} | {s['wall_seconds']:.0f} s |")
    return out


def markdown(doc: dict, png: Optional[str]) -> str:
    targets = doc["targets"]
    out = ["# kvspec patches: bug-finding power on the bundled bug corpora", "",
           "Generated by `kvspec patches` (one section per target below, each with the exact command that produced "
           "it; a run rewrites its own target's section of this file, of `patches.json` and of `patches_ttf.png`).", "",
           "**Method** (as the ETNA benchmark measures property-based testing): every (patch, seed) pair is one trial, "
           "run in its own process with a timeout. A trial applies the patch to a temporary copy of the target's "
           "sources and runs `kvspec check` on it (`run_check`: pool and cache level round-robin, valid use, "
           "`--seed` = the trial's seed, `--budget` = the timeout). *Killed*: kvspec check reported a violation. "
           "*Time to failure* (ttf): search time to the first violation (process start-up, patching and "
           "minimization excluded). *Repro*: the length of the minimized repro kvspec check prints (ddmin, then the "
           "minimizer's bounded BFS). *Minimal*: the shortest failing length an exhaustive breadth-first search "
           "proves (`kvspec.mc`, its default operation domains, pools up to the finding's, same level and block "
           "size): the minimizer's proof where it has one, else an iterative-deepening search the runner runs "
           "(20 s budget, depth at most 12). Medians are over killed trials. Safety bugs (wrong KV, corrupted state, "
           "a crash on valid use) and policy bugs (eviction order, hit rate) are summarized separately; a "
           "*rare-input* patch (`engine: diff`) misbehaves only on inputs far outside the pools kvspec check builds "
           "and is expected to be caught by `kvspec diff` (CrossHair `diffbehavior` on the changed helper) instead; "
           "*equivalent mutants* change the code but not its behaviour, so any kill of one is a false positive.", ""]
    if not targets:
        return "\n".join(out + ["No runs yet."]) + "\n"
    out += ["## Overview", ""] + _overview(doc)
    if png:
        out += ["", f"![time to failure per corpus bug, per target]({png})", "",
                f"[`{png}`]({png}): time to failure per bug (log scale), one dot per seed, `|` the median, "
                f"`x` = not found within the timeout; equivalent mutants are not drawn (none was killed unless the "
                f"overview says so)."]
    if doc.get("notes"):  # kept across runs: a person's reading of the numbers, in patches.json
        out += ["", "## Notes", ""] + [f"- {n}" for n in doc["notes"]]
    for t, res in targets.items():
        out += ["", *_section(res)]
    return "\n".join(out) + "\n"


def _section(res: dict) -> list[str]:
    s = res["summary"]
    m = res.get("machine") or {}
    env = ", ".join(x for x in (f"{m['cpus']} CPU cores" if m.get("cpus") else "",
                                f"Python {m['python']}" if m.get("python") else "",
                                f"{res['target']} {m['target_version']}" if m.get("target_version") else "",
                                "load average at the end (1/5/15 min) " + " / ".join(map(str, m["load_average"]))
                                if m.get("load_average") else "") if x)
    out = [f"## Target `{res['target']}`", "",
           f"Command: `{res['command']}` ({len(res['patches'])} patches, {res['seeds']} seeds each, "
           f"{res['timeout']:g} s timeout per trial, {res['jobs']} worker processes, wall time "
           f"{s['wall_seconds']:.0f} s{'; ' + env if env else ''}{'; ' + res['date'] if res.get('date') else ''}). "
           f"Verdict: **{res['verdict']}** (pass = every safety bug killed on every seed, the rare-input ones by "
           f"kvspec check or kvspec diff, and no equivalent mutant killed).", "",
           "### Summary", ""]
    out += _class_lines("Safety bugs", s["safety"], res["timeout"])
    out += _class_lines("Policy bugs (reported separately)", s["policy"], res["timeout"])
    rare = s["rare_input"]
    if rare["bugs"]:
        out.append(f"- **Rare-input bugs** ({', '.join(rare['ids'])}): caught by `kvspec check` on "
                   f"{rare['caught_by_check']}/{rare['bugs']}, by `kvspec diff` (CrossHair) on "
                   f"{rare['caught_by_diff']}/{rare['bugs']}" + (" (kvspec diff runs on impl only)"
                                                                 if res["target"] != "impl" else "") + ".")
    eq = s["equivalent"]
    out.append(f"- **Equivalent mutants** ({eq['mutants']}): killed (false positives) **{eq['false_positives']}**"
               + (f": {', '.join(eq['killed_ids'])} (a kvspec bug)" if eq["killed"] else "") + ".")
    if s["expected_invariant_rate"] is not None:
        out.append(f"- The invariant reported was one of the patch's expected invariants in "
                   f"{_pct(s['expected_invariant_rate'])} of the killed safety and policy trials.")
    if s["patches_not_applied"]:
        out.append(f"- Patches that did not apply: {', '.join(s['patches_not_applied'])}.")
    errs = [r for r in res["patches"] if r["errors"]]
    if errs:
        out.append("- Trials with errors: " + "; ".join(f"{r['id']}: {', '.join(r['errors'])}" for r in errs) + ".")
    has_diff = any(r.get("diff") for r in res["patches"])
    groups = (("Safety bugs", lambda r: r["kind"] == "safety" and r["engine"] != "diff"),
              ("Policy bugs", lambda r: r["kind"] == "policy"),
              ("Rare-input bugs (engine: diff)", lambda r: r["engine"] == "diff" and r["kind"] != "equivalent"),
              ("Equivalent mutants (must not be killed)", lambda r: r["kind"] == "equivalent"))
    for title, pred in groups:
        rows = [r for r in res["patches"] if pred(r)]
        if not rows:
            continue
        out += ["", f"### {title}", "",
                "| patch | level | upstream | expected | found (trials) | killed | ttf median s | ttf p90 s | repro "
                "median | minimal median | repro/minimal |" + (" kvspec diff |" if has_diff else "") + " caught by |",
                "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if has_diff else "") + "---|"]
        for r in rows:
            found = ", ".join(f"{k} ({v})" for k, v in sorted(r["found"].items(), key=lambda kv: -kv[1])) or "-"
            diff = (r["diff"] or {}).get("verdict", "-") if r.get("diff") else "-"
            out.append(f"| {r['id']} | {r['level'] or '-'} | {r.get('upstream') or '-'} | "
                       f"{', '.join(r['expected']) or '(none)'} | {found} | {r['kills']}/{r['seeds']} | "
                       f"{_fmt(r['seconds_to_failure'], 3)} | {_fmt(r['seconds_to_failure_p90'], 3)} | "
                       f"{_fmt(r['repro_steps'])} | {_fmt(r['minimal_steps'])} | {_fmt(r['repro_over_minimal'])} |"
                       + (f" {diff} |" if has_diff else "") + f" {', '.join(r['caught_by']) or 'none'} |")
    out += ["", "### Findings", "", _findings(res)]
    return out


def _findings(res: dict) -> str:
    s = res["summary"]
    rows = res["patches"]
    saf = s["safety"]
    parts = []
    if saf["bugs"]:
        slow = sorted((r for r in rows if r["kind"] == "safety" and r["engine"] != "diff" and r["seconds_to_failure"]),
                      key=lambda r: -(r["seconds_to_failure_p90"] or r["seconds_to_failure"]))[:3]
        missed = [r for r in rows if r["kind"] == "safety" and r["engine"] != "diff" and r["kills"] < r["seeds"]]
        parts.append(f"kvspec check killed {saf['solved']} of {saf['trials']} safety trials "
                     f"({_pct(saf['solve_rate'] or 0)}) within {res['timeout']:g} s"
                     + (" (not killed on every seed: " + ", ".join(f"{r['id']} {r['kills']}/{r['seeds']}" for r in missed)
                        + ")" if missed else "")
                     + f"; the median time to failure is {_fmt(saf['median_seconds_to_failure'], 3)} s and the slowest "
                     f"(by p90) were " + ", ".join(f"{r['id']} (median {_fmt(r['seconds_to_failure'], 2)} s, p90 "
                                                    f"{_fmt(r['seconds_to_failure_p90'], 2)} s)" for r in slow) + ".")
        long = [r for r in rows if r["minimal_steps"] and r["minimal_steps"] >= 4 and r["kind"] != "equivalent"]
        if long:
            parts.append("Bugs whose shortest failing sequence needs 4 or more steps (long sequences, LRU pressure): "
                         + ", ".join(f"{r['id']} ({_fmt(r['minimal_steps'])})" for r in long) + ".")
        gaps = [r for r in rows if r["repro_over_minimal"] and r["repro_over_minimal"] > 1.0]
        if gaps:
            parts.append("Repros longer than the proven minimum (the minimizer's own BFS did not reach it): " + ", ".join(
                f"{r['id']} (repro median {_fmt(r['repro_steps'])} vs minimal {_fmt(r['minimal_steps'])})"
                for r in gaps) + ".")
        unproven = [r for r in rows if r["kills"] and r["minimal_proven"] < r["kills"]]
        if unproven:
            parts.append("Minimal length not proven on some trials (the BFS budget ran out or the failure needs "
                         "operations outside the BFS domains): " + ", ".join(
                             f"{r['id']} ({r['kills'] - r['minimal_proven']}/{r['kills']})" for r in unproven) + ".")
    pol = [r for r in rows if r["kind"] == "policy"]
    if pol:
        parts.append(f"Policy bugs: {s['policy']['solved']}/{s['policy']['trials']} trials killed, reported as "
                     + ", ".join(sorted({inv for r in pol for inv in r["found"]})) + ".")
    mixed = [r for r in rows if r["kills"] and r["expected"] and r["expected_found"] is not None and r["expected_found"] < 1]
    if mixed:
        parts.append("Reported an invariant outside the expected list on some seeds: " + ", ".join(
            f"{r['id']} ({', '.join(r['found'])})" for r in mixed) + ".")
    for r in (r for r in rows if r["engine"] == "diff"):
        d = r.get("diff") or {}
        parts.append(f"The rare-input patch {r['id']} was killed by kvspec check on {r['kills']}/{r['seeds']} seeds; "
                     f"kvspec diff says: {d.get('verdict', 'not run')}"
                     + (f", {d['differences'][0]}" if d.get("differences") else "") + ".")
    caught_diff = [r["id"] for r in rows if r.get("diff") and r["diff"].get("verdict") == "different"
                   and r["engine"] != "diff"]
    if caught_diff:
        parts.append(f"kvspec diff (CrossHair diffbehavior on the changed pure helpers) also tells apart: "
                     f"{', '.join(caught_diff)}; the other patches change only BlockPool/KVCacheManager methods, "
                     f"which it leaves to kvspec check.")
    eq = s["equivalent"]
    parts.append(f"Equivalent mutants killed: {eq['false_positives']}"
                 + (" (no false positives)." if not eq["killed"] else f" ({', '.join(eq['killed_ids'])})."))
    return " ".join(parts)


def _figure(doc: dict, path: Path) -> Optional[str]:
    """Time to failure per bug, log-scale seconds, one panel per target, one row per bug
    (seeds as dots, the median as a bar, not-found seeds as an x at the timeout)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except Exception:
        return None
    panels = []
    for t, res in doc["targets"].items():
        rows = [r for r in res["patches"] if r["kind"] != "equivalent" or r["kills"]]
        by = {r["id"]: [x["seconds_to_failure"] for x in res["trials"] if x["id"] == r["id"] and x["killed"]
                        and x["seconds_to_failure"] is not None] for r in rows}
        rows.sort(key=lambda r: (_median(by[r["id"]]) if by[r["id"]] else float("inf")), reverse=True)
        if rows:
            panels.append((t, res, rows, by))
    if not panels:
        return None
    heights = [len(p[2]) + 2 for p in panels]
    fig = Figure(figsize=(9, 0.22 * sum(heights) + 1.2), dpi=110)
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, gridspec_kw={"height_ratios": heights}, squeeze=False)[:, 0]
    colors = {"safety": "tab:red", "policy": "tab:blue", "equivalent": "black"}
    lo = min([min(v) for p in panels for v in p[3].values() if v] + [0.01])
    hi = max(p[1]["timeout"] for p in panels)
    for ax, (t, res, rows, by) in zip(axes, panels):
        for i, r in enumerate(rows):
            xs = by[r["id"]]
            c = "tab:purple" if r["engine"] == "diff" else colors.get(r["kind"], "gray")
            if xs:
                ax.scatter(xs, [i] * len(xs), s=10, color=c, alpha=0.55, linewidths=0)
                ax.plot([_median(xs)], [i], marker="|", markersize=10, color="black")
            missed = r["seeds"] - len(xs)
            if missed:
                ax.scatter([res["timeout"]], [i], marker="x", color=c)
                ax.annotate(f"{missed}/{r['seeds']} not found" + (" (CrossHair: found)" if "diff" in r["caught_by"]
                                                                  else ""),
                            (res["timeout"], i), xytext=(5, -3), textcoords="offset points", fontsize=6.5)
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels([f"{r['id']} ({'rare input' if r['engine'] == 'diff' else r['kind']})" for r in rows],
                           fontsize=6.5)
        ax.set_ylim(-0.7, len(rows) - 0.3)
        ax.set_xscale("log")
        ax.set_xlim(max(lo / 2, 1e-3), hi * 12)
        ax.axvline(res["timeout"], color="gray", lw=0.6, ls="--")
        ax.grid(True, axis="x", alpha=0.3)
        ax.set_title(f"--target {t}: {res['seeds']} seeds, {res['timeout']:g} s timeout "
                     f"(red safety, blue policy, purple rare input; | median)", fontsize=8)
    axes[-1].set_xlabel("seconds to first failure (log scale; x = not found within the timeout)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png")
    return str(path)


# -- the command --------------------------------------------------------------------------
class _Progress:
    """Progress on stderr: a live line on a terminal; otherwise (CI logs, a redirected
    run) one line per patch as its last trial finishes, and a heartbeat every 30 s."""

    def __init__(self, total: int, per_id: dict[str, int], seeds: int) -> None:
        self.tty = sys.stderr.isatty()
        self.seeds = seeds
        self.total, self.start, self.killed = total, time.monotonic(), 0
        self.left = dict(per_id)
        self.kills: dict[str, list[float]] = {}
        self.done_ids = 0
        self.last = time.monotonic()

    def _line(self, text: str) -> None:
        sys.stderr.write(("\r\033[K" if self.tty else "") + text + ("" if self.tty else "\n"))
        sys.stderr.flush()

    def __call__(self, res: dict, done: int, total: int) -> None:
        el = time.monotonic() - self.start
        rid = res.get("id")
        if res.get("killed"):
            self.killed += 1
            self.kills.setdefault(rid, []).append(res.get("seconds_to_failure") or 0.0)
        if rid in self.left:
            self.left[rid] -= 1
            if self.left[rid] == 0 and not self.tty:
                self.done_ids += 1
                ks = self.kills.get(rid, [])
                self._line(f"[patches {self.done_ids}/{len(self.left)}] {rid}: killed {len(ks)}/{self.seeds}"
                           + (f", ttf median {_median(ks):.3f} s" if ks else "") + f"  ({el:.0f} s)")
                self.last = time.monotonic()
        if self.tty:
            what = f" seed {res['seed']}" if res.get("_fn") == "run_trial" else " (kvspec diff)"
            self._line(f"[{done}/{total}] {rid}{what}  killed so far {self.killed}  {el:.0f}s")
        elif time.monotonic() - self.last > 30:
            self._line(f"[{done}/{total} jobs done, {el:.0f} s]")
            self.last = time.monotonic()

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()


def cmd_patches(args) -> int:
    from .cli import UsageError
    from .targets.registry import load_target

    if args.seeds < 1:
        raise UsageError("kvspec patches: --seeds must be at least 1")
    if args.timeout <= 0:
        raise UsageError("kvspec patches: --timeout must be positive")
    jobs = args.jobs or os.cpu_count() or 1
    if jobs < 1:
        raise UsageError("kvspec patches: --jobs must be at least 1")
    corpus_dir, bugs = load_corpus(args.target)
    if args.only:
        want = [x.strip() for x in args.only.split(",") if x.strip()]
        unknown = sorted(set(want) - {b["id"] for b in bugs})
        if unknown:
            raise UsageError(f"kvspec patches: unknown patch id(s) for {args.target}: {', '.join(unknown)}")
        bugs = [b for b in bugs if b["id"] in want]
    load_target(args.target)  # a missing target is one line and exit 2, before any worker starts
    # Import what the workers need before forking, so each starts warm.
    from . import checker, minimize  # noqa: F401
    try:
        from . import mc  # noqa: F401
    except ImportError:
        pass

    hard = args.timeout + HARD_MARGIN_S
    work: list[tuple[str, dict, float]] = []
    for b in bugs:
        for seed in range(args.seeds):
            work.append(("run_trial", {"id": b["id"], "seed": seed, "target": args.target,
                                       "patch": str(corpus_dir / b["file"]), "timeout": args.timeout}, hard))
    if args.target == "impl":
        # kvspec diff on every patch (it compares only the helpers a patch changes; most
        # patches change none and cost nothing), so the report says which engine caught what
        for b in bugs:
            work.append(("run_diff_task", {"id": b["id"], "patch": str(corpus_dir / b["file"]),
                                           "per_condition_timeout": min(DIFF_TIMEOUT_S, args.timeout)},
                         min(DIFF_TIMEOUT_S, args.timeout) * 8 + 120))
    # Longest first (equivalent mutants and rare-input bugs run to the timeout), so the
    # pool does not end on one long straggler.
    slow = {b["id"] for b in bugs if b["kind"] == "equivalent" or b.get("engine") == "diff"}
    # kvspec diff next (CrossHair runs up to a few per-condition timeouts), the quick trials last.
    work.sort(key=lambda w: (w[0] != "run_trial" or w[1]["id"] not in slow, w[0] != "run_diff_task"))

    per_id: dict[str, int] = {}
    for _, task, _ in work:
        per_id[task["id"]] = per_id.get(task["id"], 0) + 1
    sys.stderr.write(f"kvspec patches --target {args.target}: {len(bugs)} patches x {args.seeds} seeds "
                     f"({len(work)} jobs) on {jobs} worker processes, timeout {args.timeout:g} s per trial\n")
    sys.stderr.flush()
    prog = _Progress(len(work), per_id, args.seeds)
    t0 = time.monotonic()
    try:
        results = run_pool(work, jobs, prog)
    finally:
        prog.close()
    wall = time.monotonic() - t0
    trials = sorted((r for r in results if r.get("_fn") == "run_trial"), key=lambda r: (r["id"], r["seed"]))
    for t in trials:
        t.pop("_fn", None)
        if t.get("seconds_to_failure") is not None:
            t["seconds_to_failure"] = round(t["seconds_to_failure"], 4)
    diffs = {r["id"]: r["diff"] for r in results if r.get("_fn") == "run_diff_task"}
    res = summarize(args.target, bugs, trials, diffs, {"seeds": args.seeds, "timeout": args.timeout, "jobs": jobs}, wall)
    command = "kvspec patches --target {} --seeds {} --timeout {:g}{}".format(
        args.target, args.seeds, args.timeout, f" --only {args.only}" if args.only else "")
    res["command"] = command
    res["machine"] = _machine(args.target)
    res["date"] = time.strftime("%Y-%m-%d")
    res["reports"] = write_reports(res, args.report_dir) if args.report_dir else []
    if args.json:
        print(json.dumps(res, default=str))
    else:
        print(text_summary(res))
    return 0 if res["verdict"] == "pass" else 1


def _machine(target: str) -> dict:
    import platform

    out: dict[str, Any] = {"cpus": os.cpu_count(), "python": platform.python_version()}
    try:  # the machine may be shared: the 1/5/15-minute load averages at the end of the run
        out["load_average"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    pkg = {"vllm": "vllm", "nanovllm": "nano-vllm-fork"}.get(target)
    if pkg:
        try:
            from importlib.metadata import version
            out["target_version"] = version(pkg)
        except Exception:
            pass
    return out


def text_summary(res: dict) -> str:
    s = res["summary"]
    lines = [f"kvspec patches --target {res['target']}: {res['verdict']} "
             f"({len(res['patches'])} patches x {res['seeds']} seeds, {s['wall_seconds']:.0f} s)"]
    for name, key in (("safety", "safety"), ("policy", "policy")):
        c = s[key]
        if c["bugs"]:
            lines.append(f"  {name}: solve rate {100 * (c['solve_rate'] or 0):.1f}% ({c['solved']}/{c['trials']}), "
                         f"median ttf {_fmt(c['median_seconds_to_failure'], 3)} s, p90 {_fmt(c['p90_seconds_to_failure'], 3)} s, "
                         f"repro/minimal median {_fmt(c['median_repro_over_minimal'])}")
    if s["rare_input"]["bugs"]:
        r = s["rare_input"]
        lines.append(f"  rare input: caught by check {r['caught_by_check']}/{r['bugs']}, by diff {r['caught_by_diff']}/{r['bugs']}")
    lines.append(f"  equivalent mutants: false positives {s['equivalent']['false_positives']}")
    for r in res["patches"]:
        if (r["kind"] == "safety" and r["engine"] != "diff" and r["kills"] < r["seeds"]) or \
                (r["kind"] == "equivalent" and r["kills"]):
            lines.append(f"  ! {r['id']} ({r['kind']}): killed {r['kills']}/{r['seeds']}"
                         + (f"; errors: {'; '.join(r['errors'])}" if r["errors"] else ""))
    for p in res.get("reports", []):
        lines.append(f"  wrote {p}")
    return "\n".join(lines)


def resummarize(res: dict) -> dict:
    """``res`` summarized again from its trials with the corpus metadata as it is now
    (after a fix of a patch's expected invariants, say); the trials themselves do not
    depend on the metadata. Unchanged when the corpus no longer has the same patches."""
    try:
        _, bugs = load_corpus(res["target"])
    except Exception:
        return res
    ids = [r["id"] for r in res["patches"]]
    by = {b["id"]: b for b in bugs}
    if set(ids) - set(by):
        return res
    diffs = {r["id"]: r["diff"] for r in res["patches"] if r.get("diff")}
    new = summarize(res["target"], [by[i] for i in ids], res["trials"], diffs,
                    {"seeds": res["seeds"], "timeout": res["timeout"], "jobs": res["jobs"]},
                    res["summary"]["wall_seconds"])
    for k in ("command", "machine", "date"):
        if k in res:
            new[k] = res[k]
    return new


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m kvspec.corpus_runner --render [DIR]``: re-render patches.md and
    patches_ttf.png from DIR/patches.json (default reports/) without running anything,
    summarizing each target's trials again with the corpus metadata as it is now."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m kvspec.corpus_runner", description=main.__doc__)
    ap.add_argument("--render", metavar="DIR", nargs="?", const="reports", required=True)
    a = ap.parse_args(argv)
    doc = load_report(a.render)
    if not doc["targets"]:
        print(f"no {REPORT_JSON} with results in {a.render}", file=sys.stderr)
        return 2
    for t, res in list(doc["targets"].items()):
        doc["targets"][t] = resummarize(res)
    for p in render_reports(doc, a.render):
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
