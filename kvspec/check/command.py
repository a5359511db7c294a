"""The ``kvspec check`` command: load the target, run the machines, write repros and
report files, print the result (text or one JSON object)."""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

from kvspec.errors import UsageError


def _emit(obj: dict, as_json: bool, text: str) -> None:
    if as_json:
        print(json.dumps(obj, default=str))
    else:
        print(text)


def check_kv_groups(spec, target) -> "str | None":
    """``--kv-groups`` checked once, up front: a malformed spec is a usage error, and a
    target that drives no groups is a target error (both one line, exit 2)."""
    if spec is None:
        return None
    from kvspec.errors import TargetError
    from kvspec.spec.model.groups import canonical_groups
    try:
        canonical = canonical_groups(spec)
    except ValueError as e:
        raise UsageError(f"--kv-groups: {e}") from None
    if canonical != "full" and not getattr(target.traits, "cache_features", False):
        raise TargetError(f"target {target.name} does not support KV-cache groups (--kv-groups {spec})")
    return canonical


def cmd_check(a: argparse.Namespace) -> int:
    """Exit code 0 when nothing was found, 1 on a violation."""
    from kvspec.check import watchdog
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
    if a.budget is None:
        a.budget = 30.0
    if a.budget <= 0:
        raise UsageError("kvspec check: --budget must be positive")
    op_timeout = getattr(a, "op_timeout", watchdog.DEFAULT_OP_TIMEOUT)
    if op_timeout is not None and op_timeout < 0:
        raise UsageError("kvspec check: --op-timeout must be positive (0 turns it off)")
    saved_timeout = watchdog.default()
    watchdog.set_default(op_timeout)
    try:
        return _check(a, max_examples, deterministic)
    finally:
        watchdog.set_default(saved_timeout)  # in-process callers (tests) get the default back


def _check(a: argparse.Namespace, max_examples, deterministic: bool) -> int:
    from kvspec.check.search import run_check
    from kvspec.report.text import check_text
    from kvspec.targets.patched import read_patch
    from kvspec.targets.registry import load_target

    target = load_target(a.target, patch=a.patch, api=a.api)
    patch_text = read_patch(a.patch) if a.patch else None
    report_dir = a.report_dir or os.path.join("reports", "repros")
    command = "kvspec " + " ".join(shlex.quote(x) for x in sys.argv[1:]) if sys.argv[1:2] == ["check"] else ""
    kw = dict(patch=a.patch, patch_text=patch_text, level=a.level, misuse=a.misuse, seed=a.seed, budget=a.budget,
              report_dir=report_dir, kv_groups=check_kv_groups(a.kv_groups, target), command=command,
              max_examples=max_examples if deterministic else None, database=getattr(a, "db", None))
    if (getattr(a, "jobs", None) or 1) > 1:
        from kvspec.check.jobs import run_jobs
        report = run_jobs(target, a.target, a.jobs, **kw)
    else:
        report = run_check(target, a.target, progress=sys.stderr.isatty() and not a.json, **kw)
    from kvspec.check.hints import continue_search
    from kvspec.targets.policies import declaration_of
    report.declaration, report.hintable = declaration_of(target), target.traits.hintable
    continue_search(target, a.target, report, kw)  # policy hints; the search goes on under a hint's assumption
    if a.report_dir:
        from kvspec.report.files import write_check_reports
        write_check_reports(report, a.report_dir)
    _emit(report.to_dict(), a.json, check_text(report))
    return 1 if report.violations else 0
