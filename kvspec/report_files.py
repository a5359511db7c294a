"""Findings written to ``--report-dir``: JSON for tools (Markdown and JUnit join it)."""
from __future__ import annotations

import json
from pathlib import Path


def write_check_reports(report, directory: str) -> list[Path]:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    path = d / "kvspec-check.json"
    path.write_text(json.dumps(report.to_dict(), indent=1, default=str) + "\n")
    return [path]
