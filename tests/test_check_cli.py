"""`kvspec check`: verdicts, exit codes, JSON contract, repro files, one-line errors."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvspec.cli import main

CORPUS = Path(__file__).resolve().parents[1] / "kvspec" / "corpus" / "impl"


def run_json(args, capsys):
    rc = main(args + ["--json"])
    out = capsys.readouterr()
    return rc, json.loads(out.out), out.err


def test_default_check_passes_with_the_contract_keys(capsys, tmp_path):
    rc, d, _ = run_json(["check", "--max-examples", "60", "--report-dir", str(tmp_path)], capsys)
    assert rc == 0 and d["verdict"] == "pass"
    for key in ("target", "verdict", "violations", "examples", "seconds", "steps"):
        assert key in d
    assert d["examples"] > 0 and d["steps"] > 0 and d["levels"] == ["pool", "cache"]


def test_misuse_check_on_impl_passes(capsys, tmp_path):
    rc, d, _ = run_json(["check", "--misuse", "--max-examples", "100", "--report-dir", str(tmp_path)], capsys)
    assert rc == 0 and d["verdict"] == "pass" and d["robustness"] == []


FOUNDATION = ["no_evict", "touch_no_remove", "ref_not_decremented", "partial_cached", "hash_no_parent",
              "free_forward", "full_prompt_hit", "stale_index", "capacity_off_by_one", "null_block_queued"]


@pytest.mark.parametrize("bug", FOUNDATION)
def test_each_self_test_patch_is_reported_with_its_invariant(bug, capsys, tmp_path):
    meta = {b["id"]: b for b in json.loads((CORPUS / "bugs.json").read_text())}[bug]
    # the first finding is the subject here: --max-findings 1 spares the search past it (CI time)
    rc, d, _ = run_json(["check", "--patch", str(CORPUS / meta["file"]), "--max-examples", "1000", "--seed", "1",
                         "--max-findings", "1", "--report-dir", str(tmp_path)], capsys)
    assert rc == 1 and d["verdict"] == "violation"
    v = d["violations"][0]
    assert v["invariant"] in meta["invariants"], v["message"]  # one of its symptoms (bugs.json lists them)
    assert v["steps"] and len(v["steps"]) == v["num_steps"] or meta["id"] == "null_block_queued"
    assert Path(v["repro"]).is_file()


def test_repro_file_fails_on_the_patch_and_passes_without_it(capsys, tmp_path):
    rc, d, _ = run_json(["check", "--patch", str(CORPUS / "no_evict.diff"), "--max-examples", "1000",
                         "--max-findings", "1", "--report-dir", str(tmp_path)], capsys)
    repro, invariant = d["violations"][0]["repro"], d["violations"][0]["invariant"]
    env = dict(os.environ)
    env.pop("KVSPEC_PATCH", None)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", repro],
                       capture_output=True, text=True, env=env, cwd=tmp_path)
    assert r.returncode == 1 and f"{invariant} " in r.stdout  # the repro fails with the finding's invariant
    env["KVSPEC_PATCH"] = "none"
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", repro],
                       capture_output=True, text=True, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stdout


@pytest.mark.parametrize("args, needle", [
    (["check", "--target", "nope"], "unknown target"),
    (["check", "--target", "no_such_module_xyz:Pool"], "no_such_module_xyz"),
    (["check", "--patch", "/does/not/exist.diff"], "cannot read patch"),
    (["check", "--budget", "-1"], "budget"),
    (["check", "--budget", "5", "--max-examples", "10"], "--budget cannot be combined"),
    (["check", "--budget", "5", "--derandomize"], "--budget cannot be combined"),
    (["check", "--max-examples", "0"], "max-examples"),
    (["check", "--op-timeout", "-1"], "op-timeout"),
    (["check", "--level", "sideways"], "level"),
])
def test_usage_and_target_errors_are_one_line_exit_2(args, needle):
    r = subprocess.run([sys.executable, "-m", "kvspec.cli", *args], capture_output=True, text=True)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in r.stderr


def test_a_patch_that_does_not_apply_names_file_and_hunk(tmp_path):
    bad = tmp_path / "bad.diff"
    bad.write_text("--- a/impl/block_pool.py\n+++ b/impl/block_pool.py\n@@ -1,2 +1,2 @@\n-no such line\n+x\n context\n")
    r = subprocess.run([sys.executable, "-m", "kvspec.cli", "check", "--patch", str(bad)], capture_output=True, text=True)
    assert r.returncode == 2
    assert "impl/block_pool.py" in r.stderr and "@@ -1,2 +1,2 @@" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_target_crash_under_valid_use_is_a_finding_with_a_repro(capsys, tmp_path):
    crash = tmp_path / "crash.diff"
    crash.write_text(
        "--- a/impl/block_pool.py\n+++ b/impl/block_pool.py\n@@ -76,2 +76,4 @@\n"
        "         blocks = self.free_block_queue.popleft_n(num_blocks)\n"
        "+        if num_blocks == 3:\n+            raise RuntimeError('boom')\n"
        "         for block in blocks:\n")
    rc, d, _ = run_json(["check", "--patch", str(crash), "--level", "pool", "--max-examples", "1000",
                         "--report-dir", str(tmp_path)], capsys)
    assert rc == 1
    v = d["violations"][0]
    assert v["invariant"] == "NO_CRASH" and "boom" in v["message"]
    assert v["steps"][-1] == {"op": "Alloc", "n": 3} and Path(v["repro"]).is_file()
