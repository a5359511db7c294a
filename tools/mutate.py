"""Mutation testing of impl/ (kvspec's reference allocator) with cosmic-ray, kvspec's
stateful machines being the killing suite.

    pip install cosmic-ray==8.7.0        # not a kvspec dependency: only this tool needs it
    python tools/mutate.py [--jobs N] [--budget S] [--timeout S] [--only FILE] [--limit N]

What it does:

1. Makes one working copy per worker under ``--workdir`` (impl/, tests/ and
   pyproject.toml of this checkout). cosmic-ray mutates the copy's impl/ in place, so
   this checkout's impl/ is never touched, and parallel work on it is unaffected.
2. ``cosmic-ray init`` over the copy's impl/ (``__init__.py`` and ``errors.py`` are
   declarations only and are excluded), all of cosmic-ray's core operators.
3. ``cosmic-ray baseline``: the killing suite must pass on the unmutated impl.
4. ``cosmic-ray exec`` with the ``http`` distributor and one ``cosmic-ray http-worker``
   per working copy. The test command of every mutant is

       env KVSPEC_IMPL_DIR=impl KVSPEC_KILL_BUDGET=S python -m pytest -x -q \\
           tests/mutation/test_kill.py tests/test_free_queue.py tests/test_hashing.py \\
           tests/test_kv_cache_manager.py tests/test_misuse.py tests/mutation/test_machines.py

   tests/mutation/conftest.py imports the mutated copy *as* ``kvspec.impl``. The unit
   tests run first (milliseconds each; with ``-x`` the first failure kills the mutant),
   then tests/mutation/test_machines.py: kvspec's stateful machines (the ``LevelSearch``
   that ``kvspec check`` runs, pool and cache level, valid use and with misuse mixed
   in, S seconds each). A mutant the machines kill is one every unit test missed. A
   mutant that hangs is killed by cosmic-ray's timeout.
5. Reads the session back (``cosmic-ray dump``) and writes ``--out`` (JSON: every
   mutant with its outcome, what killed it and its diff) and ``--md`` (the report).

kvspec's own checker (``--module invariants|minimize|session|search|canonical|fast_check``,
repeatable): the working copies hold kvspec/, tests/ and examples/ instead, the test
command puts the copy's root first on ``PYTHONPATH`` (so the mutated kvspec is the one
imported; impl/ stays the installed one) and runs that module's focused suite
(``KVSPEC_MODULES``: tests/mutation/test_kill_kvspec.py first, then the checker probes and
the minimizer/mc unit tests, the machines last, ``--noconftest`` so torch is not imported).
``--sample F --seed S [--full MODULE]`` keeps a seeded fraction of the mutants. The
result goes into a ``kvspec`` entry of --out and a section of --md after impl's; the
impl report is kept. E.g.

    python tools/mutate.py --module invariants --module minimize --module session \
        --sample 0.25 --seed 13 --jobs 1 --budget 0.5 --timeout 60 --workdir /tmp/kvspec-mut-kv

Equivalent mutants: tools/mutate.py never decides that a survivor is equivalent. A
person does, in tests/mutation/equivalent.json (one entry per mutant, matched on file,
operator and the changed lines, with a one-line reason); the report gives the raw
score and the score adjusted for those.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
EQUIVALENT_FILE = ROOT / "tests" / "mutation" / "equivalent.json"
EXCLUDED = ["impl/__init__.py", "impl/errors.py"]
# Cheapest first: with -x the first failure ends the run, so a mutant that a unit test
# kills costs no machine time. The machines (test_machines.py) come last: a mutant
# killed there is one that every unit test missed.
SUITE = ["tests/mutation/test_kill.py", "tests/test_free_queue.py", "tests/test_hashing.py",
         "tests/test_kv_cache_manager.py", "tests/test_misuse.py", "tests/mutation/test_machines.py"]
BASE_PORT = 9876

# --module M (not impl): mutate kvspec's own checker. The worker copy holds kvspec/ and
# tests/; the test command puts the copy's root first on PYTHONPATH, so `import kvspec`
# finds the copy's (mutated) package before the editable install's finder, while
# kvspec.impl/kernels/stateful still come from the install (they are not mutated here).
# --noconftest: tests/conftest.py imports torch (seconds per mutant) and is not needed.
# Each module gets its own focused suite, cheapest and most direct first (-x).
# test_checker_probes.py by name, leaving out its slow corpus probe (a search: 10-25 s per
# surviving mutant on 2 loaded cores); test_kill_kvspec.py checks KV_INTEGRITY directly
_PROBE_NAMES = ["lookup_returning_another_hashs_block_is_caught", "stale_links_on_a_removed_block_are_caught",
                "a_rejected_misuse_that_changed_the_state_is_caught",
                "a_misuse_rejected_with_the_wrong_exception_class_is_caught",
                "a_block_table_changing_under_its_request_is_caught", "a_slot_holding_another_prefix_is_caught",
                "the_models_unhashed_blocks_first_trait_is_needed", "ddmin_shortens_a_long_failing_sequence",
                "minimal_is_claimed_only_after_a_complete_search",
                "a_manager_that_forgets_to_index_decode_filled_blocks_is_caught", "a_hanging_call_is_a_no_hang_finding"]
_PROBES_FAST = [f"tests/test_checker_probes.py::test_{n}" for n in _PROBE_NAMES]
_PROBES = " ".join(_PROBES_FAST)  # one entry, split below
_PROBE_SLOW = "tests/test_checker_probes.py::test_kv_integrity_on_a_corpus_patch_that_serves_a_wrong_hit"
_KILL = "tests/mutation/test_kill_kvspec.py"
_MIN_FAST = ["tests/test_minimize.py", "--deselect",
             "tests/test_minimize.py::test_a_long_cache_level_finding_is_cut_to_a_proven_minimum_on_a_small_pool"]
_MC_FAST = ["tests/test_mc.py::test_small_pool_search_passes_and_counts",
            "tests/test_mc.py::test_shortest_counterexample_replays_from_scratch",
            "tests/test_mc.py::test_symmetry_reduction_shrinks_the_state_space"]
_MACHINES = "tests/mutation/test_machines.py"
KVSPEC_MODULES = {
    "invariants": ("kvspec/spec/invariants.py", [_KILL, _PROBES, *_MIN_FAST, _MACHINES]),
    "fast_check": ("kvspec/spec/fast_check.py", [_KILL, _PROBES, _MACHINES]),
    "minimize": ("kvspec/check/minimize.py", [_KILL, *_MIN_FAST, _PROBES]),
    "session": ("kvspec/check/session.py", [_KILL, _PROBES, *_MIN_FAST, _MACHINES]),
    "search": ("kvspec/mc/search.py", [_KILL, *_MC_FAST, *_MIN_FAST, "tests/test_canonical.py"]),
    "canonical": ("kvspec/mc/canonical.py", [_KILL, "tests/test_canonical.py", *_MC_FAST, *_MIN_FAST]),
}


def _die(msg: str) -> None:
    print(f"tools/mutate.py: {msg}", file=sys.stderr)
    sys.exit(2)


def _cosmic_ray() -> list[str]:
    try:
        import cosmic_ray  # noqa: F401
    except ImportError:
        _die("cosmic-ray is not installed: pip install cosmic-ray==8.7.0")
    return [sys.executable, "-m", "cosmic_ray.cli"]


def test_command(budget: float, modules: Optional[list[str]] = None) -> str:
    # `env` because cosmic-ray splits the command with shlex and runs it without a shell.
    if modules:  # kvspec's own modules: one focused suite for all named modules, in order
        suite: list[str] = []
        for m in modules:
            for t in " ".join(KVSPEC_MODULES[m][1]).replace("--deselect ", "--deselect=").split():
                if t not in suite:
                    suite.append(t)
        return " ".join(["env", "PYTHONPATH=.", f"KVSPEC_KILL_BUDGET={budget:g}", shlex.quote(sys.executable),
                         "-m", "pytest", "-x", "-q", "--noconftest", "-p", "no:cacheprovider", "-p", "no:kvspec",
                         "-p", "no:benchmark", "-p", "no:xdist", *suite])
    return " ".join(["env", "KVSPEC_IMPL_DIR=impl", f"KVSPEC_KILL_BUDGET={budget:g}", shlex.quote(sys.executable),
                     "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-p", "no:kvspec", "-p", "no:benchmark",
                     "-p", "no:xdist", *SUITE])


def make_copy(dst: Path, kvspec: bool = False) -> None:
    dst.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / ("kvspec" if kvspec else "impl"), dst / ("kvspec" if kvspec else "impl"), ignore=ignore)
    if kvspec:  # the probes drive the example user targets
        shutil.copytree(ROOT / "examples", dst / "examples", ignore=ignore)
    shutil.copytree(ROOT / "tests", dst / "tests", ignore=ignore)
    shutil.copy(ROOT / "pyproject.toml", dst / "pyproject.toml")


def write_config(path: Path, a, ports: list[int]) -> None:
    urls = ", ".join(f'"http://localhost:{p}"' for p in ports)
    if a.modules:
        path.write_text(
            "[cosmic-ray]\n"
            f"module-path = {json.dumps([KVSPEC_MODULES[m][0] for m in a.modules])}\n"
            f"timeout = {a.timeout:g}\n"
            "excluded-modules = []\n"
            f"test-command = {json.dumps(test_command(a.budget, a.modules))}\n\n"
            "[cosmic-ray.distributor]\n"
            'name = "http"\n\n'
            "[cosmic-ray.distributor.http]\n"
            f"worker-urls = [{urls}]\n")
        return
    excluded = list(EXCLUDED)
    if a.only:
        excluded += [f"impl/{p.name}" for p in sorted((ROOT / "impl").glob("*.py"))
                     if p.name != a.only and f"impl/{p.name}" not in excluded]
    urls = ", ".join(f'"http://localhost:{p}"' for p in ports)
    path.write_text(
        "[cosmic-ray]\n"
        'module-path = "impl"\n'
        f"timeout = {a.timeout:g}\n"
        f"excluded-modules = {json.dumps(excluded)}\n"
        f"test-command = {json.dumps(test_command(a.budget))}\n\n"
        "[cosmic-ray.distributor]\n"
        'name = "http"\n\n'
        "[cosmic-ray.distributor.http]\n"
        f"worker-urls = [{urls}]\n")


def _free_ports(n: int) -> list[int]:
    out, p = [], BASE_PORT
    while len(out) < n:
        with socket.socket() as s:
            try:
                s.bind(("localhost", p))
                out.append(p)
            except OSError:
                pass
        p += 1
    return out


def _wait_port(port: int, proc: subprocess.Popen, limit: float = 60.0) -> None:
    end = time.monotonic() + limit
    while time.monotonic() < end:
        if proc.poll() is not None:
            _die(f"cosmic-ray http-worker on port {port} exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("localhost", port)) == 0:
                return
        time.sleep(0.2)
    _die(f"cosmic-ray http-worker on port {port} did not start")


def _progress(session: Path, total: int, stop: threading.Event, t0: float) -> None:
    from cosmic_ray.work_db import WorkDB, use_db

    while not stop.wait(15):
        try:
            with use_db(str(session), WorkDB.Mode.open) as db:
                done = db.num_results
        except Exception:
            continue
        sys.stderr.write(f"[mutate] {done}/{total} mutants done, {time.monotonic() - t0:.0f} s\n")
        sys.stderr.flush()


# -- reading the session back ------------------------------------------------------------
def _changed_lines(diff: str) -> tuple[str, str]:
    minus = [ln[1:].strip() for ln in diff.splitlines() if ln.startswith("-") and not ln.startswith("---")]
    plus = [ln[1:].strip() for ln in diff.splitlines() if ln.startswith("+") and not ln.startswith("+++")]
    return " / ".join(minus), " / ".join(plus)


def _killed_by(output: str, test_outcome: str) -> Optional[str]:
    if test_outcome != "killed":
        return None
    if output.strip() == "timeout":
        return "timeout (the mutant hangs)"
    m = re.search(r"^FAILED (\S+)", output, re.M) or re.search(r"^ERROR (\S+)", output, re.M)
    if m:
        return m.group(1)
    if "error" in output.lower() and ("collect" in output.lower() or "ImportError" in output):
        return "import / collection"
    return "the suite (see output)"


def _stage(killed_by: Optional[str]) -> Optional[str]:
    if killed_by is None:
        return None
    if killed_by.startswith("tests/mutation/test_machines.py"):
        return "kvspec stateful machines"
    if killed_by.startswith("tests/mutation/test_kill.py"):
        return "kill-suite unit checks"
    if killed_by.startswith("timeout"):
        return "timeout"
    if killed_by.startswith("tests/mutation/test_kill_kvspec.py"):
        return "kvspec kill-suite checks"
    if killed_by.startswith("tests/test_checker_probes.py"):
        return "checker probes"
    if killed_by.startswith(("tests/test_minimize.py", "tests/test_mc.py", "tests/test_canonical.py")):
        return "kvspec unit tests"
    if killed_by.startswith("tests/"):
        return "impl unit tests"
    return "import / collection"


def read_session(w0: Path, session: Path) -> list[dict]:
    out = subprocess.run(_cosmic_ray() + ["dump", str(session)], cwd=w0, capture_output=True, text=True, check=True)
    rows = []
    for line in out.stdout.splitlines():
        item, result = json.loads(line)
        m = item["mutations"][0]
        result = result or {}
        diff = result.get("diff") or ""
        minus, plus = _changed_lines(diff)
        outcome = result.get("test_outcome")
        if result.get("worker_outcome") not in (None, "normal"):
            outcome = outcome or result.get("worker_outcome")
        kb = _killed_by(result.get("output") or "", outcome)
        rows.append({
            "job_id": item["job_id"], "file": m["module_path"], "operator": m["operator_name"].removeprefix("core/"),
            "occurrence": m["occurrence"], "line": m["start_pos"][0] if m.get("start_pos") else None,
            "outcome": outcome or "pending", "killed_by": kb, "stage": _stage(kb),
            "before": minus, "after": plus, "diff": diff,
        })
    return rows


def load_equivalents() -> list[dict]:
    if not EQUIVALENT_FILE.is_file():
        return []
    return json.loads(EQUIVALENT_FILE.read_text())


def _matches(row: dict, eq: dict) -> bool:
    return (row["file"] == eq["file"] and row["operator"] == eq["operator"]
            and row["before"] == eq["before"] and row["after"] == eq["after"])


def summarize(rows: list[dict], equivalents: list[dict], meta: dict) -> dict:
    done = [r for r in rows if r["outcome"] in ("killed", "survived")]
    killed = [r for r in done if r["outcome"] == "killed"]
    survived = [r for r in done if r["outcome"] == "survived"]
    matched, unmatched_eq = [], []
    for eq in equivalents:
        hit = [r for r in survived if _matches(r, eq)]
        (matched if hit else unmatched_eq).append(eq)
        for r in hit:  # "gap": a survivor explained but not equivalent (no test kills it): not discounted
            r["gap" if eq.get("gap") else "equivalent"] = eq["reason"]
    eq_rows = [r for r in survived if r.get("equivalent")]
    adj_den = len(done) - len(eq_rows)

    def group(key):
        g = collections.defaultdict(lambda: {"mutants": 0, "killed": 0, "survived": 0, "equivalent": 0})
        for r in done:
            d = g[r[key]]
            d["mutants"] += 1
            d[r["outcome"]] += 1
            d["equivalent"] += bool(r.get("equivalent"))
        return dict(sorted(g.items()))

    return {
        **meta,
        "mutants": len(rows), "completed": len(done), "killed": len(killed), "survived": len(survived),
        "other": len(rows) - len(done),
        "score_raw": round(len(killed) / len(done), 4) if done else None,
        "equivalent": len(eq_rows),
        "score_adjusted": round(len(killed) / adj_den, 4) if adj_den else None,
        "killed_by_stage": dict(collections.Counter(r["stage"] for r in killed)),
        "by_file": group("file"),
        "by_operator": group("operator"),
        "equivalents_not_seen": unmatched_eq,
        "rows": rows,
    }


def markdown(res: dict) -> str:
    pct = lambda x: "-" if x is None else f"{100 * x:.1f}%"  # noqa: E731
    eq_rows = [r for r in res["rows"] if r.get("equivalent")]
    surv = [r for r in res["rows"] if r["outcome"] == "survived" and not r.get("equivalent")]
    out = [
        "# Mutation testing of impl/ (cosmic-ray, kvspec's stateful machines as the killing suite)", "",
        "Commands (`pip install cosmic-ray==8.7.0` first; `benchmarks/run_mutation.sh` wraps the first):", "",
        *[f"{i}. `{p['command']}` ({p['seconds']:.0f} s wall)" for i, p in enumerate(res.get("passes") or
                                                                       [{"command": res["command"],
                                                                         "seconds": res["seconds"]}], 1)],
        "",
        f"cosmic-ray {res['cosmic_ray']}, {res['jobs']} http workers, {res['seconds']:.0f} s wall in all on "
        f"{res['cpus']} cores.", "",
        "Every mutant of `impl/*.py` (except `__init__.py` and `errors.py`, declarations only) that cosmic-ray's "
        "core operators produce is run against the killing suite, cheapest first, stopping at the first failure "
        "(`pytest -x`):", "",
        "1. `tests/mutation/test_kill.py`: small checks of what the machines do not observe (usage, the hash "
        "encoding's inverse, the block repr);",
        "2. impl's unit tests: `tests/test_free_queue.py`, `tests/test_hashing.py`, `tests/test_kv_cache_manager.py`, "
        "`tests/test_misuse.py`;",
        f"3. `tests/mutation/test_machines.py`: kvspec's stateful machines (the `LevelSearch` behind `kvspec check`), "
        f"pool and cache level, valid use and with misuse, {res['budget']:g} s each, seed 0. A mutant killed here is "
        f"one every unit test missed.", "",
        f"Test command of every mutant: `{res.get('test_command', '')}` (tests/mutation/conftest.py imports the "
        f"worker's mutated copy of impl/ as `kvspec.impl`).", "",
        f"A mutant that runs past {res['timeout']:g} s is killed by cosmic-ray's timeout (it hangs).", "",
        "## Score", "",
        f"- **Raw: {res['killed']}/{res['completed']} = {pct(res['score_raw'])}** "
        f"({res['survived']} survived{', ' + str(res['other']) + ' not completed' if res['other'] else ''}).",
        f"- **Adjusted for equivalent mutants: {res['killed']}/{res['completed'] - res['equivalent']} = "
        f"{pct(res['score_adjusted'])}** ({res['equivalent']} survivors judged equivalent, listed below).",
        "- Killed by: " + ", ".join(f"{k} {v}" for k, v in sorted(res["killed_by_stage"].items(), key=lambda kv: -kv[1]))
        + ".", "",
        "| file | mutants | killed | survived | of which equivalent |", "|---|---|---|---|---|",
    ]
    for f, d in res["by_file"].items():
        out.append(f"| {f} | {d['mutants']} | {d['killed']} | {d['survived']} | {d['equivalent']} |")
    fam: dict = {}
    for op, d in res["by_operator"].items():
        f = fam.setdefault(op.split("_")[0], {"mutants": 0, "killed": 0, "survived": 0, "equivalent": 0})
        for k in f:
            f[k] += d[k]
    out += ["", "| operator family | mutants | killed | survived | of which equivalent |", "|---|---|---|---|---|"]
    for op, d in sorted(fam.items()):
        out.append(f"| {op} | {d['mutants']} | {d['killed']} | {d['survived']} | {d['equivalent']} |")
    out += ["", "## Survivors judged equivalent", "",
            "Judged by reading the code (tests/mutation/equivalent.json); each reason says why no caller of impl "
            "can observe the change.", "",
            "| file:line | operator | before | after | why it is equivalent |", "|---|---|---|---|---|"]
    for r in eq_rows:
        out.append(f"| {r['file']}:{r['line']} | {r['operator']} | `{r['before']}` | `{r['after']}` | {r['equivalent']} |")
    out += ["", "## Survivors not judged equivalent", ""]
    if surv:
        out += ["| file:line | operator | before | after |", "|---|---|---|---|"]
        for r in surv:
            out.append(f"| {r['file']}:{r['line']} | {r['operator']} | `{r['before']}` | `{r['after']}` |")
    else:
        out.append("None.")
    if res.get("notes"):
        out += ["", "## Notes", "", res["notes"]]
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="cosmic-ray http workers (default: CPUs)")
    ap.add_argument("--budget", type=float, default=2.0, help="seconds per machine search in test_kill.py (default 2)")
    ap.add_argument("--timeout", type=float, default=90.0, help="cosmic-ray's timeout per mutant (default 90 s)")
    ap.add_argument("--only", help="one file of impl/, e.g. free_queue.py")
    ap.add_argument("--limit", type=int, help="run only the first N mutants (a smoke test of the setup)")
    ap.add_argument("--module", action="append", dest="modules", choices=sorted(KVSPEC_MODULES),
                    help="mutate this module of kvspec's own checker instead of impl/ (repeatable); its focused "
                         "suite is KVSPEC_MODULES[...] (the report goes into a kvspec section of --out/--md)")
    ap.add_argument("--sample", type=float, help="keep this fraction of the mutants (deterministic: see --seed)")
    ap.add_argument("--seed", type=int, default=0, help="seed of --sample (default 0)")
    ap.add_argument("--full", action="append", default=[], choices=sorted(KVSPEC_MODULES),
                    help="with --sample: a module whose mutants are all kept")
    ap.add_argument("--workdir", help="where the working copies and the session go (default: a temp dir)")
    ap.add_argument("--out", default="reports/mutation.json")
    ap.add_argument("--md", default="reports/mutation.md")
    ap.add_argument("--rerun-survivors", metavar="WORKDIR",
                    help="after the killing suite gained tests: copy this checkout's tests/ into the working copies "
                         "of a previous run's WORKDIR and run its survivors again (killed mutants stay killed: the "
                         "suite only grows)")
    ap.add_argument("--drop-pending", action="store_true",
                    help="with --rerun-survivors: first drop the mutants the previous run never got to (it was "
                         "stopped); the report counts them as not run")
    ap.add_argument("--note", help="text for the report's notes (e.g. how an earlier pass was stopped)")
    ap.add_argument("--report-only", metavar="JSON", help="re-read a previous --out and rewrite --md (after editing "
                                                          "tests/mutation/equivalent.json); runs nothing")
    a = ap.parse_args()

    if a.report_only:
        prev = json.loads(Path(a.report_only).read_text())
        for r in prev["rows"]:
            r.pop("equivalent", None)
        if a.modules:  # a kvspec section: re-read that run's entry
            prev = prev["kvspec"]["+".join(a.modules)]
            for r in prev["rows"]:
                r.pop("equivalent", None)
                r.pop("gap", None)
        meta = {k: prev.get(k) for k in ("command", "passes", "cosmic_ray", "jobs", "budget", "timeout", "seconds",
                                         "cpus", "test_command", "workdir", "modules", "sample", "seed", "full",
                                         "started_utc", "copied_from", "not_run")}
        res = summarize(prev["rows"], load_equivalents(), meta)
        res["notes"] = prev.get("notes")
        return _write(res, a)

    cr = _cosmic_ray()
    from importlib.metadata import version

    t0 = time.monotonic()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    passes = []
    not_run = 0
    if a.rerun_survivors:
        work = Path(a.rerun_survivors)
        prev = json.loads(Path(a.out).read_text()) if Path(a.out).is_file() else {}
        if a.modules:
            prev = (prev.get("kvspec") or {}).get("+".join(a.modules)) or {}
        passes = prev.get("passes") or ([{"command": prev["command"], "seconds": prev["seconds"]}] if prev else [])
        copies = sorted(p for p in work.glob("w*") if p.is_dir())
        cfg, session = work / "cr.toml", work / "session.sqlite"
        if not copies or not session.is_file():
            _die(f"{work}: not a tools/mutate.py working directory")
        for c in copies:  # the suite's new tests; impl/ stays as cosmic-ray's init saw it
            shutil.rmtree(c / "tests")
            shutil.copytree(ROOT / "tests", c / "tests", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        ports = _free_ports(len(copies))
        write_config(cfg, a, ports)
        w0 = copies[0]
        if a.drop_pending:
            not_run = _drop_pending(session)
            print(f"[mutate] dropped {not_run} mutants the stopped run never got to", file=sys.stderr)
        n = _forget_survivors(session)
        print(f"[mutate] re-running {n} survivors", file=sys.stderr)
    else:
        work = Path(a.workdir) if a.workdir else Path(tempfile.mkdtemp(prefix="kvspec-mutation-"))
        if work.exists() and any(work.iterdir()):
            shutil.rmtree(work)
        work.mkdir(parents=True, exist_ok=True)
        copies = [work / f"w{i}" for i in range(max(1, a.jobs))]
        for c in copies:
            make_copy(c, kvspec=bool(a.modules))
        ports = _free_ports(len(copies))
        cfg, session = work / "cr.toml", work / "session.sqlite"
        write_config(cfg, a, ports)
        w0 = copies[0]
        subprocess.run(cr + ["init", str(cfg), str(session)], cwd=w0, check=True)
        if a.sample is not None:
            keep_files = [KVSPEC_MODULES[m][0] for m in a.full]
            print(f"[mutate] sampled: kept {_keep_sample(session, a.sample, a.seed, keep_files)}", file=sys.stderr)
        if a.limit:
            _keep_first(session, a.limit)
    total = _count(session)
    print(f"[mutate] {total} mutants; baseline run of the killing suite ...", file=sys.stderr)
    base = subprocess.run(cr + ["baseline", str(cfg)], cwd=w0, capture_output=True, text=True)
    if base.returncode != 0:
        _die(f"the killing suite fails on the unmutated impl (cosmic-ray baseline):\n{base.stdout}{base.stderr}")
    workers = []
    stop = threading.Event()
    try:
        for c, p in zip(copies, ports):
            workers.append(subprocess.Popen(cr + ["http-worker", "--port", str(p)], cwd=c, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL, start_new_session=True))
        for p, w in zip(ports, workers):
            _wait_port(p, w)
        threading.Thread(target=_progress, args=(session, total, stop, t0), daemon=True).start()
        subprocess.run(cr + ["exec", str(cfg), str(session)], cwd=w0, check=True)
    finally:
        stop.set()
        for w in workers:
            w.terminate()
        for w in workers:
            try:
                w.wait(timeout=10)
            except subprocess.TimeoutExpired:
                w.kill()
    rows = read_session(w0, session)
    cmd = ("python tools/mutate.py " + " ".join(shlex.quote(x) for x in sys.argv[1:])).strip()
    passes.append({"command": cmd, "seconds": round(time.monotonic() - t0, 1)})
    meta = {"command": passes[0]["command"], "passes": passes, "cosmic_ray": version("cosmic-ray"),
            "jobs": len(copies), "budget": a.budget, "timeout": a.timeout,
            "seconds": round(sum(p["seconds"] for p in passes), 1), "cpus": os.cpu_count(),
            "test_command": test_command(a.budget, a.modules), "workdir": str(work),
            "modules": a.modules, "sample": a.sample, "seed": a.seed, "full": a.full,
            "started_utc": started, "copied_from": _head()}
    meta["not_run"] = not_run
    res = summarize(rows, load_equivalents(), meta)
    res["notes"] = a.note
    return _write(res, a)


KVSPEC_MARK = "\n<!-- kvspec's own modules: written by tools/mutate.py --module -->\n"


def _write(res: dict, a) -> int:
    for r in res["rows"]:  # keep the JSON small: a killed mutant's before/after lines say enough
        if r["outcome"] == "killed":
            r.pop("diff", None)
    out, md = Path(a.out), Path(a.md)
    out.parent.mkdir(parents=True, exist_ok=True)
    prev = json.loads(out.read_text()) if out.is_file() else {}
    prev_md = md.read_text() if md.is_file() else ""
    if getattr(a, "modules", None) or res.get("modules"):
        # one entry per --module run (runs at different times: some modules change under other work)
        kv = prev.get("kvspec") or {}
        kv["+".join(res["modules"])] = res
        prev["kvspec"] = kv
        out.write_text(json.dumps(prev, indent=1) + "\n")
        md.write_text(prev_md.split(KVSPEC_MARK)[0].rstrip("\n") + "\n" + KVSPEC_MARK + kvspec_markdown(kv))
    else:
        if "kvspec" in prev:
            res["kvspec"] = prev["kvspec"]
        out.write_text(json.dumps(res, indent=1) + "\n")
        tail = prev_md.split(KVSPEC_MARK)[1] if KVSPEC_MARK in prev_md else ""
        md.write_text(markdown(res) + (KVSPEC_MARK + tail if tail else ""))
    print(f"{res['killed']}/{res['completed']} mutants killed (raw {100 * (res['score_raw'] or 0):.1f}%, adjusted "
          f"{100 * (res['score_adjusted'] or 0):.1f}% with {res['equivalent']} equivalent) in {res['seconds']:.0f} s; "
          f"wrote {a.out} and {a.md}")
    for r in res["rows"]:
        if r["outcome"] == "survived" and not r.get("equivalent"):
            print(("  explained " if r.get("gap") else "  ") + f"  survived {r['file']}:{r['line']} {r['operator']}: {r['before']!r} -> {r['after']!r}")
    return 0


def _count(session: Path) -> int:
    from cosmic_ray.work_db import WorkDB, use_db

    with use_db(str(session), WorkDB.Mode.open) as db:
        return db.num_work_items


def _forget_survivors(session: Path) -> int:
    import sqlite3

    con = sqlite3.connect(session)
    n = con.execute("DELETE FROM work_results WHERE upper(test_outcome) = 'SURVIVED'").rowcount
    con.commit()
    con.close()
    return n


def _delete_jobs(session: Path, query: str) -> list:
    """Delete from cosmic-ray's session the jobs ``query`` selects (one job_id column)."""
    import sqlite3

    con = sqlite3.connect(session)
    ids = [r[0] for r in con.execute(query)]
    con.close()
    _delete_ids(session, ids)
    return ids


def _delete_ids(session: Path, ids: list) -> None:
    """Delete these jobs (their mutation spec and work item) from cosmic-ray's session."""
    import sqlite3

    con = sqlite3.connect(session)
    con.execute("PRAGMA foreign_keys = ON")
    for jid in ids:
        con.execute("DELETE FROM mutation_specs WHERE job_id = ?", (jid,))
        con.execute("DELETE FROM work_items WHERE job_id = ?", (jid,))
    con.commit()
    con.close()


def _drop_pending(session: Path) -> int:
    return len(_delete_jobs(session, "SELECT job_id FROM work_items WHERE job_id NOT IN "
                                     "(SELECT job_id FROM work_results)"))


def _keep_first(session: Path, n: int) -> None:
    _delete_jobs(session, f"SELECT job_id FROM work_items ORDER BY rowid LIMIT -1 OFFSET {int(n)}")


def _head() -> str:
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "kvspec"], cwd=ROOT, capture_output=True, text=True)
    return r.stdout.strip() + (" + uncommitted kvspec/ changes" if dirty.stdout.strip() else "")


def _keep_sample(session: Path, fraction: float, seed: int, keep_files: list[str]) -> str:
    """Keep a seeded fraction of the mutants (all of those in keep_files). Deterministic: the
    mutants are ordered by (file, operator, occurrence), not by cosmic-ray's random job ids."""
    import random
    import sqlite3

    con = sqlite3.connect(session)
    rows = sorted(con.execute("SELECT job_id, module_path, operator_name, occurrence FROM mutation_specs"),
                  key=lambda r: (r[1], r[2], r[3]))
    rng = random.Random(seed)
    drop = [r[0] for r in rows if not (r[1] in keep_files or rng.random() < fraction)]
    con.close()
    _delete_ids(session, drop)
    return f"{len(rows) - len(drop)}/{len(rows)} (fraction {fraction:g}, seed {seed}, in full: {keep_files or 'none'})"


def kvspec_markdown(runs: dict) -> str:
    pct = lambda x: "-" if x is None else f"{100 * x:.1f}%"  # noqa: E731
    out = ["# Mutation testing of kvspec's own checker (invariants, minimizer, mc, canonical keys, session)", "",
           "Same tool (cosmic-ray 8.7.0, all core operators), run with `--module`: the worker copy holds kvspec/ "
           "and tests/, and the test command puts the copy first on `PYTHONPATH`, so the mutated kvspec is the one "
           "imported (impl/ stays the installed one). Each module has a focused killing suite "
           "(`KVSPEC_MODULES` in tools/mutate.py), cheapest first, `pytest -x`; no torch import (`--noconftest`).",
           ""]
    for label, res in runs.items():
        sampled = (f"a seeded sample: fraction {res['sample']:g}, seed {res['seed']}"
                   + (f", except {', '.join(res['full'])} in full" if res.get("full") else "")
                   if res.get("sample") is not None else "every mutant (full run)")
        out += [f"## Run: {label}", "",
                f"- Command: `{res['command']}` ({res['seconds']:.0f} s wall, {res['jobs']} worker, started "
                f"{res.get('started_utc')}, copy of kvspec/ taken from {res.get('copied_from')}).",
                f"- Mutants: {sampled}"
                + (f"; {res['not_run']} of them not run (the run was stopped at the deadline; cosmic-ray runs "
                   f"mutants in random order, so those run are a random subset)" if res.get("not_run") else "") + ".",
                f"- Test command: `{res.get('test_command', '')}`; cosmic-ray timeout {res['timeout']:g} s.",
                f"- **Raw: {res['killed']}/{res['completed']} = {pct(res['score_raw'])}**; "
                f"**adjusted for equivalent mutants: {res['killed']}/{res['completed'] - res['equivalent']} = "
                f"{pct(res['score_adjusted'])}** ({res['equivalent']} equivalent"
                f"{', ' + str(res['other']) + ' not completed' if res['other'] else ''}).",
                "- Killed by: " + ", ".join(f"{k} {v}" for k, v in
                                            sorted(res["killed_by_stage"].items(), key=lambda kv: -kv[1])) + ".", "",
                "| file | mutants | killed | survived | of which equivalent | raw | adjusted |",
                "|---|---|---|---|---|---|---|"]
        for f, d in res["by_file"].items():
            den = d["mutants"] - d["equivalent"]
            out.append(f"| {f} | {d['mutants']} | {d['killed']} | {d['survived']} | {d['equivalent']} | "
                       f"{pct(d['killed'] / d['mutants'] if d['mutants'] else None)} | "
                       f"{pct(d['killed'] / den if den else None)} |")
        eq_rows = [r for r in res["rows"] if r.get("equivalent")]
        gaps = [r for r in res["rows"] if r.get("gap")]
        surv = [r for r in res["rows"] if r["outcome"] == "survived" and not r.get("equivalent") and not r.get("gap")]
        if gaps:
            out += ["", f"Survivors explained but not equivalent ({len(gaps)}; counted as survivors in both scores):",
                    "", "| file:line | operator | before | after | why no test kills it |", "|---|---|---|---|---|"]
            out += [f"| {r['file']}:{r['line']} | {r['operator']} | `{r['before']}` | `{r['after']}` | {r['gap']} |"
                    for r in gaps]
        if eq_rows:
            out += ["", "Survivors judged equivalent (tests/mutation/equivalent.json):", "",
                    "| file:line | operator | before | after | why |", "|---|---|---|---|---|"]
            out += [f"| {r['file']}:{r['line']} | {r['operator']} | `{r['before']}` | `{r['after']}` | "
                    f"{r['equivalent']} |" for r in eq_rows]
        out += ["", "Survivors not judged equivalent: " + ("none." if not surv else ""), ""]
        out += [f"- {r['file']}:{r['line']} {r['operator']}: `{r['before']}` -> `{r['after']}`" for r in surv]
        if res.get("notes"):
            out += ["", res["notes"]]
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
