"""The ``kvspec campaign FILE.toml [--address A] [--results DIR] [--json]`` command.

Exit codes as every command: 0 when every job passed, 1 when a job found a violation
(or a ``patches`` job missed a bug), 2 on a usage error or when jobs gave no verdict
(one line on stderr; their records in the results directory say why). The verdict
is printed before the report files are written; a file that cannot be written is a
warning.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from kvspec.campaign.matrix import load_campaign
from kvspec.campaign.progress import Progress
from kvspec.campaign.store import ResultStore


def _text(s: dict, reports: list[str]) -> str:
    c = s["counts"]
    lines = [f"kvspec campaign {s['campaign']}: {s['verdict']} ({s['jobs']} jobs: {c['pass']} pass, "
             f"{c['violation']} violation, {c['fail']} fail, {c['error']} error; {s['skipped_done']} done before; "
             f"{s['seconds']} s)"]
    for f in s["findings"]:
        lines.append(f"  {f['invariant']} ({f['kind']}, seen {f['count']} time(s) in {len(f['jobs'])} job(s)): "
                     f"{f['message']}")
        if f["steps"] and f["kind"] != "killed patch":
            lines.append(f"    repro: {'; '.join(f['steps'])}")
    for r in s["results"]:
        if r["verdict"] == "error":
            lines.append(f"  error in {r.get('label') or r['id']}: {r.get('error')}")
    if reports:
        lines.append("report: " + ", ".join(reports))
    return "\n".join(lines)


def cmd_campaign(args: Any) -> int:
    from kvspec.campaign.execute import execute, require_ray
    from kvspec.campaign.report import summarize, write as write_report

    require_ray()  # one line and exit 2 without it, before the matrix is read
    camp = load_campaign(args.file)
    results_dir = args.results or camp.results
    store = ResultStore(results_dir)
    store.write_manifest({"campaign": camp.name, "file": str(camp.path), "jobs": [j.to_dict() for j in camp.jobs]})
    pending = [j for j in camp.jobs if not store.done(j.id)]
    skipped = len(camp.jobs) - len(pending)
    sys.stderr.write(f"kvspec campaign {camp.name}: {len(camp.jobs)} jobs, {skipped} done in {results_dir}, "
                     f"{len(pending)} to run on {'Ray at ' + args.address if args.address else 'a local Ray'}\n")
    sys.stderr.flush()
    progress = Progress(len(camp.jobs), skipped)
    workers = {"slots": 1}
    t0 = time.monotonic()

    def done(record: dict, running: int, slots: int) -> None:
        workers["slots"] = slots
        store.save(record)
        progress.update(running, slots, record)

    try:
        if pending:
            execute(pending, args.address, camp.job_timeout, camp.retries, done,
                    on_start=lambda running, slots: progress.update(running, slots), warm=camp.warm)
    finally:
        progress.close()
    wall = time.monotonic() - t0
    records = [r for r in (store.load(j.id) for j in camp.jobs) if r is not None]
    s = summarize(camp.name, str(args.file), records, wall, skipped, args.address)
    reports = [str(Path(results_dir) / n) for n in ("campaign.md", "campaign-report.json", "campaign.junit.xml")]
    has_patches = any(r.get("command") == "patches" for r in records)
    patches_dir = camp.patches_report or results_dir
    if has_patches:
        reports.append(str(Path(patches_dir) / "patches.md"))
    s["reports"] = reports
    if s["counts"]["error"]:
        s["error"] = f"{s['counts']['error']} job(s) gave no verdict; see {Path(results_dir) / 'campaign.md'}"
    print(json.dumps(s, default=str) if args.json else _text(s, reports))
    sys.stdout.flush()
    try:
        write_report(s, records, results_dir)
        if has_patches:
            from kvspec.campaign import patches
            patches.write(records, patches_dir, f"kvspec campaign {args.file}", workers["slots"], wall)
    except OSError as e:
        print(f"kvspec campaign: warning: report files not written: {e.strerror or e}", file=sys.stderr)
    if s["verdict"] in ("violation", "fail"):
        return 1
    if s["verdict"] == "error":
        print(f"kvspec campaign: error: {s['error']}", file=sys.stderr)
        return 2
    return 0
