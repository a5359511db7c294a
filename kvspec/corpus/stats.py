"""Statistics of a ``kvspec patches`` run: per-patch rows, per-class summaries (solve rate,
time to failure, repro length against the proven minimum).
"""
from __future__ import annotations

import math
import statistics
from typing import Optional
from kvspec.corpus.runner import THRESHOLDS, load_corpus


# -- aggregation ---------------------------------------------------------------------------
def _median(xs: list[float]) -> Optional[float]:
    return statistics.median(xs) if xs else None


def _quantile(xs: list[float], q: float) -> Optional[float]:
    if not xs:
        return None
    s = sorted(xs)
    k = max(0, math.ceil(q * len(s)) - 1)  # nearest rank
    return s[k]


def _r(x: Optional[float], nd: int = 3) -> Optional[float]:
    return None if x is None else round(x, nd)


# The diff verdict of a seed range that does not run kvspec diff (``kvspec patches
# --first-seed K``, K > 0, on impl): the range from seed 0 runs it, once per patch.
DIFF_DEFERRED = "in the range from seed 0"


def patch_row(bug: dict, trials: list[dict], diff: Optional[dict]) -> dict:
    killed = [t for t in trials if t["killed"]]
    ttf = [t["seconds_to_failure"] for t in killed if t["seconds_to_failure"] is not None]
    found: dict[str, int] = {}
    for t in killed:
        found[t["invariant"]] = found.get(t["invariant"], 0) + 1
    ratios = [t["repro_steps"] / t["minimal_steps"] for t in killed
              if t["minimal_proven"] and t["minimal_steps"]]
    expected = bug["invariants"]
    caught_by = []
    if killed:
        caught_by.append("check")
    if diff and diff.get("verdict") == "different":
        caught_by.append("diff")
    return {
        "id": bug["id"], "title": bug.get("title", ""), "kind": bug["kind"], "level": bug.get("level"),
        "engine": bug.get("engine", "check"), "upstream": bug.get("upstream"), "expected": expected,
        "applied": all(t["applied"] for t in trials) if trials else None,
        "seeds": len(trials), "killed": round(len(killed) / len(trials), 3) if trials else 0.0,
        "kills": len(killed),
        "seconds_to_failure": _r(_median(ttf)), "seconds_to_failure_p90": _r(_quantile(ttf, 0.9)),
        "repro_steps": _median([t["repro_steps"] for t in killed]),
        "minimal_steps": _median([t["minimal_steps"] for t in killed if t["minimal_steps"] is not None]),
        "minimal_proven": sum(1 for t in killed if t["minimal_proven"]),
        "repro_over_minimal": _r(_median(ratios), 2),
        "found": found,
        "expected_found": (sum(n for inv, n in found.items() if inv in expected) / len(killed)) if killed and expected else None,
        "primary_found": (found.get(expected[0], 0) / len(killed)) if killed and expected else None,
        "errors": sorted({t["error"] for t in trials if t.get("error")}),
        "diff": diff, "caught_by": caught_by,
    }


def _class_summary(rows: list[dict], trials: list[dict], timeout: float) -> dict:
    ids = {r["id"] for r in rows}
    ts = [t for t in trials if t["id"] in ids]
    killed = [t for t in ts if t["killed"]]
    ttf = [t["seconds_to_failure"] for t in killed if t["seconds_to_failure"] is not None]
    ratios = [t["repro_steps"] / t["minimal_steps"] for t in killed if t["minimal_proven"] and t["minimal_steps"]]
    return {
        "bugs": len(rows), "trials": len(ts), "solved": len(killed),
        "solve_rate": round(len(killed) / len(ts), 4) if ts else None,
        "bugs_killed_every_seed": sum(1 for r in rows if r["seeds"] and r["kills"] == r["seeds"]),
        "bugs_killed_any_seed": sum(1 for r in rows if r["kills"]),
        "solved_within": {f"{t:g}": sum(1 for x in ttf if x <= t) for t in THRESHOLDS if t <= max(timeout, THRESHOLDS[0])},
        "median_seconds_to_failure": _r(_median(ttf)), "p90_seconds_to_failure": _r(_quantile(ttf, 0.9)),
        "max_seconds_to_failure": _r(max(ttf) if ttf else None),
        "median_repro_steps": _median([t["repro_steps"] for t in killed]),
        "median_minimal_steps": _median([t["minimal_steps"] for t in killed if t["minimal_steps"] is not None]),
        "median_repro_over_minimal": _r(_median(ratios), 2),
        "mean_repro_over_minimal": _r(statistics.fmean(ratios) if ratios else None, 2),
        "minimal_proven": f"{len(ratios)}/{len(killed)}",
    }


def summarize(target: str, bugs: list[dict], trials: list[dict], diffs: dict[str, dict], args_d: dict,
              wall: float) -> dict:
    by_id: dict[str, list[dict]] = {}
    for t in trials:
        by_id.setdefault(t["id"], []).append(t)
    rows = [patch_row(b, sorted(by_id.get(b["id"], []), key=lambda t: t["seed"]), diffs.get(b["id"])) for b in bugs]
    safety = [r for r in rows if r["kind"] == "safety" and r["engine"] != "diff"]
    rare = [r for r in rows if r["kind"] == "safety" and r["engine"] == "diff"]
    policy = [r for r in rows if r["kind"] == "policy"]
    equiv = [r for r in rows if r["kind"] == "equivalent"]
    timeout = args_d["timeout"]
    fp = [r for r in equiv if r["kills"]]
    safety_ok = all(r["kills"] == r["seeds"] and r["seeds"] for r in safety)
    # a rare-input bug fails the run unless check or diff caught it; where this run is a
    # seed range whose diff runs in the range from seed 0, the other range judges it
    rare_ok = all(r["caught_by"] or (r["diff"] or {}).get("verdict") == DIFF_DEFERRED for r in rare)
    summary = {
        "safety": _class_summary(safety, trials, timeout),
        "policy": _class_summary(policy, trials, timeout),
        "rare_input": {"bugs": len(rare), "caught_by_check": sum(1 for r in rare if "check" in r["caught_by"]),
                       "caught_by_diff": sum(1 for r in rare if "diff" in r["caught_by"]),
                       "ids": [r["id"] for r in rare]},
        "equivalent": {"mutants": len(equiv), "killed": len(fp),
                       "false_positives": f"{len(fp)}/{len(equiv)}", "killed_ids": [r["id"] for r in fp]},
        "expected_invariant_rate": _r(_ratio(sum(r["kills"] * (r["expected_found"] or 0) for r in safety + policy),
                                             sum(r["kills"] for r in safety + policy)), 4),
        "patches_not_applied": [r["id"] for r in rows if r["applied"] is False],
        "all_safety_killed": safety_ok and rare_ok,
        "wall_seconds": round(wall, 1),
    }
    return {"command": "patches", "target": target, "seeds": args_d["seeds"], "timeout": timeout,
            "jobs": args_d["jobs"], "patches": rows, "summary": summary, "trials": trials,
            "verdict": "pass" if (safety_ok and rare_ok and not fp) else "fail"}


def _ratio(a: float, b: float) -> Optional[float]:
    return a / b if b else None


def resummarize(res: dict) -> dict:
    """``res`` summarized again from its trials with the corpus metadata as it is now
    (after a fix of a patch's expected invariants, say); the trials themselves do not
    depend on the metadata. Unchanged when the corpus no longer has the same patches."""
    try:
        _, bugs = load_corpus(res["target"])
    except Exception:
        return res
    ids = [r["id"] for r in res["patches"]]
    by = {b["id"]: b for b in bugs}
    if set(ids) - set(by):
        return res
    diffs = {r["id"]: r["diff"] for r in res["patches"] if r.get("diff")}
    new = summarize(res["target"], [by[i] for i in ids], res["trials"], diffs,
                    {"seeds": res["seeds"], "timeout": res["timeout"], "jobs": res["jobs"]},
                    res["summary"]["wall_seconds"])
    for k in ("command", "machine", "date"):
        if k in res:
            new[k] = res[k]
    return new
