"""The ``kvspec patches`` command: progress, the run over a target's corpus, and
``python -m kvspec.corpus.command --render [DIR]`` to re-render the reports.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any, Optional
from kvspec.corpus.report import REPORT_JSON, REPORT_MD, load_report, render_reports, text_summary, write_reports
from kvspec.corpus.runner import DIFF_TIMEOUT_S, HARD_MARGIN_S, load_corpus, run_pool
from kvspec.corpus.stats import DIFF_DEFERRED, _median, resummarize, summarize


# -- the command --------------------------------------------------------------------------
class _Progress:
    """Progress on stderr: a live line on a terminal; otherwise (CI logs, a redirected
    run) one line per patch as its last trial finishes, and a heartbeat every 30 s."""

    def __init__(self, total: int, per_id: dict[str, int], seeds: int) -> None:
        self.tty = sys.stderr.isatty()
        self.seeds = seeds
        self.total, self.start, self.killed = total, time.monotonic(), 0
        self.left = dict(per_id)
        self.kills: dict[str, list[float]] = {}
        self.done_ids = 0
        self.last = time.monotonic()

    def _line(self, text: str) -> None:
        sys.stderr.write(("\r\033[K" if self.tty else "") + text + ("" if self.tty else "\n"))
        sys.stderr.flush()

    def __call__(self, res: dict, done: int, total: int) -> None:
        el = time.monotonic() - self.start
        rid = res.get("id")
        if res.get("killed"):
            self.killed += 1
            self.kills.setdefault(rid, []).append(res.get("seconds_to_failure") or 0.0)
        if rid in self.left:
            self.left[rid] -= 1
            if self.left[rid] == 0 and not self.tty:
                self.done_ids += 1
                ks = self.kills.get(rid, [])
                self._line(f"[patches {self.done_ids}/{len(self.left)}] {rid}: killed {len(ks)}/{self.seeds}"
                           + (f", ttf median {_median(ks):.3f} s" if ks else "") + f"  ({el:.0f} s)")
                self.last = time.monotonic()
        if self.tty:
            what = f" seed {res['seed']}" if res.get("_fn") == "run_trial" else " (kvspec diff)"
            self._line(f"[{done}/{total}] {rid}{what}  killed so far {self.killed}  {el:.0f}s")
        elif time.monotonic() - self.last > 30:
            self._line(f"[{done}/{total} jobs done, {el:.0f} s]")
            self.last = time.monotonic()

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()


def cmd_patches(args) -> int:
    from kvspec.errors import UsageError
    from kvspec.targets.registry import load_target

    if args.seeds < 1:
        raise UsageError("kvspec patches: --seeds must be at least 1")
    if not (args.timeout > 0 and math.isfinite(args.timeout)):  # NaN fails the first test
        raise UsageError("kvspec patches: --timeout must be a finite number, positive")
    from kvspec.check.command import available_cores, cap_jobs, ensure_report_dir
    jobs = args.jobs or available_cores()
    if jobs < 1:
        raise UsageError("kvspec patches: --jobs must be at least 1")
    jobs = cap_jobs(jobs, "kvspec patches")
    if args.report_dir:  # before hours of trials: the results must have somewhere to go
        ensure_report_dir(args.report_dir, "kvspec patches")
    corpus_dir, bugs = load_corpus(args.target)
    if args.only:
        want = [x.strip() for x in args.only.split(",") if x.strip()]
        unknown = sorted(set(want) - {b["id"] for b in bugs})
        if unknown:
            raise UsageError(f"kvspec patches: unknown patch id(s) for {args.target}: {', '.join(unknown)}")
        bugs = [b for b in bugs if b["id"] in want]
    load_target(args.target)  # a missing target is one line and exit 2, before any worker starts
    # Import what the workers need before forking, so each starts warm.
    from kvspec.check import minimize, search  # noqa: F401
    from kvspec.mc import search as mc_search  # noqa: F401
    if getattr(args, "level", "all") != "engine":
        from kvspec.corpus.runner import warm_up
        warm_up(args.target, getattr(args, "kv_groups", None))

    hard = args.timeout + HARD_MARGIN_S
    first = getattr(args, "first_seed", 0) or 0
    work: list[tuple[str, dict, float]] = []
    for b in bugs:
        for seed in range(first, first + args.seeds):
            work.append(("run_trial", {"id": b["id"], "seed": seed, "target": args.target,
                                       "patch": str(corpus_dir / b["file"]), "timeout": args.timeout,
                                       "kv_groups": getattr(args, "kv_groups", None) or b.get("kv_groups"),
                                       "level": getattr(args, "level", "all")}, hard))
    diff_here = args.target == "impl" and first == 0  # on impl, once per patch: in the range from seed 0
    if diff_here:
        # kvspec diff on every patch (it compares only the helpers a patch changes; most
        # patches change none and cost nothing), so the report says which engine caught what;
        # once per patch: a run split by seed ranges carries it in the range from seed 0
        for b in bugs:
            work.append(("run_diff_task", {"id": b["id"], "patch": str(corpus_dir / b["file"]),
                                           "per_condition_timeout": min(DIFF_TIMEOUT_S, args.timeout)},
                         min(DIFF_TIMEOUT_S, args.timeout) * 8 + 120))
    # Longest first (equivalent mutants and rare-input bugs run to the timeout), so the
    # pool does not end on one long straggler.
    slow = {b["id"] for b in bugs if b["kind"] == "equivalent" or b.get("engine") == "diff"}
    # kvspec diff next (CrossHair runs up to a few per-condition timeouts), the quick trials last.
    work.sort(key=lambda w: (w[0] != "run_trial" or w[1]["id"] not in slow, w[0] != "run_diff_task"))

    per_id: dict[str, int] = {}
    for _, task, _ in work:
        per_id[task["id"]] = per_id.get(task["id"], 0) + 1
    sys.stderr.write(f"kvspec patches --target {args.target}: {len(bugs)} patches x {args.seeds} seeds "
                     f"({len(work)} jobs) on {jobs} worker processes, timeout {args.timeout:g} s per trial\n")
    sys.stderr.flush()
    prog = _Progress(len(work), per_id, args.seeds)
    t0 = time.monotonic()
    try:
        results = run_pool(work, jobs, prog)
    finally:
        prog.close()
    wall = time.monotonic() - t0
    trials = sorted((r for r in results if r.get("_fn") == "run_trial"), key=lambda r: (r["id"], r["seed"]))
    for t in trials:
        t.pop("_fn", None)
        if t.get("seconds_to_failure") is not None:
            t["seconds_to_failure"] = round(t["seconds_to_failure"], 4)
    diffs = {r["id"]: r["diff"] for r in results if r.get("_fn") == "run_diff_task"}
    if args.target == "impl" and not diff_here:  # the range from seed 0 judges what only kvspec diff finds
        diffs = {b["id"]: {"verdict": DIFF_DEFERRED} for b in bugs if b.get("engine") == "diff"}
    res = summarize(args.target, bugs, trials, diffs, {"seeds": args.seeds, "timeout": args.timeout, "jobs": jobs}, wall)
    command = "kvspec patches --target {} --seeds {}{} --timeout {:g}{}".format(
        args.target, args.seeds, f" --first-seed {first}" if first else "", args.timeout,
        f" --only {args.only}" if args.only else "")
    res["command"] = command
    res["section"] = f"{args.target} --only {args.only}" if args.only else args.target
    res["machine"] = _machine(args.target)
    res["date"] = time.strftime("%Y-%m-%d")
    # where the report files will go, printed before they are written (a write that
    # fails is a warning: the results on stdout are kept, the exit code is the verdict's)
    res["reports"] = [str(os.path.join(args.report_dir, n)) for n in (REPORT_JSON, REPORT_MD)] if args.report_dir else []
    if args.json:
        print(json.dumps(res, default=str))
    else:
        print(text_summary(res))
    sys.stdout.flush()
    if args.report_dir:
        try:
            write_reports(res, args.report_dir)
        except OSError as e:
            print(f"kvspec patches: warning: report files not written to {args.report_dir}: {e.strerror or e}",
                  file=sys.stderr)
    return 0 if res["verdict"] == "pass" else 1


def _machine(target: str) -> dict:
    import platform

    out: dict[str, Any] = {"cpus": os.cpu_count(), "python": platform.python_version()}
    try:  # the machine may be shared: the 1/5/15-minute load averages at the end of the run
        out["load_average"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    pkg = {"vllm": "vllm", "nanovllm": "nano-vllm-fork"}.get(target)
    if pkg:
        try:
            from importlib.metadata import version
            out["target_version"] = version(pkg)
        except Exception:
            pass
    return out


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m kvspec.corpus.command --render [DIR]``: re-render patches.md and
    patches_ttf.png from DIR/patches.json (default reports/) without running anything,
    summarizing each target's trials again with the corpus metadata as it is now."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m kvspec.corpus.command", description=main.__doc__)
    ap.add_argument("--render", metavar="DIR", nargs="?", const="reports", required=True)
    a = ap.parse_args(argv)
    doc = load_report(a.render)
    if not doc["targets"]:
        print(f"no {REPORT_JSON} with results in {a.render}", file=sys.stderr)
        return 2
    for t, res in list(doc["targets"].items()):
        doc["targets"][t] = resummarize(res)
    for p in render_reports(doc, a.render):
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
