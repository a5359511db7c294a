"""Benchmark ``kvspec mc`` (issue 14): distinct states per CPU second with the state
invariants checked after every transition (before) and once per distinct state (after,
the default), side by side in one run; the wall-clock rate of ``--workers 2`` against
one process; which checks of the catalogue are state checks.

    python benchmarks/bench_mc.py [--quick] [--reps N] [--out reports]

Writes ``reports/mc.json`` (every number) and ``reports/mc.md`` (the whole report; the
kvspec-vs-TLC comparison is ``reports/mc_tlc.md``, written by
``benchmarks/tlc/compare.py``, and mc.md only links to it). The runs of each
configuration alternate (before, after, before, after ...) within this one process, so
both modes see the same machine load; the fastest CPU time of each is reported, and the
state counts of every run must be equal (the script stops otherwise).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvspec.mc.enumerate_ops import Bounds  # noqa: E402
from kvspec.mc.search import model_check  # noqa: E402
from kvspec.mc.split import StepChecker  # noqa: E402
from kvspec.spec.config import Config  # noqa: E402
from kvspec.targets import load_target  # noqa: E402

# (level, usable blocks, depth, symmetry): issue 14's two acceptance configurations
CHECK_ONCE_CONFIGS = [("pool", 5, 8, True), ("pool", 4, 8, False)]
QUICK_CONFIGS = [("pool", 4, 6, True), ("pool", 3, 6, False)]


def cfg(level: str, usable: int) -> Config:
    return Config(level=level, num_blocks=usable + 1, block_size=2)


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def one_run(target, level: str, usable: int, depth: int, symmetry: bool, *, check_once: bool = True,
            workers: int = 1) -> dict:
    load0 = os.getloadavg()[0]
    c0, k0, w0 = time.process_time(), _children_cpu(), time.perf_counter()
    r = model_check(target, cfg(level, usable), depth, Bounds(symmetry=symmetry), time_cap=3600,
                    mem_cap_gib=8.0, check_once=check_once, workers=workers)
    cpu, kids, wall = time.process_time() - c0, _children_cpu() - k0, time.perf_counter() - w0
    return {"level": level, "blocks": usable, "depth": depth, "symmetry": symmetry, "check_once": check_once,
            "workers": r.workers, "verdict": r.verdict, "states": r.states, "transitions": r.transitions,
            "levels": r.levels, "state_checks": r.state_checks, "fork": r.fork,
            "cpu_seconds": round(cpu + kids, 3), "wall_seconds": round(wall, 3),
            "parent_cpu_seconds": round(cpu, 3), "worker_cpu_seconds": round(kids, 3),
            "states_per_cpu_second": round(r.states / max(cpu + kids, 1e-9), 1),
            "states_per_wall_second": round(r.states / max(wall, 1e-9), 1),
            "us_per_transition_cpu": round((cpu + kids) / max(r.transitions, 1) * 1e6, 1),
            "load_before": round(load0, 2), "load_after": round(os.getloadavg()[0], 2)}


def side_by_side(target, configs, reps: int, modes: list[tuple[str, dict]]) -> list[dict]:
    """Each configuration in each mode, alternating, ``reps`` times; the fastest of each."""
    out = []
    for level, usable, depth, sym in configs:
        runs: dict[str, list[dict]] = {name: [] for name, _ in modes}
        for _ in range(reps):
            for name, kw in modes:
                r = one_run(target, level, usable, depth, sym, **kw)
                runs[name].append(r)
                print(f"  {level} {usable} blocks depth {depth} symmetry {'on' if sym else 'off'} {name}: "
                      f"{r['states']:,} states, {r['cpu_seconds']} CPU s, {r['wall_seconds']} s, "
                      f"load {r['load_before']}", file=sys.stderr)
        counts = {(r["states"], r["transitions"], tuple(r["levels"])) for rs in runs.values() for r in rs}
        if len(counts) != 1:
            raise SystemExit(f"state counts differ between modes: {counts}")
        best = {name: min(rs, key=lambda r: r["cpu_seconds"]) for name, rs in runs.items()}
        best_wall = {name: min(rs, key=lambda r: r["wall_seconds"]) for name, rs in runs.items()}
        out.append({"level": level, "blocks": usable, "depth": depth, "symmetry": sym, "reps": reps,
                    "best": best, "best_wall": best_wall, "all": runs})
    return out


def fmt(v) -> str:
    if isinstance(v, bool):
        return "on" if v else "off"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:,.2f}" if v < 100 else f"{v:,.0f}"
    return str(v)


def write_md(res: dict, path: Path) -> None:
    q = " --quick" if res["quick"] else ""
    cmd = f"python benchmarks/bench_mc.py{q} --reps {res['reps']}"
    L = [
        "# kvspec mc: benchmark",
        "",
        f"Generated, whole, by `{cmd}` on {res['machine']} ({res['cores']} cores), target `impl` "
        f"(this repository's allocator), default domains (`kvspec.mc.enumerate_ops.Bounds()`), in "
        f"{res['seconds_total']:.0f} s. **The machine is shared with other work while this runs** "
        f"(load average {res['load_start']} at the start, {res['load_end']} at the end, on {res['cores']} cores): "
        "wall-clock rates vary with that load; CPU seconds (the search process's own, plus its worker "
        "processes') vary much less, so the check-once comparison is in states per CPU second. The runs of each "
        "configuration alternate between the modes compared, within this one run, and the fastest of each is "
        "shown; every run of a configuration saw the same states, transitions and states per level (the script "
        "stops otherwise).",
        "",
        "## kvspec vs TLC",
        "",
        "<!-- TLC comparison: written by benchmarks/tlc/compare.py to reports/mc_tlc.md, not here -->",
        "The side-by-side comparison with TLC on the same spec is [mc_tlc.md](mc_tlc.md), written whole by "
        "`python benchmarks/tlc/compare.py`.",
        "",
        "## A state checked once, as TLC does",
        "",
        "**Before**: every invariant after every transition (`kvspec mc --check-once off`). **After**: the "
        "transition checks after every transition, the state checks only when the post-state's key is new "
        "(`kvspec mc --check-once on`, the default; the soundness argument is in `kvspec/mc/search.py`'s "
        "docstring). Commands of the same searches:",
        "",
    ]
    for row in res["check_once"]:
        L.append(f"- `kvspec mc --target impl --level {row['level']} --blocks {row['blocks']} --depth {row['depth']} "
                 f"--symmetry {fmt(row['symmetry'])} --check-once off|on --json`")
    L += ["", "| level | blocks | depth | symmetry | states | transitions | mode | state checks | CPU s "
          "| states / CPU s | µs / transition (CPU) | wall s | load |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in res["check_once"]:
        for name in ("before", "after"):
            b = row["best"][name]
            L.append(f"| {row['level']} | {row['blocks']} | {row['depth']} | {fmt(row['symmetry'])} | {fmt(b['states'])} "
                     f"| {fmt(b['transitions'])} | **{name}** | {fmt(b['state_checks'])} | {b['cpu_seconds']:.2f} "
                     f"| {fmt(b['states_per_cpu_second'])} | {b['us_per_transition_cpu']} | {b['wall_seconds']:.2f} "
                     f"| {b['load_before']} |")
    L += ["", "| configuration | after / before (states per CPU second) |", "|---|---|"]
    for row in res["check_once"]:
        ratio = row["best"]["after"]["states_per_cpu_second"] / max(row["best"]["before"]["states_per_cpu_second"], 1e-9)
        row["ratio"] = round(ratio, 3)
        L.append(f"| {row['level']}, {row['blocks']} blocks, depth {row['depth']}, symmetry {fmt(row['symmetry'])} "
                 f"| **{ratio:.2f}x** |")
    split = res["split"]
    L += ["", "Which checks are state checks (read from each check's compiled code by `kvspec.mc.split`: a check that "
          "reads the step, `prev`/`op`/`result`/`expected`/`misuse`/`error`, or names the hash "
          "history or the shadow, which it may write, is a transition check):", "",
          f"- state checks, once per distinct state: {', '.join(f'`{n}`' for n in split['state'])}",
          f"- transition checks, every transition: {', '.join(f'`{n}`' for n in split['transition'])}", "",
          "The gain is bounded by the share of a transition's time the state checks take: the target step, the "
          "model step, the observation, the fork and the key still run on every transition, and most of the "
          "catalogue reads the step (the result against the model, the queue against the policy).", ""]
    w = res["workers"]
    if w:
        L += ["## `--workers 2` against one process", "",
              "Level-synchronous parallel breadth-first search (`kvspec.mc.parallel`): each level's frontier is cut "
              "into chunks that the search and N - 1 forked workers claim from a shared counter, and the records are "
              "merged in frontier order. Wall-clock rate on this "
              f"{res['cores']}-core machine (see the load column: a speed-up needs two idle cores). CPU s counts "
              "the worker processes too.", ""]
        for row in w:
            L.append(f"- `kvspec mc --target impl --level {row['level']} --blocks {row['blocks']} --depth {row['depth']} "
                     f"--symmetry {fmt(row['symmetry'])} --workers 1|2 --json`")
        L += ["", "| level | blocks | depth | symmetry | states | transitions | workers | wall s | states / wall s "
              "| CPU s | load |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for row in w:
            for name in ("1 worker", "2 workers"):
                b = row["best_wall"][name]
                L.append(f"| {row['level']} | {row['blocks']} | {row['depth']} | {fmt(row['symmetry'])} "
                         f"| {fmt(b['states'])} | {fmt(b['transitions'])} | {b['workers']} | {b['wall_seconds']:.2f} "
                         f"| {fmt(b['states_per_wall_second'])} | {b['cpu_seconds']:.2f} | {b['load_before']} |")
            ratio = row["best_wall"]["2 workers"]["states_per_wall_second"] / \
                max(row["best_wall"]["1 worker"]["states_per_wall_second"], 1e-9)
            row["ratio"] = round(ratio, 3)
            one, two = row["best"]["1 worker"], row["best"]["2 workers"]
            total = two["parent_cpu_seconds"] + two["worker_cpu_seconds"]
            L += ["", f"2 workers / 1 worker, wall-clock rate: **{ratio:.2f}x** (same states, transitions and levels "
                      "in every run).", "",
                  f"Where the CPU time goes (fastest run of each): 1 worker {one['cpu_seconds']:.2f} CPU s; 2 workers "
                  f"{total:.2f} CPU s in all ({two['parent_cpu_seconds']:.2f} in the search process, which expands "
                  f"chunks too and merges, {two['worker_cpu_seconds']:.2f} in the forked worker), "
                  f"{total / max(one['cpu_seconds'], 1e-9):.2f}x the one-process CPU: copy-on-write after each "
                  "fork, the states a worker finds pickled back, keys neither process knew yet within a level.", ""]
    # The same configuration in two sections of one run must see the same states: say so when not.
    counts: dict = {}
    for sec in ("check_once", "workers"):
        for row in res[sec] or []:
            key = (row["level"], row["blocks"], row["depth"], row["symmetry"])
            counts.setdefault(key, set()).update(r["states"] for rs in row["all"].values() for r in rs)
    odd = {k: sorted(v) for k, v in counts.items() if len(v) > 1}
    if odd:
        L += ["## Warning: state counts differ between sections of this run", ""]
        for (level, blocks, depth, sym), v in odd.items():
            L.append(f"- {level}, {blocks} blocks, depth {depth}, symmetry {fmt(sym)}: "
                     f"{', '.join(fmt(x) for x in v)} states in different sections (equal within each section, "
                     "whose runs alternate). This should not happen: report it with mc.json.")
        L.append("")
    L += ["## How the numbers are counted", "",
          "- **states**: distinct canonical states, the initial one included (`kvspec.mc.canonical.state_key`).",
          "- **transitions**: every enabled op tried from every expanded state, including those into a known "
          "state; each is a real target step, a model step, an observation, the transition checks and the key.",
          "- **state checks**: how often the state checks ran (once per new state when on; 0 when off, where "
          "they run inside every transition's full check).",
          "- **CPU s**: `time.process_time()` of the search plus the CPU time of its worker processes "
          "(`RUSAGE_CHILDREN`); **wall s**: `time.perf_counter()`; **load**: the 1-minute load average when the "
          "run started.", ""]
    path.write_text("\n".join(L) + "\n")


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smaller configurations (a smoke run)")
    ap.add_argument("--reps", type=int, default=2, help="alternating repetitions of each mode")
    ap.add_argument("--out", default=str(ROOT / "reports"))
    ap.add_argument("--md-only", action="store_true", help="re-render mc.md from an existing mc.json")
    ap.add_argument("--no-workers", action="store_true", help="skip the --workers runs")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.md_only:
        write_md(json.loads((out / "mc.json").read_text()), out / "mc.md")
        return 0
    t0 = time.monotonic()
    target = load_target("impl")
    configs = QUICK_CONFIGS if a.quick else CHECK_ONCE_CONFIGS
    res = {"quick": a.quick, "reps": a.reps, "cores": os.cpu_count(),
           "machine": f"{platform.machine()}, Python {platform.python_version()}, {_cpu_name()}",
           "load_start": round(os.getloadavg()[0], 2), "split": StepChecker().names()}
    res["check_once"] = side_by_side(target, configs, a.reps,
                                     [("before", {"check_once": False}), ("after", {"check_once": True})])
    res["workers"] = [] if a.no_workers else side_by_side(
        target, configs[:1], a.reps, [("1 worker", {"workers": 1}), ("2 workers", {"workers": 2})])
    res["load_end"] = round(os.getloadavg()[0], 2)
    res["seconds_total"] = round(time.monotonic() - t0, 1)
    write_md(res, out / "mc.md")   # fills in the ratios
    (out / "mc.json").write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {out / 'mc.json'} and {out / 'mc.md'} in {res['seconds_total']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
