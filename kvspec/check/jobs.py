"""``kvspec check --jobs N``: N worker processes search with different seeds (``seed``,
``seed + 1``, ...), each for every distinct finding (``--max-findings``) as one run does.

Workers are forked, so the target (already loaded and patched) needs no pickling; each
runs ``run_check`` with a ``stop`` callback reading one shared event, which a worker
sets once it holds ``max_findings`` findings (with the default of one finding that is
its first: all stop at the first violation any of them finds). The parent sums the
examples and steps and merges the findings in worker order, one per signature
(``kvspec.spec.violation.signature``), up to ``max_findings``: two workers that found
the same bug report it once, with the first worker's repro. With ``--db DIR`` the workers share
Hypothesis's ``DirectoryBasedExampleDatabase`` (safe between processes): a failure
found by one is replayed first by every later run pointed at the same directory.
"""
from __future__ import annotations

import multiprocessing as mp
import queue
import signal
import os
import time
from typing import Any

from kvspec.check.search import CheckReport, run_check
from kvspec.errors import Interrupted, TargetError, UsageError, raise_interrupted

STOP_GRACE_S = 10.0  # after Ctrl-C: how long the workers get to finish their batch and report
from kvspec.targets.base import Target


def _worker(i: int, target: Target, spec: str, kw: dict, found: Any, out: Any) -> None:
    def stop() -> bool:
        return found.is_set()

    # SIGTERM (the parent's terminate) ends a worker; SIGINT (a Ctrl-C, or the parent passing
    # one on) stops its search at once and it reports what it reached, like a single run
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, raise_interrupted)
    try:
        report = run_check(target, spec, seed=kw["seed"] + i, stop=stop, **{k: v for k, v in kw.items() if k != "seed"})
        if len(report.violations) >= kw.get("max_findings", 1):
            found.set()
        out.put((i, report, None))
    except BaseException as e:  # reported by the parent, in one line
        found.set()
        out.put((i, None, f"{type(e).__name__}: {e}"))


def distinct_findings(reports: list[CheckReport], limit: int) -> list:
    """The workers' findings in worker order, one per signature, at most ``limit``."""
    out, seen = [], set()
    for r in reports:
        for f in r.violations:
            if f.signature not in seen and len(out) < limit:
                seen.add(f.signature)
                out.append(f)
    return out


def run_jobs(target: Target, spec: str, jobs: int, **kw: Any) -> CheckReport:
    """``run_check`` over ``jobs`` forked workers; the keyword arguments are run_check's."""
    if "fork" not in mp.get_all_start_methods():
        raise UsageError("kvspec check: --jobs needs the fork start method (Linux, macOS)")
    ctx = mp.get_context("fork")
    found, out = ctx.Event(), ctx.Queue()
    start = time.monotonic()
    procs = [ctx.Process(target=_worker, args=(i, target, spec, kw, found, out), daemon=True) for i in range(jobs)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    interrupted = None
    while len(results) + len(errors) < jobs:
        try:
            i, report, err = out.get() if interrupted is None else out.get(timeout=STOP_GRACE_S)
        except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM: stop the workers, keep what they reached
            from kvspec.check.search import _signal_name
            interrupted = _signal_name(e)
            found.set()
            for p in procs:
                if p.is_alive() and p.pid:
                    os.kill(p.pid, signal.SIGINT)
            continue
        except queue.Empty:  # a worker that did not stop in time: its counts are lost, the others' kept
            break
        if err:
            errors.append(f"worker {i}: {err}")
        else:
            results[i] = report
    for p in procs:
        p.join(timeout=STOP_GRACE_S if interrupted else None)
        if p.is_alive():
            p.terminate()
    if not results:
        if interrupted:
            raise Interrupted(getattr(signal, interrupted))
        raise TargetError("kvspec check --jobs: every worker failed: " + "; ".join(errors))
    first = next((results[i] for i in sorted(results) if results[i].violations), results[min(results)])
    merged = CheckReport(spec, first.patch, first.levels, first.misuse, kw.get("seed", 0), first.budget,
                         violations=distinct_findings([results[i] for i in sorted(results)], kw.get("max_findings", 1)),
                         robustness=[f for i in sorted(results) for f in results[i].robustness],
                         max_examples=first.max_examples, max_findings=kw.get("max_findings", 1))
    merged.examples = sum(r.examples for r in results.values())
    merged.steps = sum(r.steps for r in results.values())
    merged.seconds = time.monotonic() - start
    merged.error = "; ".join(errors) or None
    merged.jobs = jobs  # type: ignore[attr-defined]
    merged.interrupted = interrupted or next((r.interrupted for r in results.values() if r.interrupted), None)
    merged.not_exercised = first.not_exercised
    merged.warnings = [w for i in sorted(results) for w in results[i].warnings]
    return merged
