"""One-line errors, no lost findings and honest reports (issue 22): the cases the argv
fuzz test (test_cli_fuzz.py) draws at random, asserted one by one with what the user
must see."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvspec.cli import build_parser, main

CORPUS = Path(__file__).resolve().parents[1] / "kvspec" / "corpus" / "impl"
NO_EVICT = str(CORPUS / "no_evict.diff")


def run(argv, capsys):
    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("argv", [
    ["check", "--budget", "nan"], ["check", "--budget", "inf"], ["check", "--budget", "-1"],
    ["check", "--op-timeout", "nan"], ["check", "--max-examples", "0"], ["check", "--jobs", "-3"],
    ["mc", "--time-cap", "nan"], ["mc", "--mem-cap", "inf"], ["mc", "--blocks", "0"], ["mc", "--depth", "-1"],
    ["patches", "--timeout", "nan"], ["patches", "--seeds", "0"], ["kernels", "--cases", "0"],
    ["diff", "--patch", NO_EVICT, "--per-condition-timeout", "nan"],
])
def test_a_bad_count_or_time_is_one_line_exit_2_and_json_under_json(argv, capsys):
    rc, out, err = run(argv, capsys)
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert argv[-2] in err, err  # the line names the option
    rc, out, err = run(argv + ["--json"], capsys)
    obj = json.loads(out)
    assert rc == 2 and obj["verdict"] == "error" and argv[-2] in obj["error"] and obj["command"] == argv[0]


def test_a_binary_patch_is_one_line(tmp_path, capsys):
    binary = tmp_path / "x.diff"
    binary.write_bytes(bytes(range(256)))
    for argv in (["check", "--max-examples", "1"], ["mc", "--depth", "1"], ["diff"]):
        rc, out, err = run(argv + ["--patch", str(binary)], capsys)
        assert rc == 2 and "internal error" not in err and "binary" in err and len(err.strip().splitlines()) == 1


def test_a_malformed_declaration_is_one_line_and_json(tmp_path, capsys):
    f = tmp_path / "t.py"
    f.write_text("from kvspec.impl import KVCacheManager\n\n\nclass T(KVCacheManager):\n"
                 "    kvspec_traits = \"not a dict\"\n")
    rc, out, err = run(["check", "--max-examples", "1", "--target", f"{f}:T", "--json"], capsys)
    assert rc == 2 and "internal error" not in err and json.loads(out)["verdict"] == "error", err


def test_a_target_that_fails_to_load_still_prints_json(capsys):
    rc, out, err = run(["check", "--target", "/no/such/file.py:T", "--json"], capsys)
    obj = json.loads(out)
    assert rc == 2 and obj["verdict"] == "error" and "no such file" in obj["error"] and err.strip()


def test_an_unwritable_report_dir_is_refused_before_the_search(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    rc, out, err = run(["check", "--patch", NO_EVICT, "--max-examples", "300", "--report-dir", str(blocker / "r"),
                        "--json"], capsys)
    assert rc == 2 and json.loads(out)["verdict"] == "error" and "--report-dir" in err


def test_a_report_file_that_cannot_be_written_is_a_warning_after_the_verdict(tmp_path, capsys, monkeypatch):
    from kvspec.report import files

    def refuse(*a, **k):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(files, "write_check_reports", refuse)
    rc, out, err = run(["check", "--patch", NO_EVICT, "--max-examples", "300", "--report-dir", str(tmp_path)],
                       capsys)
    assert rc == 1 and "VIOLATION" in out and "verdict: violation" in out
    assert "warning: report files not written" in err and "Permission denied" in err and "Traceback" not in err


def test_a_repro_that_cannot_be_written_is_a_warning_and_the_finding_is_kept(tmp_path, capsys, monkeypatch):
    from kvspec.check import search

    def refuse(*a, **k):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(search, "write_repro", refuse)
    rc, out, err = run(["check", "--patch", NO_EVICT, "--max-examples", "300", "--report-dir", str(tmp_path),
                        "--json"], capsys)
    d = json.loads(out)
    assert rc == 1 and d["verdict"] == "violation" and d["violations"][0]["repro"] is None
    assert d["warnings"] and "repro not written" in err


def test_jobs_beyond_the_cores_are_capped_with_a_note(capsys, monkeypatch):
    from kvspec.check import command
    monkeypatch.setattr(command, "available_cores", lambda: 1)
    rc, out, err = run(["check", "--jobs", "64", "--budget", "0.2", "--json"], capsys)
    assert rc == 0 and "--jobs 64 capped to 1" in err and json.loads(out)["verdict"] == "pass"


def test_every_option_has_help_and_shows_its_default():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name, p in sub.choices.items():
        text = p.format_help()
        for action in p._actions:
            if not action.option_strings or action.dest == "help":
                continue
            assert action.help, f"kvspec {name} {action.option_strings[0]} has no help"
            if action.default is not None and action.default is not False and not action.required:
                assert "default" in p._get_formatter()._get_help_string(action), (name, action.option_strings)
        assert "(default: None)" not in text, name


def test_patches_writes_outside_the_committed_reports_by_default():
    a = build_parser().parse_args(["patches"])
    assert a.report_dir and Path(a.report_dir).parts[0] != "reports"


def test_the_markdown_report_says_not_exercised_for_checks_that_never_ran(tmp_path, capsys):
    rc, _, _ = run(["check", "--max-examples", "20", "--kv-groups", "full", "--report-dir", str(tmp_path)], capsys)
    md = (tmp_path / "kvspec-check.md").read_text()
    row = {line.split("|")[1].strip().split()[0]: line.split("|")[3].strip() for line in md.splitlines()
           if line.startswith("| ") and line.count("|") == 4 and line.split("|")[1].strip()}
    assert rc == 0
    assert row["HIT_AGREEMENT"].startswith("not exercised") and row["WINDOW"].startswith("not exercised")
    assert row["I1"] == "no violation found", row


def test_the_markdown_report_says_not_exercised_without_a_null_block():
    from types import SimpleNamespace
    from kvspec.check.search import not_exercised
    target = SimpleNamespace(traits=SimpleNamespace(null_block=False, cache_features=False))
    why = not_exercised(target, ["pool"], None)
    assert set(why) == {"NULL_BLOCK", "HIT_AGREEMENT", "WINDOW", "SLOTS"}


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_check_prints_what_it_reached(sig, tmp_path):
    """A signal during the search: the counts reached, marked incomplete, on stdout as
    JSON; exit 128 + the signal. The wait for the first example is bounded by counting
    report lines, never by a timing assertion."""
    reports = tmp_path / "r"  # created just before the signal handlers are set
    p = subprocess.Popen([sys.executable, "-m", "kvspec", "check", "--budget", "120", "--json",
                          "--report-dir", str(reports)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, cwd=tmp_path)
    for _ in range(600):
        if reports.exists() or p.poll() is not None:
            break
        time.sleep(0.1)
    time.sleep(2)  # into the search, most likely (either way the answer must be the same shape)
    p.send_signal(sig)
    out, err = p.communicate(timeout=120)
    d = json.loads(out)
    assert p.returncode == 128 + sig, err
    assert d["verdict"] == "incomplete" and d["complete"] is False and d["interrupted"] == sig.name
    assert "examples" in d and "steps" in d and "seconds" in d
