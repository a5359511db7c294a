"""Reports of ``kvspec patches``: the combined ``patches.json``, ``patches.md``, the
time-to-failure figure, and the one-screen text summary.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional
from kvspec.atomic_write import replacing, write_atomic
from kvspec.corpus.runner import THRESHOLDS
from kvspec.corpus.stats import _median


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
    base = t.split(" ", 1)[0]  # "impl --only a,b" sorts right after "impl"
    return (TARGET_ORDER.index(base) if base in TARGET_ORDER else len(TARGET_ORDER), t)


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
    # An --only run is a section of its own ("impl --only a,b"): it must not replace the
    # whole corpus's run with a few rows.
    doc["targets"][res.get("section") or res["target"]] = {k: v for k, v in res.items() if k != "reports"}
    return render_reports(doc, report_dir)


def render_reports(doc: dict, report_dir: str) -> list[str]:
    d = Path(report_dir)
    d.mkdir(parents=True, exist_ok=True)
    doc["targets"] = dict(sorted(doc["targets"].items(), key=lambda kv: _target_key(kv[0])))
    write_atomic(d / REPORT_JSON, json.dumps(doc, indent=1, default=str) + "\n")
    written = [str(d / REPORT_JSON)]
    png = _figure(doc, d / REPORT_PNG)
    if png:
        written.append(png)
    write_atomic(d / REPORT_MD, markdown(doc, REPORT_PNG if png else None))
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
           "sources and runs `kvspec check` on it (`run_check`: pool and cache level round-robin, the cache level "
           "first in the first round, valid use, "
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
    out = [f"## Target `{res.get('section') or res['target']}`", "",
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
    with replacing(path) as tmp:
        fig.savefig(tmp, format="png")
    return str(path)


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
