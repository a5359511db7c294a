"""Field study: kvspec on block managers it has never seen, run as a first-time user would.

Why: issue 20 asks whether the first run on someone else's allocator is right. The corpus lives
OUTSIDE this repository (its code is not ours): a directory with one checked-out tree per sampled
repository and a manifest, e.g. /work/field/manifest.json:

    [{"repo": "owner/name", "commit": "<40 hex>", "dir": "owner__name",
      "target": "nanovllm/engine/block_manager.py:BlockManager", "sha1": "...", "note": "..."}, ...]

For each entry the script runs, from the tree's root and with nothing declared,

    kvspec check --target FILE:CLASS --max-examples 300 --seed 0 --json --report-dir <tmp>

with a wall-clock timeout, and records the load result (exit 2 and its one error line), each
finding (invariant, steps, message, hints, label) and the time. Findings are classified by hand,
by reading the manager's code, in tools/field_classes.json, keyed "owner/name@short:INVARIANT"
(one entry per manager and invariant; "owner/name@short:assume:INVARIANT" for a finding under a
hint's assumption when it differs):

    {"owner/name@abc1234:INDEX_CONSISTENT": {"class": "real bug", "reason": "..."}}

class is "real bug", "policy (hint: ...)" or "kvspec error". Unclassified findings show as such.

Outputs: reports/field.json (everything, re-renderable) and reports/field.md.

    python tools/field_study.py --field /work/field            # run all, write both reports
    python tools/field_study.py --only KKKZOZ                  # a subset (merged into field.json)
    python tools/field_study.py --render-only                  # re-render after editing classes
"""
from __future__ import annotations

import argparse
import concurrent.futures
import datetime as dt
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
CLASSES = ROOT / "tools" / "field_classes.json"
OUT_JSON = ROOT / "reports" / "field.json"
OUT_MD = ROOT / "reports" / "field.md"
REAL = "real bug"


def code_state() -> dict[str, Any]:
    """Which kvspec ran: HEAD and whether tracked files differed from it (other helpers' edits)."""
    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *a], capture_output=True, text=True).stdout.strip()
    dirty = [ln[3:] for ln in git("status", "--porcelain", "--untracked-files=no").splitlines()]
    untracked = [ln[3:] for ln in git("status", "--porcelain").splitlines() if ln.startswith("??")]
    return {"head": git("rev-parse", "--short", "HEAD"), "dirty": bool(dirty),
            "modified": dirty, "untracked_kvspec": [p for p in untracked if p.startswith("kvspec/")]}


def kvspec_cmd() -> list[str]:
    """The command a user types; the module form when the script is not on PATH."""
    exe = shutil.which("kvspec")
    return [exe] if exe else [sys.executable, "-m", "kvspec.cli"]


def short(commit: str) -> str:
    return commit[:7]


def key_of(entry: dict[str, Any]) -> str:
    return f"{entry['repo']}@{short(entry['commit'])}"


def finding_of(v: dict[str, Any]) -> dict[str, Any]:
    """The parts of a JSON finding the report needs."""
    return {"invariant": v.get("invariant"), "num_steps": v.get("num_steps"),
            "message": v.get("message"), "steps_text": v.get("steps_text"),
            "hints": v.get("hints") or [], "label": v.get("label"), "also": v.get("also") or [],
            "minimal": v.get("minimal")}


def run_one(entry: dict[str, Any], field: Path, timeout: float, max_examples: int) -> dict[str, Any]:
    """One first-time run: repository root as cwd, FILE:CLASS form, nothing declared."""
    cwd = field / entry["dir"]
    rec: dict[str, Any] = {k: entry.get(k) for k in ("repo", "commit", "dir", "target", "sha1", "note")}
    with tempfile.TemporaryDirectory(prefix="kvspec-field-") as rd:
        cmd = kvspec_cmd() + ["check", "--target", entry["target"], "--max-examples", str(max_examples),
                              "--seed", "0", "--json", "--report-dir", rd]
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # as a user would: no path set
        t0 = time.monotonic()
        try:
            p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
            rc, out, err = p.returncode, p.stdout, p.stderr
        except subprocess.TimeoutExpired as e:
            rc, out, err = None, (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or ""), ""
        rec["seconds"] = round(time.monotonic() - t0, 1)
    rec["rc"] = rc
    rec["stderr_tail"] = [ln for ln in (err or "").splitlines() if ln.strip()][-6:]
    data: Optional[dict[str, Any]] = None
    try:
        data = json.loads(out) if out and out.strip() else None
    except json.JSONDecodeError:
        data = None
    if rc is None:
        rec["result"], rec["error"] = "timeout", f"no verdict within {timeout:.0f} s"
    elif data is None:
        rec["result"] = "crash"
        rec["error"] = (rec["stderr_tail"] or ["no output"])[-1]
    else:
        rec["verdict"] = data.get("verdict")
        rec["declaration"] = data.get("declaration")
        rec["levels"] = data.get("levels")
        rec["examples"], rec["steps"] = data.get("examples"), data.get("steps")
        rec["warnings"] = data.get("warnings") or []
        if data.get("verdict") == "error" or rc == 2:
            rec["result"], rec["error"] = "load error", data.get("error") or (rec["stderr_tail"] or ["?"])[-1]
        else:
            rec["findings"] = [finding_of(v) for v in data.get("violations") or []]
            rec["robustness"] = [finding_of(v) for v in data.get("robustness") or []]
            rec["assuming"] = [{"assume": a.get("assume"), "heading": a.get("heading"),
                                "verdict": a.get("verdict"),
                                "findings": [finding_of(v) for v in a.get("violations") or []]}
                               for a in data.get("assuming") or []]
            rec["result"] = "pass" if not rec["findings"] and not rec["robustness"] else "findings"
    return rec


# -- classification and rendering ---------------------------------------------------------------
def classify(rec: dict[str, Any], classes: dict[str, Any]) -> None:
    base = f"{rec['repo']}@{short(rec['commit'])}"
    for f in rec.get("findings", []) + rec.get("robustness", []):
        c = classes.get(f"{base}:{f['invariant']}") or {}
        f["class"], f["reason"] = c.get("class", "unclassified"), c.get("reason", "")
    for a in rec.get("assuming", []):
        for f in a["findings"]:
            c = classes.get(f"{base}:assume:{f['invariant']}") or classes.get(f"{base}:{f['invariant']}") or {}
            f["class"], f["reason"] = c.get("class", "unclassified"), c.get("reason", "")
    note = classes.get(f"{base}:load") or {}
    if note:
        rec["load_reason"] = note.get("reason", "")
    facts = classes.get(f"{base}:manager") or {}
    rec["stale_index"] = bool(facts.get("stale_index"))
    rec["variant"] = facts.get("variant", "")


def totals(recs: list[dict[str, Any]]) -> dict[str, Any]:
    first = [f for r in recs for f in r.get("findings", []) + r.get("robustness", [])]
    real = [f for f in first if f.get("class") == REAL]
    assumed = [f for r in recs for a in r.get("assuming", []) for f in a["findings"]]
    loaded_stale = [r for r in recs if r.get("stale_index") and r["result"] in ("pass", "findings")]
    idx = ("INDEX_CONSISTENT", "KV_INTEGRITY")
    stale_first = [r for r in loaded_stale
                   if any(f["invariant"] in idx for f in r.get("findings", []) + r.get("robustness", []))]
    stale_assumed = [r for r in loaded_stale if r not in stale_first
                     and any(f["invariant"] in idx for a in r.get("assuming", []) for f in a["findings"])]
    labelled = [f for f in first if f.get("label") in ("bug", "policy") and f.get("class") != "unclassified"]
    agree = [f for f in labelled if (f["label"] == "bug") == (f.get("class") == REAL)]
    return {
        "managers": len(recs),
        "loaded": sum(r["result"] in ("pass", "findings") for r in recs),
        "load_errors": sum(r["result"] == "load error" for r in recs),
        "timeouts": sum(r["result"] in ("timeout", "crash") for r in recs),
        "passed": sum(r["result"] == "pass" for r in recs),
        "with_findings": sum(r["result"] == "findings" for r in recs),
        "findings": len(first),
        "real": len(real),
        "policy": sum((f.get("class") or "").startswith("policy") for f in first),
        "kvspec_error": sum(f.get("class") == "kvspec error" for f in first),
        "unclassified": sum(f.get("class") == "unclassified" for f in first),
        "precision": round(len(real) / len(first), 3) if first else None,
        "stale_index_managers_run": len(loaded_stale),
        "stale_index_reported_first_run": len(stale_first),
        "stale_index_reported_only_under_assumption": len(stale_assumed),
        "stale_index_missed": len(loaded_stale) - len(stale_first) - len(stale_assumed),
        "kvspec_label_agrees": f"{len(agree)}/{len(labelled)}",
        "assuming_findings": len(assumed),
        "assuming_real": sum(f.get("class") == REAL for f in assumed),
    }


def cell(s: Any, n: int = 160) -> str:
    s = " ".join(str(s or "").split()).replace("|", "\\|")
    return s if len(s) <= n else s[: n - 1] + "…"


def render(doc: dict[str, Any]) -> str:
    recs, t = doc["results"], doc["totals"]
    st = doc["code_state"]
    lines = [
        "# Field study: kvspec on block managers it has never seen",
        "",
        f"Written by `{doc['command']}` on {doc['date']}.",
        f"kvspec code state: HEAD `{st['head']}`"
        + (f", tree with uncommitted changes to {len(st['modified'])} tracked files"
           f" and {len(st.get('untracked_kvspec', []))} new kvspec files (other helpers' work in progress)"
           if st["dirty"] or st.get("untracked_kvspec") else ", clean tree") + ".",
        "",
        "Each manager was run exactly as a first-time user would: from the repository's root,",
        f"`kvspec check --target FILE:CLASS --max-examples {doc['max_examples']} --seed 0 --json`,",
        "nothing declared, no PYTHONPATH. The corpus (their code, not ours) is kept outside this",
        "repository; repository and commit identify each file. Distinct = different bytes of the",
        "manager file (byte-identical copies counted once). Classes are by reading each manager's code",
        "(tools/field_classes.json): *real bug*, *policy* (an engine's deliberate choice; the hint",
        "kvspec printed, if any), *kvspec error* (kvspec's call form or a misread).",
        *(["", *[f"> {n}" for n in doc.get("notes", [])]] if doc.get("notes") else []),
        "",
        "## Totals",
        "",
        f"- corpus: {len(doc.get('manifest', [])) or t['managers']} distinct manager files"
        f" ({len({e.get('ast_sha1') for e in doc.get('manifest', [])})} distinct once comments are stripped);"
        f" run: {t['managers']}",
        f"- managers run: {t['managers']}; loaded: {t['loaded']}; failed to load (exit 2): {t['load_errors']};"
        f" timeout/crash: {t['timeouts']}",
        f"- passed: {t['passed']}; with findings: {t['with_findings']}",
        f"- first-run findings: {t['findings']}: real bugs {t['real']}, policy {t['policy']},"
        f" kvspec errors {t['kvspec_error']}, unclassified {t['unclassified']}",
        f"- precision (real bugs / findings): "
        + (f"{t['real']}/{t['findings']} = {t['precision']:.0%}" if t["precision"] is not None else "n/a"),
        f"- managers with a real stale prefix-index entry (by reading the code; most confirmed outside kvspec) that"
        f" loaded: {t['stale_index_managers_run']}; reported as INDEX_CONSISTENT or KV_INTEGRITY among the first-run"
        f" findings: {t['stale_index_reported_first_run']}; only under a hint's assumption:"
        f" {t['stale_index_reported_only_under_assumption']}; missed: {t['stale_index_missed']}",
        f"- kvspec's own label (bug / policy) agrees with the class by reading the code: {t['kvspec_label_agrees']}",
        f"- findings under a hint's assumption (\"assuming ...\"): {t['assuming_findings']},"
        f" real: {t['assuming_real']}",
        "",
        "## Results",
        "",
        "| repository | commit | manager file | result | finding(s) | class | reason |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in recs:
        path = r["target"].rsplit(":", 1)[0]
        head = f"| {r['repo']} | `{short(r['commit'])}` | `{cell(path, 80)}` |"
        if r["result"] in ("pass", "findings"):
            res = f"{r['result']} ({r.get('seconds')} s)"
        else:
            res = f"{r['result']}"
        fs = r.get("findings", []) + r.get("robustness", [])
        if r["result"] in ("load error", "timeout", "crash"):
            lines.append(f"{head} {res} | `{cell(r.get('error'), 180)}` | — | {cell(r.get('load_reason'))} |")
        elif not fs:
            lines.append(f"{head} {res} | — | — | {cell(r.get('load_reason'))} |")
        else:
            for i, f in enumerate(fs):
                hint = "; ".join(h.get("declare") or h.get("text") or "" for h in f.get("hints") or [])
                desc = f"{f['invariant']} in {f['num_steps']} steps" + (f" (hint: `{cell(hint, 80)}`)" if hint else "") \
                    + (f" [kvspec: {f['label']}]" if f.get("label") else "")
                lines.append(f"{head if i == 0 else '| | | |'} {res if i == 0 else ''} | {desc} | {f['class']} |"
                             f" {cell(f['reason'])} |")
        for a in r.get("assuming", []):
            for f in a["findings"]:
                lines.append(f"| | | | | *{cell(a.get('heading'), 80)}*: {f['invariant']} in {f['num_steps']} steps"
                             f" | {f['class']} | {cell(f['reason'])} |")
    ran = {(r["repo"], r["commit"], r["target"]) for r in recs}
    missing = [e for e in doc.get("manifest", []) if (e["repo"], e["commit"], e["target"]) not in ran]
    if missing:
        lines += ["", f"## Not run before the deadline ({len(missing)})", ""]
        lines += [f"- {e['repo']}@{short(e['commit'])} `{e['target']}`" for e in missing]
    if doc.get("compare"):
        cmp = doc["compare"]
        cs = cmp["code_state"]
        base = {(r["repo"], r["commit"]): r for r in recs}
        lines += ["", "## Rerun on a later code state", "",
                  f"`{cmp['command']}` on {cmp['date']}, kvspec HEAD `{cs['head']}`"
                  + (" with uncommitted changes" if cs["dirty"] else "") + ".", "",
                  "| repository | commit | first run above | rerun |", "|---|---|---|---|"]
        def brief(r: Optional[dict[str, Any]]) -> str:
            if r is None:
                return "—"
            if r["result"] not in ("pass", "findings"):
                return f"{r['result']}: `{cell(r.get('error'), 90)}`"
            fs = [f"{f['invariant']} ({f['num_steps']} steps, {f.get('label')})" for f in r.get("findings", [])]
            fs += [f"assuming: {f['invariant']} ({f['num_steps']} steps)" for a in r.get("assuming", []) for f in a["findings"]]
            return "pass" if not fs else "; ".join(fs)
        for r in cmp["results"]:
            lines.append(f"| {r['repo']} | `{short(r['commit'])}` | {brief(base.get((r['repo'], r['commit'])))} | {brief(r)} |")
    lines += ["", "## Load errors and messages", ""]
    for r in recs:
        if r["result"] not in ("pass", "findings"):
            lines.append(f"- {r['repo']}@{short(r['commit'])}: `{cell(r.get('error'), 300)}`")
    lines += ["", "## Finding messages", ""]
    for r in recs:
        for f in r.get("findings", []) + r.get("robustness", []):
            lines.append(f"- {r['repo']}@{short(r['commit'])} {f['invariant']}: {cell(f['message'], 300)}")
    return "\n".join(lines) + "\n"


def load_classes() -> dict[str, Any]:
    return json.loads(CLASSES.read_text()) if CLASSES.exists() else {}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--field", type=Path, default=Path("/work/field"), help="corpus directory (with manifest.json)")
    ap.add_argument("--timeout", type=float, default=420.0, help="seconds per manager (default 420)")
    ap.add_argument("--max-examples", type=int, default=300)
    ap.add_argument("--jobs", type=int, default=1, help="managers checked at the same time (default 1)")
    ap.add_argument("--only", action="append", default=[], help="substring of repo@commit to run (repeatable)")
    ap.add_argument("--render-only", action="store_true", help="re-render reports/field.md from field.json")
    ap.add_argument("--note", action="append", default=[], help="a line for the report (how it was run, why)")
    ap.add_argument("--compare", type=Path, help="a later run's JSON (e.g. --only on a newer tree) shown beside this one")
    ap.add_argument("--json-out", type=Path, default=OUT_JSON)
    ap.add_argument("--md-out", type=Path, default=OUT_MD)
    a = ap.parse_args(argv)
    classes = load_classes()
    if a.render_only:
        doc = json.loads(a.json_out.read_text())
        doc["notes"] = doc.get("notes", []) + a.note
        if a.compare:
            doc["compare"] = json.loads(a.compare.read_text())
        mf = a.field / "manifest.json"
        if "manifest" not in doc and mf.exists():
            doc["manifest"] = [{k: e.get(k) for k in ("repo", "commit", "target", "sha1", "ast_sha1")}
                               for e in json.loads(mf.read_text())]
    else:
        manifest = json.loads((a.field / "manifest.json").read_text())
        picked = [e for e in manifest if not a.only or any(o in key_of(e) for o in a.only)]
        old = {key_of(r) + r["target"]: r for r in json.loads(a.json_out.read_text())["results"]} \
            if a.only and a.json_out.exists() else {}
        state = code_state()
        order = [key_of(e) + e["target"] for e in manifest]
        doc = {"command": "python tools/field_study.py " + " ".join(argv if argv is not None else sys.argv[1:]),
               "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
               "code_state": state, "max_examples": a.max_examples, "timeout": a.timeout,
               "manifest_size": len(manifest), "results": [], "notes": list(a.note),
               "manifest": [{k: e.get(k) for k in ("repo", "commit", "target", "sha1", "ast_sha1")} for e in manifest]}
        done = 0
        lock = threading.Lock()

        def save() -> None:
            """Written after every manager, so a run cut short still leaves its results."""
            doc["results"] = [old[k] for k in order if k in old]
            doc["finished"] = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
            write(doc, classes, a.json_out, a.md_out)

        def one(e: dict[str, Any]) -> None:
            nonlocal done
            r = run_one(e, a.field, a.timeout, a.max_examples)
            r["code_state"] = state["head"] + ("+dirty" if state["dirty"] else "")
            with lock:
                old[key_of(e) + e["target"]] = r
                done += 1
                save()
            print(f"[{done}/{len(picked)}] {key_of(e)} {r['result']} {r.get('error') or ''}"
                  f" {[f['invariant'] for f in r.get('findings', [])]} {r['seconds']}s", file=sys.stderr, flush=True)

        # Runs are independent subprocesses; --jobs > 1 only overlaps their wall time.
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, a.jobs)) as pool:
            list(pool.map(one, picked))
        save()
        print(json.dumps(doc["totals"]), file=sys.stderr)
        return 0
    write(doc, classes, a.json_out, a.md_out)
    print(json.dumps(doc["totals"]), file=sys.stderr)
    return 0


def write(doc: dict[str, Any], classes: dict[str, Any], json_out: Path, md_out: Path) -> None:
    for r in doc["results"]:
        classify(r, classes)
    doc["totals"] = totals(doc["results"])
    json_out.write_text(json.dumps(doc, indent=1) + "\n")
    md_out.write_text(render(doc))


if __name__ == "__main__":
    sys.exit(main())
