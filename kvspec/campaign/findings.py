"""Findings of every job, deduplicated by invariant and minimal repro.

Ten seeds that shrink to the same 4-step repro of I4 are one finding seen ten times,
not ten findings. The key is the invariant and the repro's steps as text (a check
violation's minimized ``steps_text``, a model-checking counterexample); a ``patches``
job's trials carry no steps, so its key is the invariant and the patch.
"""
from __future__ import annotations

from typing import Any, Iterable


def _check_findings(rec: dict) -> Iterable[dict]:
    res = rec.get("result") or {}
    for kind in ("violations", "robustness"):
        for v in res.get(kind) or []:
            yield {"invariant": v.get("invariant"), "kind": "violation" if kind == "violations" else "robustness",
                   "message": v.get("message"), "steps": list(v.get("steps_text") or []),
                   "minimal": bool(v.get("minimal")), "level": v.get("level"), "repro": v.get("repro"),
                   "seconds_to_failure": v.get("seconds_to_failure")}


def _mc_findings(rec: dict) -> Iterable[dict]:
    res = rec.get("result") or {}
    if res.get("verdict") == "violation":
        yield {"invariant": res.get("invariant"), "kind": "violation", "message": res.get("message"),
               "steps": list(res.get("counterexample_text") or []), "minimal": True, "level": res.get("level"),
               "repro": res.get("repro"), "seconds_to_failure": res.get("seconds")}


def _patches_findings(rec: dict) -> Iterable[dict]:
    res = rec.get("result") or {}
    for t in res.get("trials") or []:
        if t.get("killed"):
            yield {"invariant": t.get("invariant"), "kind": "killed patch", "message": f"patch {t.get('id')} killed",
                   "steps": [f"patch {t.get('id')}"], "minimal": bool(t.get("minimal_proven")), "level": None,
                   "repro": None, "seconds_to_failure": t.get("seconds_to_failure")}


EXTRACT = {"check": _check_findings, "mc": _mc_findings, "patches": _patches_findings}


def findings_of(rec: dict) -> list[dict]:
    return list(EXTRACT.get(rec.get("command"), lambda r: [])(rec))


def dedup(records: Iterable[dict]) -> list[dict[str, Any]]:
    """One entry per (invariant, steps): the first job that found it, every job that did."""
    seen: dict[tuple, dict] = {}
    for rec in records:
        for f in findings_of(rec):
            key = (f["invariant"], tuple(f["steps"]))
            entry = seen.get(key)
            if entry is None:
                entry = seen[key] = {**f, "jobs": [], "labels": [], "count": 0}
                if rec.get("repro_files"):
                    entry["repro_files"] = rec["repro_files"]
            entry["count"] += 1
            if rec["id"] not in entry["jobs"]:
                entry["jobs"].append(rec["id"])
                entry["labels"].append(rec.get("label") or rec["id"])
    return sorted(seen.values(), key=lambda e: (str(e["invariant"]), len(e["steps"]), e["steps"]))
