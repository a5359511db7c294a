"""Findings written to ``--report-dir``, in three forms:

* ``kvspec-check.json``: ``CheckReport.to_dict()``, the same object ``--json`` prints (tools);
* ``kvspec-check.md``: for people. Each finding's steps as a table (what the target
  returned and what the reference model expected at each step), and a before-and-after
  view of the blocks (ref count, hash, queued), the free queue, the free count and the
  request tables at the failing step, from a replay of the steps;
* ``kvspec-check.junit.xml``: JUnit XML for CI systems. One testcase per level and
  invariant; a violation is a ``<failure>`` on its testcase with the message, the
  steps and the repro path. A robustness finding (a misuse the target documents no
  defence for) is not a violation and does not fail the run (the exit code is 0): it
  is reported in the testcase's ``<system-out>`` and as a property.
"""
from __future__ import annotations

import json
import os
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Optional, Sequence

from kvspec.atomic_write import write_atomic
from kvspec.spec.invariants import CATALOGUE, title

JSON_NAME = "kvspec-check.json"
MD_NAME = "kvspec-check.md"
JUNIT_NAME = "kvspec-check.junit.xml"

# Invariants whose checks only ever fire at the cache level (they read requests).
CACHE_ONLY = frozenset({"I2", "MAX_HIT", "MIN_HIT", "KV_INTEGRITY"})
FULL_VIEW_BLOCKS = 32  # pools up to this size show every block; larger ones the changed ones


def write_check_reports(report, directory: str, target: Any = None) -> list[Path]:
    """Write the three files; ``target`` (a loaded Target) is used to replay each
    finding for the before-and-after view, and is loaded from the report when None."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    data = report.to_dict()
    if getattr(report, "coverage", None):  # what the verdict covered (kvspec.check.coverage)
        data["coverage"] = report.coverage
    paths = [d / JSON_NAME, d / MD_NAME, d / JUNIT_NAME]
    write_atomic(paths[0], json.dumps(data, indent=1, default=str) + "\n")
    views = [step_view(_target(report, target), f) for f in report.violations + report.robustness]
    write_atomic(paths[1], check_markdown(report, views, d))
    write_atomic(paths[2], check_junit(report))
    return paths


def _target(report, target: Any) -> Any:
    if target is not None or report.error:
        return target
    if not (report.violations or report.robustness):
        return None
    try:
        from kvspec.targets.registry import load_target
        return load_target(report.target, patch=report.patch)
    except Exception:  # the view is a convenience: the report is written without it
        return None


# -- replaying a finding for the before-and-after view ---------------------------------
def step_view(target: Any, finding) -> Optional[dict]:
    """Replay ``finding.steps`` on a fresh allocator: per step what the target returned
    and what the model expected, and the observations before and after the last step."""
    if target is None:
        return None
    from kvspec.check.session import Session

    try:
        s = Session(target, finding.config, incremental=False)
        rows = []
        before = s.obs
        for i, op in enumerate(finding.steps):
            why = s.misuse_reason(op)  # the session's own model, before the step
            if i == len(finding.steps) - 1:
                before = s.obs
            found = s.apply(op)
            expected = f"misuse: {why}" if why is not None else _show(getattr(s, "last_expected", None))
            rows.append({"op": op, "result": _show(s.last_result), "expected": expected,
                         "found": sorted({v.invariant for v in found})})
        return {"rows": rows, "before": before, "after": s.obs}
    except Exception as e:  # a target that cannot replay: say so in the report
        return {"error": f"{type(e).__name__}: {e}"}


def _show(v: Any) -> str:
    if v is None:
        return "None"
    if isinstance(v, tuple):
        return str(list(v))
    return str(v)


# -- Markdown ----------------------------------------------------------------------
def _cell(x: Any) -> str:
    return str(x).replace("|", "\\|").replace("\n", " ")


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(_cell(c) for c in r) + " |" for r in rows]
    return out


def _arrow(a: Any, b: Any) -> str:
    return f"{a}" if a == b else f"**{a} → {b}**"


def blocks_view(before, after, ids: Optional[Sequence[int]] = None) -> list[str]:
    """The blocks table: ref count, hash and queued, before → after (changes in bold)."""
    n = max(len(before.blocks), len(after.blocks))
    if ids is None:
        ids = range(n) if n <= FULL_VIEW_BLOCKS else [
            i for i in range(n) if i >= len(before.blocks) or i >= len(after.blocks)
            or before.blocks[i] != after.blocks[i]]
    rows = []
    for i in ids:
        b = before.blocks[i] if i < len(before.blocks) else None
        a = after.blocks[i] if i < len(after.blocks) else None
        ref = _arrow(b.ref if b else "-", a.ref if a else "-")
        h = _arrow(before.short_hash(b.hash) if b else "-", after.short_hash(a.hash) if a else "-")
        q = _arrow(("yes" if b.queued else "no") if b else "-", ("yes" if a.queued else "no") if a else "-")
        note = "null block" if i == after.null_block else ""
        rows.append([i, ref, h, q, note])
    out = _table(["block", "ref count", "hash", "queued", ""], rows)
    out.append("")
    out += _table(["", "before", "after"], [
        ["free queue (front first)", list(before.queue), list(after.queue)],
        ["free count", before.free_count, after.free_count],
        ["hash index", _index(before), _index(after)],
    ] + [[f"request {rid}", _req(before, rid), _req(after, rid)]
         for rid in sorted(set(before.requests) | set(after.requests))])
    return out


def _index(o) -> str:
    items = sorted((o.short_hash(h), list(ids)) for h, ids in o.index.items())
    return ", ".join(f"{h} → {ids}" for h, ids in items) or "empty"


def _req(o, rid: str) -> str:
    rs = o.requests.get(rid)
    return "-" if rs is None else f"table {list(rs.table)}, computed {rs.computed}"


def _rel(path: Optional[str], base: Path) -> Optional[str]:
    if not path:
        return None
    try:
        return os.path.relpath(path, base)
    except ValueError:
        return path


def _finding_md(n: int, f, view: Optional[dict], base: Path) -> list[str]:
    v = f.violations[0]
    label = "Violation" if f.kind == "violation" else "Robustness finding"
    out = [f"### {n}. {label}: {title(v.invariant)} at the {f.level} level", "",
           f"{v.message}", "",
           f"> {CATALOGUE.get(v.invariant, '')}", ""]
    cfg = f.config
    out.append(f"- configuration: {cfg.num_blocks} blocks" + (f", block size {cfg.block_size}" if f.level == "cache" else "")
               + f", prefix caching {'on' if cfg.caching else 'off'}")
    out.append(f"- {len(f.steps)} steps" + ("" if f.minimal is None else f" (minimal: {str(f.minimal).lower()})")
               + f"; Hypothesis's sequence had {f.shrunk_steps}")
    if f.seconds_to_failure is not None:
        out.append(f"- found after {f.seconds_to_failure:.2f} s")
    if f.repro:
        rel = _rel(f.repro, base)
        out.append(f"- repro: [`{f.repro}`]({rel}) (replay: `python -m pytest {f.repro}`)")
    if v.excerpt:
        out.append(f"- state: `{v.excerpt}`")
    if f.kind == "violation":
        out.append(f"- signature: {_signature(f)}")
    from kvspec.check.hints import finding_lines
    out += [f"- {line.strip()}" for line in finding_lines(f)]
    out.append("")
    out.append("#### Steps")
    out.append("")
    if view and "rows" in view:
        rows = []
        for i, r in enumerate(view["rows"]):
            rows.append([i + 1, f"`{r['op']!r}`", r["result"], r["expected"],
                         ", ".join(r["found"]) or ("" if i < len(view["rows"]) - 1 else "-")])
        out += _table(["#", "operation", "target returned", "reference model", "violations"], rows)
    else:
        out += _table(["#", "operation"], [[i + 1, f"`{op!r}`"] for i, op in enumerate(f.steps)])
    out.append("")
    if view and "before" in view:
        k = len(f.steps)
        what = f"step {k}, `{f.steps[-1]!r}`" if k else "construction"
        out.append(f"#### Blocks before and after {what}")
        out.append("")
        out += blocks_view(view["before"], view["after"])
        out.append("")
    elif view and "error" in view:
        out += [f"(The steps could not be replayed for the block view: {view['error']}.)", ""]
    return out


def _signature(f) -> str:
    from kvspec.spec.violation import signature_text
    return signature_text(f.signature)


def check_markdown(report, views: Sequence[Optional[dict]] = (), base: Path = Path(".")) -> str:
    d = report.to_dict()
    verdict = {"pass": "pass: nothing found", "violation": "VIOLATION", "error": "error",
               "incomplete": "incomplete: nothing found so far"}.get(report.verdict, report.verdict)
    if getattr(report, "interrupted", None):
        verdict += f" (INCOMPLETE: stopped by {report.interrupted}; the counts are what was reached)"
    out = [f"# kvspec check: {report.target}" + (f" + {report.patch}" if report.patch else ""), "",
           f"**Verdict: {verdict}**", ""]
    out += _table(["", ""], [
        ["target", report.target], ["patch", report.patch or "-"],
        ["declaration", getattr(report, "declaration", "") or "-"], ["levels", ", ".join(report.levels)],
        ["misuse ops", "on" if report.misuse else "off"], ["seed", report.seed], ["stop rule", stop_rule(report)],
        ["examples", report.examples], ["steps", report.steps], ["seconds", f"{report.seconds:.2f}"],
        ["steps / second", d["steps_per_second"] if d["steps_per_second"] is not None else "-"],
    ])
    out.append("")
    if report.error:
        out += ["## Error", "", f"`{report.error}`", ""]
    findings = report.violations + report.robustness
    views = list(views) + [None] * (len(findings) - len(views))
    if report.violations:
        out += ["## Violations", ""]
        for i, f in enumerate(report.violations):
            out += _finding_md(i + 1, f, views[i], base)
    if report.robustness:
        out += ["## Robustness findings", "",
                "Misuses the target documents no defence for: not violations under valid use.", ""]
        for j, f in enumerate(report.robustness):
            out += _finding_md(j + 1, f, views[len(report.violations) + j], base)
    from kvspec.check.hints import assuming_markdown
    out += assuming_markdown(report)
    out += _coverage_md(report)
    out += ["## Invariants checked", "",
            "Every invariant is checked after every step of every example (after a violation the search goes on "
            f"with its signature excluded, up to {getattr(report, 'max_findings', 1)} distinct finding(s)).", ""]
    out += _table(["id", "what must hold", "result"], [
        [title(inv), text, _result(report, inv)] for inv, text in CATALOGUE.items()])
    return "\n".join(out) + "\n"


def stop_rule(report) -> str:
    """How the search was told to stop: the one rule the run used."""
    if getattr(report, "max_examples", None) is not None:
        return f"--max-examples {report.max_examples} (deterministic: example counts, never the clock)"
    return f"--budget {report.budget:g} s (time: the count depends on the machine)"


def _coverage_md(report) -> list[str]:
    cov = getattr(report, "coverage", None)
    if not cov:
        return []
    out = ["## What this run covered", ""]
    out += [f"**Note:** {n}." for n in cov["notes"]] + ([""] if cov["notes"] else [])
    out += _table(["level", "operations drawn", "never drawn", "target methods never called"], [
        [lv, ", ".join(f"{k} ({n})" for k, n in c["ops_drawn"].items()) or "none",
         ", ".join(c["ops_never_drawn"]) or "none", ", ".join(c["methods_never_called"]) or "none"]
        for lv, c in cov["levels"].items()])
    return out + [""]


def _result(report, inv: str) -> str:
    if any(f.invariant == inv for f in report.violations):
        return "**violated**"
    if inv == "ATOMIC_REJECT" and not report.misuse:
        return "not exercised (no --misuse)"
    if inv in CACHE_ONLY and "cache" not in report.levels:
        return "not exercised (cache level only)"
    why = (getattr(report, "not_exercised", None) or {}).get(inv)
    if why:
        return f"not exercised ({why})"
    if report.error:
        return "-"
    robust = sum(f.invariant == inv for f in report.robustness)
    return f"no violation; {robust} robustness finding(s)" if robust else "no violation found"


# -- JUnit XML ------------------------------------------------------------------------
def _levels_invariants(report) -> list[tuple[str, str]]:
    out = []
    for level in report.levels:
        for inv in CATALOGUE:
            if level == "pool" and inv in CACHE_ONLY:
                continue
            if inv == "ATOMIC_REJECT" and not report.misuse:
                continue
            if inv in (getattr(report, "not_exercised", None) or {}):
                continue  # its check never ran: no testcase that could only pass
            out.append((level, inv))
    return out


def _steps_text(f) -> str:
    v = f.violations[0]
    lines = [v.message]
    if v.excerpt:
        lines.append(f"state: {v.excerpt}")
    lines.append(f"{len(f.steps)} steps on {f.config.num_blocks} blocks"
                 + ("" if f.minimal is None else f" (minimal: {str(f.minimal).lower()})") + ":")
    lines += [f"  {i + 1}. {op!r}" for i, op in enumerate(f.steps)]
    if f.repro:
        lines.append(f"repro: {f.repro}")
    return "\n".join(lines)


def check_junit(report) -> bytes:
    cases = _levels_invariants(report)
    # distinct findings of one invariant on one level (two crash sites, say): the first in
    # that invariant's testcase, each further one in a testcase of its own ("NO_CRASH #2")
    viol: dict[tuple, Any] = {}
    extra: list = []
    for f in report.violations:
        if (f.level, f.invariant) in viol:
            extra.append(f)
        else:
            viol[(f.level, f.invariant)] = f
    robust: dict[tuple[str, str], list] = {}
    for f in report.robustness:
        robust.setdefault((f.level, f.invariant), []).append(f)
    # a finding on an invariant the table leaves out still gets its testcase
    for key in list(viol) + list(robust):
        if key not in cases:
            cases.append(key)
    errors = 1 if report.error else 0
    name = f"kvspec check {report.target}" + (f" + {report.patch}" if report.patch else "")
    tests = len(cases) + len(extra) + errors
    root = ET.Element("testsuites", name="kvspec", tests=str(tests), failures=str(len(report.violations)),
                      errors=str(errors), time=f"{report.seconds:.3f}")
    suite = ET.SubElement(root, "testsuite", name=name, tests=str(tests), failures=str(len(report.violations)),
                          errors=str(errors), skipped="0", time=f"{report.seconds:.3f}")
    props = ET.SubElement(suite, "properties")
    for k, val in (("target", report.target), ("patch", report.patch or ""), ("seed", report.seed),
                   ("budget", report.budget), ("misuse", report.misuse), ("examples", report.examples),
                   ("steps", report.steps), ("verdict", report.verdict),
                   ("complete", getattr(report, "interrupted", None) is None),
                   ("declaration", getattr(report, "declaration", ""))):
        ET.SubElement(props, "property", name=k, value=str(val))
    for f in report.violations:
        for h in () if getattr(f, "disproved", None) else getattr(f, "hints", None) or ():
            ET.SubElement(props, "property", name="policy_hint", value=f"{title(f.invariant)}: {h.text}")
    for a in getattr(report, "assuming", ()):
        ET.SubElement(props, "property", name="assuming", value=a.heading)
    ET.SubElement(props, "property", name="stop_rule", value=stop_rule(report))
    cov = getattr(report, "coverage", None) or {}
    for lv, c in cov.get("levels", {}).items():
        ET.SubElement(props, "property", name=f"{lv}_ops_drawn", value=", ".join(c["ops_drawn"]))
        ET.SubElement(props, "property", name=f"{lv}_ops_never_drawn", value=", ".join(c["ops_never_drawn"]))
        ET.SubElement(props, "property", name=f"{lv}_methods_never_called", value=", ".join(c["methods_never_called"]))
    for n in cov.get("notes", ()):
        ET.SubElement(props, "property", name="coverage_note", value=n)
    seen: dict[tuple, int] = {}
    for level, inv, f in [(lv, i, viol.get((lv, i))) for lv, i in cases] + [(g.level, g.invariant, g) for g in extra]:
        k = seen[(level, inv)] = seen.get((level, inv), 0) + 1
        tc = ET.SubElement(suite, "testcase", classname=f"kvspec.{level}", name=title(inv) + (f" #{k}" if k > 1 else ""),
                           time=f"{f.seconds_to_failure:.3f}" if f is not None and f.seconds_to_failure else "0")
        if f is not None:
            fail = ET.SubElement(tc, "failure", type=inv, message=f"{title(inv)}: {f.violations[0].message}"
                                 + (f" (repro: {f.repro})" if f.repro else ""))
            fail.text = _steps_text(f)
        if k > 1:
            continue  # the robustness findings went with the first
        rs = robust.get((level, inv))
        if rs:
            tprops = ET.SubElement(tc, "properties")
            for r in rs:
                ET.SubElement(tprops, "property", name="robustness", value=f"{r.violations[0].message} (repro: {r.repro})")
            out = ET.SubElement(tc, "system-out")
            out.text = "\n\n".join("robustness finding (a misuse with no documented defence; not a violation):\n"
                                   + _steps_text(r) for r in rs)
    if report.error:
        tc = ET.SubElement(suite, "testcase", classname="kvspec", name="run")
        ET.SubElement(tc, "error", type="error", message=report.error).text = report.error
    ET.indent(root)
    return ET.tostring(root, encoding="utf-8", xml_declaration=True) + b"\n"
