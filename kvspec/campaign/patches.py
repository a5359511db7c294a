"""Merge a campaign's ``patches`` jobs into ``kvspec patches``' own report.

A corpus run through a campaign is one job per patch, or per seed range of a long
patch (``only = "each"``), so that the trials spread over the nodes; this puts them
back together per target (a patch's seeds counted over all its ranges) and
writes ``patches.json``, ``patches.md`` and ``patches_ttf.png`` with the corpus
command's own summary and renderer: the report has the same form as
``benchmarks/run_patches.sh`` gives.
"""
from __future__ import annotations

import time

from kvspec.corpus.command import _machine as machine  # the same machine line as kvspec patches writes
from kvspec.corpus.report import write_reports
from kvspec.corpus.runner import load_corpus
from kvspec.corpus.stats import DIFF_DEFERRED, summarize


def merged(records: list[dict], campaign_cmd: str, workers: int, wall: float) -> list[dict]:
    """One ``kvspec patches`` result per target (and options) of the campaign's patches jobs."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        res = r.get("result") or {}
        if r.get("command") != "patches" or r.get("verdict") not in ("pass", "fail") or not res.get("trials"):
            continue
        key = (res.get("target"), res.get("timeout"), (r.get("env") or {}).get("KVSPEC_CAMPAIGN_RELEASE"))
        groups.setdefault(key, []).append(res)
    out = []
    for (target, timeout, _), results in sorted(groups.items(), key=lambda kv: str(kv[0])):
        _, bugs = load_corpus(target)
        by_trial = {(t["id"], t["seed"]): t for res in results for t in res["trials"]}  # a trial run twice counts once
        trials = [by_trial[k] for k in sorted(by_trial)]
        ran = {t["id"] for t in trials}
        seeds = max(sum(1 for t in trials if t["id"] == i) for i in ran)
        # the range from seed 0 ran kvspec diff; the others say so and are not merged
        diffs = {p["id"]: p["diff"] for res in results for p in res.get("patches") or []
                 if p.get("diff") and p["diff"].get("verdict") != DIFF_DEFERRED}
        subset = [b for b in bugs if b["id"] in ran]
        res = summarize(target, subset, trials, diffs, {"seeds": seeds, "timeout": timeout, "jobs": workers}, wall)
        only = "" if len(subset) == len(bugs) else " --only " + ",".join(b["id"] for b in subset)
        res["command"] = f"{campaign_cmd}  (kvspec patches --target {target} --seeds {seeds} --timeout {timeout:g}" \
                         f"{only}, one Ray task per patch or seed range)"
        res["section"] = target + only
        res["machine"] = {**machine(target), "ray_cpus": workers}
        res["date"] = time.strftime("%Y-%m-%d")
        out.append(res)
    return out


def write(records: list[dict], directory: str, campaign_cmd: str, workers: int, wall: float) -> list[str]:
    paths: list[str] = []
    for res in merged(records, campaign_cmd, workers, wall):
        paths = write_reports(res, directory)
    return paths

