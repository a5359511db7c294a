"""``kvspec patches``: the runner on a few corpus patches with one seed, its JSON
contract, its reports, its exit codes (a killed equivalent mutant fails the run) and
its one-line usage errors. No assertion depends on timing."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvspec import corpus_runner
from kvspec.cli import main

CORPUS = Path(__file__).resolve().parents[1] / "kvspec" / "corpus"


def run(args, capsys):
    rc = main(args)
    out = capsys.readouterr()
    return rc, out


def test_patches_json_rows_summary_and_reports(capsys, tmp_path):
    rc, out = run(["patches", "--target", "impl", "--only", "no_evict,free_forward,popleft_loop", "--seeds", "1",
                   "--timeout", "5", "--jobs", "2", "--json", "--report-dir", str(tmp_path)], capsys)
    d = json.loads(out.out)
    assert rc == 0 and d["verdict"] == "pass"
    rows = {r["id"]: r for r in d["patches"]}
    assert set(rows) == {"no_evict", "free_forward", "popleft_loop"}
    for r in rows.values():
        for key in ("id", "kind", "expected", "killed", "seconds_to_failure", "repro_steps", "minimal_steps",
                    "found", "applied", "seeds", "diff", "caught_by"):
            assert key in r, key
        assert r["applied"] is True and r["seeds"] == 1
    ne = rows["no_evict"]
    assert ne["kind"] == "safety" and ne["killed"] == 1.0 and ne["found"] == {"I4": 1}
    assert ne["seconds_to_failure"] > 0 and ne["repro_steps"] >= 1
    assert ne["minimal_steps"] is not None and ne["minimal_steps"] <= ne["repro_steps"]
    assert rows["free_forward"]["kind"] == "policy" and rows["free_forward"]["killed"] == 1.0
    assert rows["popleft_loop"]["kind"] == "equivalent" and rows["popleft_loop"]["killed"] == 0.0
    assert rows["popleft_loop"]["seconds_to_failure"] is None
    s = d["summary"]
    assert s["safety"]["bugs"] == 1 and s["safety"]["solve_rate"] == 1.0
    assert s["policy"]["bugs"] == 1 and s["equivalent"]["false_positives"] == "0/1"
    assert set(s["safety"]["solved_within"]) == {"0.1", "1"}  # thresholds up to the timeout
    for key in ("median_seconds_to_failure", "p90_seconds_to_failure", "median_repro_steps", "median_minimal_steps",
                "median_repro_over_minimal"):
        assert key in s["safety"]
    assert len(d["trials"]) == 3 and all(t["applied"] for t in d["trials"])
    md = (tmp_path / "patches.md").read_text()
    assert "no_evict" in md and "false positives" in md
    assert json.loads((tmp_path / "patches.json").read_text())["patches"] == d["patches"]


def test_a_killed_equivalent_mutant_fails_the_run(capsys, tmp_path, monkeypatch):
    # A corpus that (wrongly) labels a real bug as an equivalent mutant: the kill is a false positive.
    fake = tmp_path / "corpus" / "impl"
    fake.mkdir(parents=True)
    shutil.copy(CORPUS / "impl" / "no_evict.diff", fake / "mislabelled.diff")
    (fake / "bugs.json").write_text(json.dumps([{"id": "mislabelled", "title": "t", "file": "mislabelled.diff",
                                                 "upstream": None, "level": "pool", "invariants": [],
                                                 "kind": "equivalent", "note": ""}]))
    monkeypatch.setattr(corpus_runner, "CORPUS_ROOT", tmp_path / "corpus")
    rc, out = run(["patches", "--seeds", "1", "--timeout", "5", "--json", "--report-dir", str(tmp_path / "r")], capsys)
    d = json.loads(out.out)
    assert rc == 1 and d["verdict"] == "fail"
    assert d["summary"]["equivalent"]["false_positives"] == "1/1"


def test_a_patch_that_does_not_apply_is_not_killed(capsys, tmp_path, monkeypatch):
    fake = tmp_path / "corpus" / "impl"
    fake.mkdir(parents=True)
    (fake / "stale.diff").write_text("--- a/impl/block_pool.py\n+++ b/impl/block_pool.py\n@@ -1,1 +1,1 @@\n"
                                     "-no such line\n+x\n")
    (fake / "bugs.json").write_text(json.dumps([{"id": "stale", "title": "t", "file": "stale.diff", "upstream": None,
                                                 "level": "pool", "invariants": ["I1"], "kind": "safety", "note": ""}]))
    monkeypatch.setattr(corpus_runner, "CORPUS_ROOT", tmp_path / "corpus")
    rc, out = run(["patches", "--seeds", "1", "--timeout", "5", "--json", "--report-dir", str(tmp_path / "r")], capsys)
    d = json.loads(out.out)
    assert rc == 1
    (row,) = d["patches"]
    assert row["applied"] is False and row["killed"] == 0.0 and "does not apply" in row["errors"][0]
    assert d["summary"]["patches_not_applied"] == ["stale"]


@pytest.mark.parametrize("args, needle", [
    (["patches", "--only", "no_such_patch"], "unknown patch id"),
    (["patches", "--seeds", "0"], "--seeds"),
    (["patches", "--timeout", "-1"], "--timeout"),
])
def test_usage_errors_are_one_line_exit_2(args, needle):
    r = subprocess.run([sys.executable, "-m", "kvspec.cli", *args], capture_output=True, text=True)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in r.stderr


def _vllm_available() -> str:
    if not (CORPUS / "vllm" / "bugs.json").is_file():
        return "no kvspec/corpus/vllm/bugs.json yet"
    try:
        from kvspec.targets import load_target
        load_target("vllm")
    except Exception as e:
        return f"the vllm target does not load here: {e}"
    return ""


@pytest.mark.upstream
@pytest.mark.skipif(bool(_vllm_available()), reason=_vllm_available() or "available")
def test_patches_on_the_vllm_corpus(capsys, tmp_path):
    bug = next(b for b in json.loads((CORPUS / "vllm" / "bugs.json").read_text()) if b["kind"] == "safety")
    rc, out = run(["patches", "--target", "vllm", "--only", bug["id"], "--seeds", "1", "--timeout", "20", "--json",
                   "--report-dir", str(tmp_path)], capsys)
    d = json.loads(out.out)
    (row,) = d["patches"]
    assert row["applied"] and row["killed"] == 1.0 and rc == 0
    assert (tmp_path / "patches_vllm.md").is_file() and not (tmp_path / "patches.md").exists()
