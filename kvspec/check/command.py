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


def cmd_check(a: argparse.Namespace) -> int:
    """Exit code 0 when nothing was found, 1 on a violation."""
    from kvspec.check.search import run_check
    from kvspec.report.text import check_text
    from kvspec.targets.patched import read_patch
    from kvspec.targets.registry import load_target

    if a.budget <= 0:
        raise UsageError("kvspec check: --budget must be positive")
    target = load_target(a.target, patch=a.patch, api=a.api)
    patch_text = read_patch(a.patch) if a.patch else None
    report_dir = a.report_dir or os.path.join("reports", "repros")
    command = "kvspec " + " ".join(shlex.quote(x) for x in sys.argv[1:]) if sys.argv[1:2] == ["check"] else ""
    report = run_check(target, a.target, patch=a.patch, patch_text=patch_text, level=a.level, misuse=a.misuse,
                       seed=a.seed, budget=a.budget, report_dir=report_dir,
                       progress=sys.stderr.isatty() and not a.json, command=command)
    if a.report_dir:
        from kvspec.report.files import write_check_reports
        write_check_reports(report, a.report_dir)
    _emit(report.to_dict(), a.json, check_text(report))
    return 1 if report.violations else 0
