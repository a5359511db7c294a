"""A campaign's report: ``campaign.md``, ``campaign-report.json``, ``campaign.junit.xml`` and
``campaign_ttf.png`` (time to failure) in the results directory.

JUnit: one testcase per job (its label), a ``failure`` for a violation, an ``error``
for a job that gave no verdict, so a CI system shows the matrix as a test suite.
"""
from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Optional

from kvspec.atomic_write import write_atomic
from kvspec.campaign.findings import dedup

# campaign.json is the matrix's manifest (store.py); the report's JSON is campaign-report.json
NAMES = {"md": "campaign.md", "json": "campaign-report.json", "junit": "campaign.junit.xml", "png": "campaign_ttf.png"}


def summarize(name: str, campaign_file: str, records: list[dict], seconds: float, skipped: int,
              address: Optional[str]) -> dict[str, Any]:
    counts = {v: sum(1 for r in records if r.get("verdict") == v) for v in ("pass", "violation", "fail", "error")}
    verdict = "violation" if counts["violation"] else "fail" if counts["fail"] else "error" if counts["error"] else "pass"
    return {"command": "campaign", "campaign": name, "file": campaign_file, "verdict": verdict,
            "jobs": len(records), "counts": counts, "skipped_done": skipped, "seconds": round(seconds, 1),
            "address": address or "local",
            "findings": dedup(records),
            "results": [{k: r.get(k) for k in ("id", "label", "command", "verdict", "error", "seconds", "node",
                                               "exit_code", "argv", "repro_files")} | _brief(r) for r in records]}


def _brief(r: dict) -> dict:
    res = r.get("result") or {}
    keep = ("examples", "steps", "states", "transitions", "invariant", "deterministic")
    return {k: res[k] for k in keep if k in res}


def _ttf_rows(records: list[dict]) -> list[dict]:
    """One row per job group (the label without its seed), its jobs' times to failure."""
    groups: dict[str, list[Optional[float]]] = {}
    for r in records:
        if r.get("verdict") not in ("pass", "violation", "fail"):
            continue
        res = r.get("result") or {}
        if r.get("command") == "patches":
            for t in res.get("trials") or []:
                groups.setdefault(f"patch {t.get('id')}", []).append(t.get("seconds_to_failure") if t.get("killed")
                                                                    else None)
            continue
        name = re.sub(r"\s*seed=\S+", "", r.get("label") or r["id"])
        if r["verdict"] == "violation":
            first = next(iter((res.get("violations") or [])), {})
            ttf = first.get("seconds_to_failure") or res.get("seconds") or r.get("seconds")
            groups.setdefault(name, []).append(float(ttf))
        else:
            groups.setdefault(name, []).append(None)
    return [{"name": k, "seconds_to_failure": v} for k, v in groups.items()]


def markdown(s: dict, png: Optional[str]) -> str:
    c = s["counts"]
    lines = [f"# kvspec campaign `{s['campaign']}`", "",
             f"`kvspec campaign {s['file']}` on {s['address']} Ray: **{s['verdict']}**. {s['jobs']} jobs: "
             f"{c['pass']} pass, {c['violation']} violation, {c['fail']} fail, {c['error']} error ({s['skipped_done']} finished in "
             f"an earlier run and skipped); {s['seconds']} s.", "",
             f"## Findings ({len(s['findings'])} distinct, by invariant and minimal repro)", ""]
    for f in s["findings"]:
        lines.append(f"- **{f['invariant']}** ({f['kind']}, {len(f['steps'])} steps"
                     f"{', minimal' if f['minimal'] else ''}), seen {f['count']} time(s) in "
                     f"{len(f['jobs'])} job(s): {f['message']}")
        if f["steps"] and f["kind"] != "killed patch":
            lines.append(f"  repro: `{'; '.join(f['steps'])}`")
        lines.append(f"  jobs: {', '.join(f['labels'][:8])}" + (" ..." if len(f["labels"]) > 8 else ""))
    if not s["findings"]:
        lines.append("None.")
    lines += ["", "## Jobs", "", "| job | verdict | seconds | node | command |", "|---|---|---|---|---|"]
    for r in s["results"]:
        err = f" ({r['error']})" if r.get("error") else ""
        cmd = " ".join(r.get("argv") or []).replace("|", "/")
        lines.append(f"| {r.get('label') or r['id']} | {r['verdict']}{err.replace('|', '/')} | {r.get('seconds')} | "
                     f"{r.get('node') or '-'} | `{cmd}` |")
    if png:
        lines += ["", f"![time to failure]({Path(png).name})"]
    return "\n".join(lines) + "\n"


def junit(s: dict) -> bytes:
    c = s["counts"]
    root = ET.Element("testsuites", name="kvspec campaign", tests=str(s["jobs"]), failures=str(c["violation"] + c["fail"]),
                      errors=str(c["error"]), time=f"{s['seconds']:.3f}")
    suite = ET.SubElement(root, "testsuite", name=f"kvspec campaign {s['campaign']}", tests=str(s["jobs"]),
                          failures=str(c["violation"] + c["fail"]), errors=str(c["error"]), skipped="0",
                          time=f"{s['seconds']:.3f}")
    by_job: dict[str, list[dict]] = {}
    for f in s["findings"]:
        for j in f["jobs"]:
            by_job.setdefault(j, []).append(f)
    for r in s["results"]:
        tc = ET.SubElement(suite, "testcase", classname=f"kvspec.campaign.{r['command']}",
                           name=r.get("label") or r["id"], time=f"{float(r.get('seconds') or 0):.3f}")
        if r["verdict"] == "violation":
            fs = by_job.get(r["id"], [])
            msg = "; ".join(f"{f['invariant']}: {f['message']}" for f in fs) or "violation"
            ET.SubElement(tc, "failure", type="violation", message=msg).text = "\n\n".join(
                "\n".join(f["steps"]) for f in fs)
        elif r["verdict"] == "fail":
            ET.SubElement(tc, "failure", type="fail", message="the corpus run missed a bug or killed an "
                          "equivalent mutant").text = str((r.get("result") or {}).get("summary", ""))
        elif r["verdict"] == "error":
            ET.SubElement(tc, "error", type="error", message=str(r.get("error"))).text = str(r.get("error"))
    ET.indent(root)
    return ET.tostring(root, encoding="utf-8", xml_declaration=True) + b"\n"


def write(s: dict, records: list[dict], directory: str | Path) -> list[str]:
    """Write the four files; a figure that cannot be drawn leaves the other three."""
    d = Path(directory)
    png: Optional[str] = None
    rows = _ttf_rows(records)
    if any(x is not None for r in rows for x in r["seconds_to_failure"]):
        try:
            from kvspec.report.figures import ttf_per_bug
            png = str(ttf_per_bug(rows, d / NAMES["png"], title=f"campaign {s['campaign']}: time to failure"))
        except Exception as e:  # matplotlib missing or broken: the report stands without its figure
            s.setdefault("warnings", []).append(f"figure not drawn: {type(e).__name__}: {e}")
    write_atomic(d / NAMES["json"], json.dumps(s, indent=1, default=str) + "\n")
    write_atomic(d / NAMES["md"], markdown(s, png))
    write_atomic(d / NAMES["junit"], junit(s))
    return [str(d / NAMES[k]) for k in ("md", "json", "junit")] + ([png] if png else [])
