"""The results directory: one JSON per finished job, so a rerun skips what is done.

    DIR/campaign.json        the expanded matrix (jobs and their ids), rewritten each run
    DIR/jobs/ID.json         one finished job's record (written whole, then renamed in)
    DIR/finished.log         one line per job record written (a job finished twice shows twice)
    DIR/repros/ID/test_*.py  the repro files a job wrote, whichever node ran it

A job whose process failed to give a verdict (``error``) is kept too, so the report
shows it, but a rerun runs it again: an error is not an answer.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Optional

from kvspec.atomic_write import write_atomic
from kvspec.errors import UsageError

ANSWERS = ("pass", "violation", "fail")  # a job that gave one of these is done


def _repoint(result, kept: dict[str, str]) -> None:
    """A finding's ``repro`` named the job's scratch directory: name the kept copy."""
    if not isinstance(result, dict):
        return
    findings = [result] + [f for k in ("violations", "robustness") for f in result.get(k) or [] if isinstance(f, dict)]
    for f in findings:
        if isinstance(f.get("repro"), str) and Path(f["repro"]).name in kept:
            f["repro"] = kept[Path(f["repro"]).name]


class ResultStore:
    def __init__(self, directory: str | os.PathLike) -> None:
        self.dir = Path(directory)
        self.jobs_dir = self.dir / "jobs"
        try:
            self.jobs_dir.mkdir(parents=True, exist_ok=True)
            probe = self.dir / ".write-test"
            probe.write_text("")
            probe.unlink()
        except OSError as e:
            raise UsageError(f"kvspec campaign: results directory {self.dir} is not writable: "
                             f"{e.strerror or e}") from None

    def path(self, job_id: str) -> Path:
        return self.jobs_dir / f"{job_id}.json"

    def load(self, job_id: str) -> Optional[dict]:
        try:
            got = json.loads(self.path(job_id).read_text())
        except (OSError, ValueError):
            return None  # missing, or cut short by a crash: not done
        return got if isinstance(got, dict) and got.get("id") == job_id else None

    def done(self, job_id: str) -> bool:
        rec = self.load(job_id)
        return rec is not None and rec.get("verdict") in ANSWERS

    def save(self, record: dict) -> None:
        repros = record.pop("repros", None) or {}
        if repros:
            d = self.dir / "repros" / record["id"]
            d.mkdir(parents=True, exist_ok=True)
            for name, text in repros.items():
                write_atomic(d / Path(name).name, text)
            record["repro_files"] = [str(d / Path(n).name) for n in sorted(repros)]
            _repoint(record.get("result"), {Path(n).name: str(d / Path(n).name) for n in repros})
        record["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        write_atomic(self.path(record["id"]), json.dumps(record, indent=1, default=str) + "\n")
        with open(self.dir / "finished.log", "a") as f:
            f.write(f"{record['id']} {record['verdict']}\n")

    def write_manifest(self, manifest: dict) -> None:
        write_atomic(self.dir / "campaign.json", json.dumps(manifest, indent=1, default=str) + "\n")

    def finished_counts(self) -> dict[str, int]:
        """job id -> how many times a record of it was written (the cluster test reads it)."""
        counts: dict[str, int] = {}
        try:
            for line in (self.dir / "finished.log").read_text().splitlines():
                if line.strip():
                    jid = line.split()[0]
                    counts[jid] = counts.get(jid, 0) + 1
        except OSError:
            pass
        return counts
