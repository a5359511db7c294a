"""``kvspec check --jobs N`` and ``--db DIR`` (issue 13): workers with different seeds whose
distinct findings are merged (with one finding asked for, all stop at the first), and Hypothesis's directory database replaying a failure
found before. Searches are bounded by example counts (the verdicts do not depend on
the machine); the CLI keeps --jobs/--db to budget runs."""
from pathlib import Path

import pytest

from kvspec.check.jobs import run_jobs
from kvspec.check.search import run_check
from kvspec.cli import main
from kvspec.targets.registry import load_target

CORPUS = Path(__file__).resolve().parents[1] / "kvspec" / "corpus" / "impl"


def test_two_workers_stop_at_the_first_violation(tmp_path):
    t = load_target("impl", patch=str(CORPUS / "ref_not_decremented.diff"))
    report = run_jobs(t, "impl", 2, level="pool", seed=0, max_examples=300, report_dir=str(tmp_path))
    assert report.verdict == "violation" and report.violations[0].invariant == "ACCOUNTING"
    assert report.examples < 2 * 300  # the workers stopped early, the one without it too


def test_two_workers_on_a_correct_target_sum_their_work(tmp_path):
    t = load_target("impl")
    one = run_check(t, "impl", level="pool", seed=0, max_examples=30, report_dir=str(tmp_path))
    both = run_jobs(t, "impl", 2, level="pool", seed=0, max_examples=30, report_dir=str(tmp_path))
    assert both.verdict == "pass" and both.examples > one.examples and both.steps > one.steps


def test_a_failure_in_the_database_is_replayed_first(tmp_path):
    t = load_target("impl", patch=str(CORPUS / "free_forward.diff"))
    db = str(tmp_path / "db")
    first = run_check(t, "impl", level="cache", seed=0, max_examples=500, database=db, report_dir=str(tmp_path))
    assert first.violations and first.violations[0].examples_to_failure > 2
    again = run_check(t, "impl", level="cache", seed=9, max_examples=500, database=db, report_dir=str(tmp_path))
    assert again.violations and again.violations[0].examples_to_failure <= 2  # the saved example, first


@pytest.mark.parametrize("args", [["--jobs", "2", "--max-examples", "10"], ["--db", "x", "--derandomize"],
                                  ["--jobs", "0"]])
def test_jobs_and_db_are_budget_options(args, capsys):
    assert main(["check", *args]) == 2
    assert "--jobs" in capsys.readouterr().err


def test_workers_report_every_distinct_bug_once(tmp_path):
    # two independent corpus bugs in one target; each worker searches for both, and the
    # merged report has each signature once (two workers that found one bug: one finding)
    import json
    bugs = ("cache_no_index", "append_n_no_count")
    expected = {b["id"]: b["invariants"][0] for b in json.loads((CORPUS / "bugs.json").read_text()) if b["invariants"]}
    patch = tmp_path / "two.diff"
    patch.write_text("".join((CORPUS / f"{b}.diff").read_text() for b in bugs))
    t = load_target("impl", patch=str(patch))
    report = run_jobs(t, "impl", 2, level="pool", seed=0, max_examples=300, max_findings=5,
                      report_dir=str(tmp_path))
    sigs = [f.signature for f in report.violations]
    assert len(sigs) >= 2 and len(set(sigs)) == len(sigs)
    assert {f.invariant for f in report.violations} >= {expected[b] for b in bugs}
