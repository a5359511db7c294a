"""The ``kvspec check`` command: load the target, run the machines, write repros and
report files, print the result (text or one JSON object)."""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import time

from kvspec.errors import UsageError, interrupt_handlers


def _emit(obj: dict, as_json: bool, text: str) -> None:
    if as_json:
        print(json.dumps(obj, default=str))
    else:
        print(text)


def check_kv_groups(spec, target, family_ok: bool = True) -> "str | None":
    """``--kv-groups`` checked once, up front: a malformed spec is a usage error, and a
    target that drives no groups is a target error (both one line, exit 2). A family of
    layouts (``with:KIND``) is for a search that draws per example (``family_ok``)."""
    if spec is None:
        return None
    from kvspec.errors import TargetError
    from kvspec.spec.model.groups import canonical_groups
    from kvspec.stateful.cache import family_layouts, layout_family, missing_kinds
    kind = layout_family(spec)
    if kind is not None and not family_ok:
        raise UsageError(f"--kv-groups {spec}: a family of layouts is drawn per example by kvspec check; "
                         "this command explores one layout (e.g. --kv-groups full,swa:4)")
    if kind is not None:   # with:KIND, the layouts that have a KIND group, drawn per example
        if not getattr(target.traits, "cache_features", False):
            raise TargetError(f"target {target.name} does not support KV-cache groups (--kv-groups {spec})")
        if not family_layouts(kind, missing_kinds(target.traits)):
            raise TargetError(f"target {target.name}: no layout it builds has a {kind!r} group (--kv-groups {spec})")
        return spec
    try:
        canonical = canonical_groups(spec)
    except ValueError as e:
        raise UsageError(f"--kv-groups: {e}") from None
    if canonical != "full" and not getattr(target.traits, "cache_features", False):
        raise TargetError(f"target {target.name} does not support KV-cache groups (--kv-groups {spec})")
    lacks = sorted({g.partition(":")[0] for g in canonical.split(",")} & missing_kinds(target.traits)
                   - {"full", "swa", "chunked"})
    if lacks:
        raise TargetError(f"target {target.name} does not build KV-cache group kind {lacks[0]!r} (--kv-groups {spec})")
    return canonical


def available_cores() -> int:
    """The CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def cap_jobs(jobs: int, command: str) -> int:
    """``--jobs`` beyond the cores available is capped, with a one-line note on stderr:
    more processes than cores only share them, and each pays its start-up."""
    cores = available_cores()
    if jobs > cores:
        print(f"{command}: note: --jobs {jobs} capped to {cores} (the CPU cores available)", file=sys.stderr)
        return cores
    return jobs


def _finite(name: str, x: "float | None", zero_ok: bool = False) -> None:
    if x is not None and (math.isnan(x) or math.isinf(x) or x < 0 or (x == 0 and not zero_ok)):
        raise UsageError(f"kvspec check: {name} must be a finite number, "
                         f"{'0 or more' if zero_ok else 'positive'} (got {x})")


def writable_dir(path: str) -> "str | None":
    """Why ``path`` cannot take kvspec's files (None when it can). Nothing is created:
    the nearest existing directory at or above it must be writable."""
    p = os.path.abspath(path)
    while not os.path.exists(p):
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    if not os.path.isdir(p):
        return f"{p} is not a directory"
    if not os.access(p, os.W_OK | os.X_OK):
        return f"{p} is not writable"
    return None


def ensure_report_dir(path: str, command: str) -> None:
    """Create ``path`` and write (and remove) a file in it, before any search: a
    directory that cannot take the reports is one line and exit 2 up front."""
    import tempfile

    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise UsageError(f"{command}: --report-dir {path}: cannot be written: {e.strerror or e}") from None


def cmd_check(a: argparse.Namespace) -> int:
    """Exit code 0 when nothing was found, 1 on a violation, 2 on an error; on Ctrl-C or
    SIGTERM what was reached is printed, marked incomplete (130 or 143, 1 with a finding)."""
    from kvspec.targets import watchdog
    from kvspec.check.search import DETERMINISTIC_EXAMPLES

    max_examples = getattr(a, "max_examples", None)
    deterministic = max_examples is not None or getattr(a, "derandomize", False)
    if deterministic and a.budget is not None:
        raise UsageError("kvspec check: --budget cannot be combined with --max-examples/--derandomize "
                         "(a deterministic run never stops on time)")
    if max_examples is not None and max_examples <= 0:
        raise UsageError("kvspec check: --max-examples must be positive")
    if deterministic and max_examples is None:
        max_examples = DETERMINISTIC_EXAMPLES
    jobs, db = getattr(a, "jobs", 1), getattr(a, "db", None)
    jobs = 1 if jobs is None else jobs
    if jobs < 1:
        raise UsageError("kvspec check: --jobs must be at least 1")
    if deterministic and (jobs > 1 or db):
        raise UsageError("kvspec check: --jobs and --db are for budget runs: workers that stop each other, and "
                         "a database's replays, depend on timing and history, not only on the seed")
    a.jobs = cap_jobs(jobs, "kvspec check")
    if a.budget is None:
        a.budget = 30.0
    _finite("--budget", a.budget)
    op_timeout = getattr(a, "op_timeout", watchdog.DEFAULT_OP_TIMEOUT)
    _finite("--op-timeout", op_timeout, zero_ok=True)
    if a.report_dir:  # before the search: a finding must never be lost to an unwritable directory
        ensure_report_dir(a.report_dir, "kvspec check")
    saved_timeout = watchdog.default()
    watchdog.set_default(op_timeout)
    try:
        with interrupt_handlers():
            start = time.monotonic()
            try:
                return _check(a, max_examples, deterministic)
            except KeyboardInterrupt as e:  # before the search started (loading the target): nothing reached
                name = interrupted_name(e)
                _emit({"target": a.target, "patch": a.patch, "verdict": "incomplete", "complete": False,
                       "interrupted": name, "examples": 0, "steps": 0,
                       "seconds": round(time.monotonic() - start, 3), "violations": [], "robustness": []},
                      a.json, f"kvspec check: interrupted ({name}) before the search started; nothing checked\n"
                              "verdict: incomplete")
                import signal
                return 128 + int(getattr(signal, name, signal.SIGINT))
    finally:
        watchdog.set_default(saved_timeout)  # in-process callers (tests) get the default back


def load_checked_target(spec: str, patch: "str | None", api: "str | None"):
    """``load_target``, with anything a user's module or class does wrong while it is
    loaded (a malformed declaration, an exception at import) as one-line TargetError."""
    from kvspec.errors import KvspecError, TargetError
    from kvspec.targets.registry import load_target

    try:
        return load_target(spec, patch=patch, api=api)
    except (KvspecError, KeyboardInterrupt):
        raise
    except Exception as e:
        if os.environ.get("KVSPEC_DEBUG"):
            raise
        raise TargetError(f"target {spec}: cannot be loaded: {type(e).__name__}: {e}") from None


def _check(a: argparse.Namespace, max_examples, deterministic: bool) -> int:
    from kvspec.check.search import run_check
    from kvspec.report.text import check_text
    from kvspec.targets.patched import read_patch

    target = load_checked_target(a.target, a.patch, a.api)
    patch_text = read_patch(a.patch) if a.patch else None
    report_dir = a.report_dir or os.path.join("reports", "repros")
    if not a.report_dir and writable_dir(report_dir):
        print(f"kvspec check: warning: {writable_dir(report_dir)}: repro files will not be written "
              "(--report-dir DIR puts them elsewhere)", file=sys.stderr)
    command = "kvspec " + " ".join(shlex.quote(x) for x in sys.argv[1:]) if sys.argv[1:2] == ["check"] else ""
    kw = dict(patch=a.patch, patch_text=patch_text, level=a.level, misuse=a.misuse, seed=a.seed, budget=a.budget,
              report_dir=report_dir, kv_groups=check_kv_groups(a.kv_groups, target), command=command,
              max_examples=max_examples if deterministic else None, database=getattr(a, "db", None),
              max_findings=max_findings_of(a), whole_budget=bool(getattr(a, "whole_budget", False)),
              prove_minimal=getattr(a, "minimize", "full") != "ddmin")
    from kvspec.check import coverage, coverage_notes
    coverage.reset()
    if (getattr(a, "jobs", None) or 1) > 1:  # the workers count in their own processes: no coverage
        from kvspec.check.jobs import run_jobs
        report = run_jobs(target, a.target, a.jobs, **kw)
    else:
        report = run_check(target, a.target, progress=sys.stderr.isatty() and not a.json, **kw)
        report.coverage = coverage_notes.for_report(report, target, patch_text)  # what the verdict covered
    from kvspec.check.hints import continue_search
    from kvspec.targets.policies import declaration_of
    report.declaration, report.hintable = declaration_of(target), target.traits.hintable
    if not report.interrupted:
        try:
            continue_search(target, a.target, report, kw)  # policy hints; the search goes on under a hint's assumption
        except KeyboardInterrupt as e:
            report.interrupted = interrupted_name(e)
        caller_bugs_stay_bugs(report)
    # The verdict and the findings first, then the files: a file that cannot be written
    # is a warning and never costs the finding or changes the exit code.
    out = report.to_dict()
    if getattr(report, "coverage", None):
        out["coverage"] = report.coverage
    _emit(out, a.json, check_text(report))
    sys.stdout.flush()
    if a.report_dir:
        from kvspec.report.files import write_check_reports
        try:
            write_check_reports(report, a.report_dir, target)
        except OSError as e:
            print(f"kvspec check: warning: report files not written to {a.report_dir}: {e.strerror or e}",
                  file=sys.stderr)
        except Exception as e:  # the verdict is out already: a report that fails to render must not change it
            if os.environ.get("KVSPEC_DEBUG"):
                raise
            print(f"kvspec check: warning: report files not written to {a.report_dir}: {type(e).__name__}: {e}",
                  file=sys.stderr)
    return check_exit_code(report)


def max_findings_of(a: argparse.Namespace) -> int:
    """``--max-findings`` (an in-process caller's Namespace without it: the default)."""
    from kvspec.check.search import MAX_FINDINGS
    n = getattr(a, "max_findings", None)
    return MAX_FINDINGS if n is None else n


def caller_bugs_stay_bugs(report) -> None:
    """A caller bug (a callee rejected what the target's own code passed it on a valid
    sequence, kvspec.spec.blame) is a bug whatever policy a hint names: no declaration
    makes passing a rejected value right."""
    for r in [report] + [x.report for x in getattr(report, "assuming", ())]:
        for f in r.violations:
            if f.violations[0].caller:
                f.label, f.hints = "bug", []


def interrupted_name(e: BaseException) -> str:
    """"SIGINT" or "SIGTERM": what stopped a run (a plain KeyboardInterrupt is a Ctrl-C)."""
    from kvspec.errors import Interrupted
    return str(e) if isinstance(e, Interrupted) and str(e) else "SIGINT"


def check_exit_code(report) -> int:
    """1 with a violation (found before or after an interrupt), 130/143 for an
    interrupted run that found none, 2 on an error, else 0."""
    if report.violations:
        return 1
    if report.interrupted:
        import signal
        return 128 + int(getattr(signal, report.interrupted, signal.SIGINT))
    return 2 if report.error else 0
