"""The largest configuration ``kvspec mc`` exhausts within a wall-clock cap, per level
(issue 14, "Large configurations"), before and after.

    python benchmarks/mc_largest.py [--cap 60] [--before 01dae75] [--levels pool,cache,hybrid]
                                    [--out reports] [--ladder-max N] [--render JSON]
                                    [--workers N] [--calibrate pool:5:8|none]

For each level (pool; cache; cache with ``--kv-groups full,swa:4``, "hybrid") a ladder
of configurations of increasing size (usable blocks, depth) is run, each one in a fresh
process (``kvspec mc ... --json --time-cap CAP``, killed at CAP + start-up if it does
not stop). A configuration *exhausts* within the cap when the search ends with verdict
``pass`` (every state within its depth bound seen, or the whole reachable space) in at
most CAP seconds of search. The ladder of a level stops at its first configuration that
does not (the next ones are larger). The report names, per level, the largest one that
did, with its states and seconds.

``--before REV`` runs the same ladders on a ``git worktree`` of REV (in a temporary
folder, removed afterwards), imported instead of this checkout, so the report has
before and after side by side; ``after`` is this working tree. A configuration the old
revision cannot run (a flag it lacks) is marked so. Writes ``<out>/mc_largest.md`` and
``<out>/mc_largest.json`` with the command line (another cap than 60 s:
``mc_largest_<cap>s.md`` and ``.json``, so that the 60 s and the 10 min reports stay
side by side). Timings are wall-clock: run it on a
quiet machine (the load average before each run is recorded). The seconds also depend
on the machine: ``--calibrate`` (default pool 5 blocks, depth 8) first times one fixed
search, so that a report from another day can be scaled (one commit ran the same searches
2.4-2.9x slower here on 2026-11-29 than on 2026-11-24). ``--workers N`` runs every rung as
``kvspec mc --workers N`` (the cap stays wall-clock).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]

# (usable blocks, depth), in increasing cost; depth 0 means the whole reachable space
LADDERS: dict[str, dict] = {
    "pool": {"args": ["--level", "pool"], "what": "pool level",
             "ladder": [(3, 8), (4, 8), (5, 8), (5, 0), (6, 8), (6, 10), (6, 0), (7, 8), (7, 10), (7, 12),
                        (8, 10), (8, 12), (9, 12), (10, 12)]},
    "cache": {"args": ["--level", "cache"], "what": "cache level, 2 requests",
              "ladder": [(3, 4), (3, 5), (3, 6), (4, 6), (4, 7), (5, 7), (5, 8), (6, 8), (6, 9), (7, 9), (8, 10)]},
    "hybrid": {"args": ["--level", "cache", "--kv-groups", "full,swa:4"],
               "what": "cache level, --kv-groups full,swa:4, 2 requests",
               "ladder": [(3, 3), (3, 4), (4, 4), (4, 5), (5, 5), (5, 6), (6, 6), (6, 7), (7, 7), (8, 8)]},
}
MEM_CAP_GIB = 8      # what a search may grow, of the machines' 24 GiB
WHOLE_DEPTH = 1000   # "depth 0": a bound the search never reaches (it stops when no new state appears)

# Runs kvspec's CLI from ``root`` (this checkout or a worktree of an older revision).
_BOOT = """
import sys
root = sys.argv[1]
sys.path.insert(0, root)
import kvspec
assert kvspec.__file__.startswith(root), kvspec.__file__
from kvspec.cli import main
sys.exit(main(sys.argv[2:]))
"""


def run_one(root: Path, level: str, blocks: int, depth: int, cap: float, workers: int = 1) -> dict:
    spec = LADDERS[level]
    argv = ["mc", "--target", "impl", *spec["args"], "--blocks", str(blocks),
            "--depth", str(depth or WHOLE_DEPTH), "--time-cap", str(cap), "--mem-cap", str(MEM_CAP_GIB), "--json"]
    if workers > 1:   # (only then: an older revision may lack the flag)
        argv += ["--workers", str(workers)]
    load = os.getloadavg()[0]
    t0 = time.monotonic()
    try:
        p = subprocess.run([sys.executable, "-W", "ignore", "-c", _BOOT, str(root), *argv], capture_output=True,
                           text=True, timeout=cap + 120, cwd=str(root))
    except subprocess.TimeoutExpired:
        return {"blocks": blocks, "depth": depth, "ok": False, "note": "killed at the cap", "wall_s": cap + 120,
                "load": load}
    wall = time.monotonic() - t0
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        err = (p.stderr.strip().splitlines() or ["no output"])[-1]
        return {"blocks": blocks, "depth": depth, "ok": False, "note": f"error: {err[:200]}", "wall_s": wall,
                "load": load}
    r = json.loads(lines[-1])
    ok = r.get("verdict") == "pass" and r.get("seconds", cap + 1) <= cap
    return {"blocks": blocks, "depth": depth, "workers": workers, "ok": ok, "verdict": r.get("verdict"), "states": r.get("states"),
            "transitions": r.get("transitions"), "seconds": r.get("seconds"), "exhausted": r.get("exhausted"),
            "wall_s": round(wall, 2), "reason": r.get("reason"), "load": load,
            "peak_rss_mib": r.get("peak_rss_mib"), "seen_bytes": r.get("seen_bytes"),
            "collision": r.get("collision"), "disk_from": r.get("disk_from"), "disk_bytes": r.get("disk_bytes"),
            "command": "kvspec " + " ".join(shlex.quote(a) for a in argv)}


def ladder(root: Path, level: str, cap: float, most: Optional[int], tag: str,
           start: Optional[tuple[int, int]] = None, workers: int = 1) -> list[dict]:
    rungs = LADDERS[level]["ladder"]
    if start is not None:   # (--start: the smaller rungs are skipped)
        rungs = rungs[rungs.index(start):]
    out = []
    for blocks, depth in rungs[:most]:
        r = run_one(root, level, blocks, depth, cap, workers)
        out.append(r)
        print(f"[mc_largest] {tag} {level} blocks {blocks} depth {depth or 'whole'}: "
              f"{'ok' if r['ok'] else 'no'} {r.get('states')} states {r.get('seconds')} s {r.get('note') or ''}",
              file=sys.stderr, flush=True)
        if not r["ok"]:
            break
    return out


def largest(runs: list[dict]) -> Optional[dict]:
    ok = [r for r in runs if r["ok"]]
    return ok[-1] if ok else None


def worktree(rev: str) -> tuple[Path, Path]:
    """A detached worktree of ``rev`` in a temporary folder, with the package folders
    the editable install maps (impl, kernels, stateful) linked in under kvspec/."""
    tmp = Path(tempfile.mkdtemp(prefix="kvspec-before-"))
    wt = tmp / "tree"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(wt), rev], check=True,
                   capture_output=True)
    for sub in ("impl", "kernels", "stateful"):
        if (wt / sub).is_dir() and not (wt / "kvspec" / sub).exists():
            (wt / "kvspec" / sub).symlink_to(Path("..") / sub)
    return tmp, wt


def drop_worktree(tmp: Path, wt: Path) -> None:
    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(wt)], capture_output=True)
    subprocess.run(["git", "-C", str(ROOT), "worktree", "prune"], capture_output=True)
    import shutil
    shutil.rmtree(tmp, ignore_errors=True)


def _cell(r: Optional[dict]) -> str:
    if r is None:
        return "none within the cap"
    return (f"{r['blocks']} blocks, depth {r['depth'] or 'whole space'}: {r['states']:,} states in "
            f"{r['seconds']:.1f} s")


def _mib(x: Optional[float], unit: float) -> str:
    return "" if x is None else f"{x / unit:,.1f}"


def markdown(data: dict) -> str:
    cap = data["cap"]
    L = [f"## Largest configuration `kvspec mc` exhausts within {cap:g} s", "",
         f"Command: `{data['command']}`", "",
         f"Machine: {data['machine']}; target `impl`; each configuration in a fresh process; a configuration "
         f"counts when the search ends with verdict `pass` within {cap:g} s of search (its depth bound, or "
         f"the whole reachable space where the depth is 'whole'), and within a memory cap of {MEM_CAP_GIB} GiB "
         f"on what the search grows (`--mem-cap {MEM_CAP_GIB}`). A ladder stops at its first configuration "
         f"that does not; the last column of the table of runs says why it stopped.", ""]
    c = data.get("calibration")
    if c:
        L += [f"Calibration: {c['level']} level, {c['blocks']} blocks, depth {c['depth'] or 'whole'} (one process, "
              f"this checkout) took {c['seconds']} s for {c['states'] or 0:,} states at load {c['load']:.2f}: a fixed search, "
              f"so the seconds of reports from other days or machines scale by its ratio.", ""]
    revs = [k for k in ("before", "after") if k in data["runs"]]
    L += ["| level | " + " | ".join(f"{k} ({data['revs'][k]})" for k in revs) + " |",
          "|---|" + "---|" * len(revs)]
    for level in data["levels"]:
        L.append(f"| {LADDERS[level]['what']} | "
                 + " | ".join(_cell(largest(data["runs"][k].get(level, []))) for k in revs) + " |")
    if len(revs) > 1:
        L += ["", "The pool level's state space is the same in both revisions (equal state counts per "
              "configuration), so its row is a speed comparison. The cache levels are not: after "
              "01dae75 the cache-level state key also holds each request's cached-block count and "
              "where its last schedule started (two states the old key merged can behave differently), "
              "and with KV-cache groups the model checker also enumerates chunked, keyed and connector "
              "admissions, Prefill, drafts and Verify (issue 11). Compare those rows by states per "
              "second in the table below, not by configuration size."]
    L += ["", "### Every run", "",
          "| rev | level | blocks | depth | workers | verdict | states | search s | peak RSS MiB | seen set MiB | load | stopped by |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for k in revs:
        for level in data["levels"]:
            for r in data["runs"][k].get(level, []):
                L.append(f"| {k} | {level} | {r['blocks']} | {r['depth'] or 'whole'} | {r.get('workers', 1)} | "
                         f"{r.get('verdict') or r.get('note')} | {r.get('states') or ''} | {r.get('seconds') or ''} | "
                         f"{_mib(r.get('peak_rss_mib'), 1)} | {_mib(r.get('seen_bytes'), 2 ** 20)} | {r['load']:.2f} | {'' if r['ok'] else (r.get('reason') or r.get('note') or '')} |")
    if data.get("notes"):
        L += ["", "### Notes", ""] + [f"- {n}" for n in data["notes"]]
    return "\n".join(L) + "\n"


def _rung(text: str) -> tuple[str, int, int]:
    """``level:blocks:depth`` (ValueError when it is not)."""
    lv, b, d = text.split(":")
    return lv, int(b), int(d)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cap", type=float, default=60.0, help="seconds of search per configuration (60; 600)")
    ap.add_argument("--before", default=None, help="an older revision to run the same ladders on (e.g. 01dae75)")
    ap.add_argument("--levels", default="pool,cache,hybrid")
    ap.add_argument("--ladder-max", type=int, default=None, help="at most this many rungs per ladder (a quick try)")
    ap.add_argument("--start", default="",
                    help="start ladders at these rungs, e.g. pool:8:12,cache:8:10,hybrid:6:6 (depth 0: whole)")
    ap.add_argument("--workers", type=int, default=1,
                    help="kvspec mc --workers N for every configuration (1: one process; the cap is wall-clock)")
    ap.add_argument("--calibrate", default="pool:5:8", metavar="LEVEL:BLOCKS:DEPTH",
                    help="first run this rung once, one process, and record its seconds: the same work on every "
                         "day and machine, so reports taken on different days can be scaled ('none': skip)")
    ap.add_argument("--out", default="reports")
    ap.add_argument("--render", metavar="JSON", default=None,
                    help="only write the Markdown report again from a JSON file this script wrote")
    a = ap.parse_args(argv)
    if a.render:
        path = Path(a.render)
        path.with_suffix(".md").write_text(markdown(json.loads(path.read_text())))
        return 0
    levels = [x for x in a.levels.split(",") if x]
    bad = [x for x in levels if x not in LADDERS]
    if bad:
        ap.error(f"unknown level(s) {bad}; choose from {list(LADDERS)}")
    try:
        start = {lv: (b, d) for lv, b, d in (_rung(x) for x in a.start.split(",") if x)}
    except ValueError:
        ap.error(f"--start {a.start!r}: level:blocks:depth,...")
    calib: Optional[tuple[str, int, int]] = None
    if a.calibrate != "none":
        try:
            calib = _rung(a.calibrate)
        except ValueError:
            ap.error(f"--calibrate {a.calibrate!r}: level:blocks:depth, or none")
        if calib[0] not in LADDERS:
            ap.error(f"--calibrate: unknown level {calib[0]!r}")
    bad = [f"{lv}:{b}:{d}" for lv, (b, d) in start.items() if lv not in LADDERS or (b, d) not in LADDERS[lv]["ladder"]]
    if bad:
        ap.error(f"--start: no such rung(s) {bad}")
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True).stdout.strip())
    data: dict = {"cap": a.cap, "levels": levels, "runs": {}, "revs": {"after": head + ("+working tree" if dirty else "")},
                  "command": "python benchmarks/mc_largest.py " + " ".join(shlex.quote(x) for x in (argv or sys.argv[1:])),
                  "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python "
                             f"{platform.python_version()}"}
    trees = []
    if a.before:
        tmp, wt = worktree(a.before)
        trees.append(("before", wt, (tmp, wt)))
        data["revs"]["before"] = a.before
    trees.append(("after", ROOT, None))
    try:
        if calib is not None:   # (this checkout's code: what the day's machine gives on a fixed search)
            r = run_one(ROOT, *calib, a.cap)
            data["calibration"] = {"level": calib[0], "blocks": calib[1], "depth": calib[2], "states": r.get("states"),
                                   "seconds": r.get("seconds"), "load": r["load"], "ok": r["ok"]}
        for tag, root, _ in trees:
            data["runs"][tag] = {lv: ladder(root, lv, a.cap, a.ladder_max, tag, start.get(lv), a.workers) for lv in levels}
    finally:
        for _, _, drop in trees:
            if drop is not None:
                drop_worktree(*drop)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    # the 60 s report is mc_largest.md; another cap gets its own (mc_largest_600s.md), so both stay
    stem = "mc_largest" if a.cap == 60 else f"mc_largest_{a.cap:g}s"
    (out / f"{stem}.json").write_text(json.dumps(data, indent=1) + "\n")
    (out / f"{stem}.md").write_text(markdown(data))
    print(markdown(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
