"""``--report-dir``: the findings as Markdown, JSON and JUnit XML."""
from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from kvspec.check.search import CheckReport, Finding, run_check
from kvspec.cli import main
from kvspec.spec.config import Config
from kvspec.spec.ops import Admit, Alloc, Free, Step
from kvspec.report.files import JSON_NAME, JUNIT_NAME, MD_NAME, write_check_reports
from kvspec.targets import load_target
from kvspec.spec.violation import Violation

CORPUS = Path(__file__).resolve().parents[1] / "kvspec" / "corpus" / "impl"


def _junit(path: Path) -> ET.Element:
    root = ET.parse(path).getroot()  # raises on XML that does not parse
    assert root.tag == "testsuites"
    return root


@pytest.fixture(scope="module")
def failing(tmp_path_factory):
    """A violation found on impl with a corpus bug, and the three files written for it."""
    d = tmp_path_factory.mktemp("report")
    patch = str(CORPUS / "touch_no_remove.diff")
    target = load_target("impl", patch=patch)
    report = run_check(target, "impl", patch=patch, level="pool", max_examples=500, report_dir=str(d))
    assert report.verdict == "violation"
    return report, d, write_check_reports(report, str(d), target)


def test_all_three_formats_written(failing):
    report, d, paths = failing
    assert sorted(p.name for p in paths) == sorted([JSON_NAME, MD_NAME, JUNIT_NAME])
    assert all(p.is_file() and p.stat().st_size > 0 for p in paths)
    data = json.loads((d / JSON_NAME).read_text())
    assert data["verdict"] == "violation" and data["violations"][0]["invariant"] == report.violations[0].invariant
    assert Path(data["violations"][0]["repro"]).is_file()


def test_junit_is_valid_xml_with_the_failure(failing):
    report, d, _ = failing
    root = _junit(d / JUNIT_NAME)
    suite = root.find("testsuite")
    cases = suite.findall("testcase")
    failures = suite.findall("testcase/failure")
    assert int(root.get("failures")) == int(suite.get("failures")) == len(failures) == 1
    assert int(suite.get("tests")) == len(cases) > 1
    f = report.violations[0]
    assert failures[0].get("type") == f.invariant
    assert f.invariant in failures[0].get("message") and f.repro in failures[0].get("message")
    assert repr(f.steps[-1]) in failures[0].text
    failing_case = [c for c in cases if c.find("failure") is not None][0]
    assert failing_case.get("classname") == "kvspec.pool"


def test_markdown_has_steps_table_and_before_after_blocks(failing):
    report, d, _ = failing
    md = (d / MD_NAME).read_text()
    f = report.violations[0]
    assert "| # | operation | target returned | reference model | violations |" in md
    for i, op in enumerate(f.steps):
        assert f"| {i + 1} | `{op!r}` |" in md
    assert f"#### Blocks before and after step {len(f.steps)}" in md
    assert "| block | ref count | hash | queued |" in md
    # touch_no_remove: the touched block's ref count goes 0 -> 1 while it stays queued
    assert "**0 → 1**" in md
    assert "| free queue (front first) |" in md
    assert f.invariant in md and "**violated**" in md


def test_passing_run(tmp_path):
    target = load_target("impl")
    report = run_check(target, "impl", level="all", max_examples=20, report_dir=str(tmp_path))
    write_check_reports(report, str(tmp_path), target)
    root = _junit(tmp_path / JUNIT_NAME)
    assert root.get("failures") == "0" and root.find("testsuite/testcase/failure") is None
    classes = {c.get("classname") for c in root.iter("testcase")}
    assert classes == {"kvspec.pool", "kvspec.cache"}
    md = (tmp_path / MD_NAME).read_text()
    assert "**Verdict: pass: nothing found**" in md and "## Violations" not in md


def test_robustness_finding_is_reported_without_failing(tmp_path):
    target = load_target("impl")
    cfg = Config(level="pool", num_blocks=4)
    steps = [Alloc(1), Free((1, 1))]
    rob = Finding("robustness", "pool", cfg, steps,
                  [Violation("ATOMIC_REJECT", "Free(blocks=(1, 1)) double free was accepted", "")], 2)
    report = CheckReport("impl", None, ["pool"], True, 0, 1.0, robustness=[rob], examples=3, steps=10, seconds=0.1)
    write_check_reports(report, str(tmp_path), target)
    root = _junit(tmp_path / JUNIT_NAME)
    assert root.get("failures") == "0"
    outs = [c.find("system-out") for c in root.iter("testcase") if c.get("name") == "ATOMIC_REJECT"]
    assert outs and outs[0] is not None and "robustness finding" in outs[0].text
    md = (tmp_path / MD_NAME).read_text()
    assert "## Robustness findings" in md and "`Free(blocks=(1, 1))`" in md


def test_check_cli_writes_the_reports(tmp_path, capsys):
    d = tmp_path / "out"
    rc = main(["check", "--target", "impl", "--patch", str(CORPUS / "no_evict.diff"), "--level", "pool",
               "--max-examples", "500", "--report-dir", str(d), "--json"])
    assert rc == 1
    out = json.loads(capsys.readouterr().out)
    assert out["verdict"] == "violation"
    for name in (JSON_NAME, MD_NAME, JUNIT_NAME):
        assert (d / name).is_file()
    assert _junit(d / JUNIT_NAME).get("failures") == "1"
    assert "#### Blocks before and after step" in (d / MD_NAME).read_text()  # the target was loaded for the replay


def test_cache_level_view_shows_request_tables(tmp_path):
    target = load_target("impl")
    cfg = Config(level="cache", num_blocks=6, block_size=2)

    steps = [Admit("r1", (1, 2, 3)), Step("r1", 4)]
    f = Finding("violation", "cache", cfg, steps, [Violation("I2", "made up for the view", "")], 2)
    report = CheckReport("impl", None, ["cache"], False, 0, 1.0, violations=[f], seconds=0.1)
    write_check_reports(report, str(tmp_path), target)
    md = (tmp_path / MD_NAME).read_text()
    assert "| request r1 | table [1, 2], computed 3 | table [1, 2], computed 4 |" in md
    assert "| 2 | `Step(req='r1', token=4)` | True | True |" in md


# -- figures (kvspec.report.figures): what the reports link --------------------------------------------
def _is_png(path: Path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 2000


def test_figures_write_pngs(tmp_path):
    from kvspec.report import figures

    mc_rows = [{"level": "pool", "blocks": 5, "depth": d, "states_per_second": 2000 / d, "transitions_per_second": 15000}
               for d in (5, 6, 7)] + [{"level": "cache", "blocks": 4, "depth": 6, "states_per_second": 4000}]
    assert _is_png(figures.states_per_second_vs_depth(mc_rows, tmp_path / "mc.png"))
    ttf = [{"bug": "a", "seconds_to_failure": [0.1, 0.3, None]}, {"patch": "b", "seconds": None}, {"id": "c", "ttf": 2.0}]
    assert _is_png(figures.ttf_per_bug(ttf, tmp_path / "sub" / "ttf.png", timeout=60))
    bw = [{"context": c, "gbps": c / 100, "dtype": dt} for c in (256, 1024, 4096) for dt in ("fp16", "bf16")]
    assert _is_png(figures.bandwidth_vs_context(bw, tmp_path / "bw.png", peak_gbps=3350))
    with pytest.raises(ValueError):
        figures.states_per_second_vs_depth([{"depth": 3}], tmp_path / "none.png")
    with pytest.raises(ValueError):
        figures.bandwidth_vs_context([{"gbps": 1.0}], tmp_path / "none.png")
