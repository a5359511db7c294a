"""``kvspec patches``: the runner on a few corpus patches with one seed, its JSON
contract, its reports, its exit codes (a killed equivalent mutant fails the run) and
its one-line usage errors. No assertion depends on timing."""
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from kvspec.corpus import command, report, runner, stats
from kvspec.cli import main

CORPUS = Path(__file__).resolve().parents[1] / "kvspec" / "corpus"
NO_EVICT = next(b for b in json.loads((CORPUS / "impl" / "bugs.json").read_text()) if b["id"] == "no_evict")


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
    assert ne["kind"] == "safety" and ne["killed"] == 1.0 and sum(ne["found"].values()) == 1
    assert set(ne["found"]) <= set(NO_EVICT["invariants"])  # one of its symptoms (the corpus lists them)
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
    assert "no_evict" in md and "false positives" in md and "## Target `impl --only " in md  # an --only run is its own section
    assert "`kvspec patches --target impl --seeds 1 --timeout 5 --only no_evict,free_forward,popleft_loop`" in md
    assert "### Safety bugs" in md and "### Policy bugs" in md and "### Equivalent mutants" in md
    assert "(patches_ttf.png)" in md and (tmp_path / "patches_ttf.png").stat().st_size > 0
    doc = json.loads((tmp_path / "patches.json").read_text())
    key = "impl --only no_evict,free_forward,popleft_loop"
    assert list(doc["targets"]) == [key] and doc["targets"][key]["patches"] == d["patches"]
    # progress on stderr, one line per finished patch when stderr is not a terminal
    assert "[patches 3/3]" in out.err and "killed 1/1" in out.err


def test_a_killed_equivalent_mutant_fails_the_run(capsys, tmp_path, monkeypatch):
    # A corpus that (wrongly) labels a real bug as an equivalent mutant: the kill is a false positive.
    fake = tmp_path / "corpus" / "impl"
    fake.mkdir(parents=True)
    shutil.copy(CORPUS / "impl" / "no_evict.diff", fake / "mislabelled.diff")
    (fake / "bugs.json").write_text(json.dumps([{"id": "mislabelled", "title": "t", "file": "mislabelled.diff",
                                                 "upstream": None, "level": "pool", "invariants": [],
                                                 "kind": "equivalent", "note": ""}]))
    monkeypatch.setattr(runner, "CORPUS_ROOT", tmp_path / "corpus")
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
    monkeypatch.setattr(runner, "CORPUS_ROOT", tmp_path / "corpus")
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


def _available(target: str, package: str) -> str:
    if not (CORPUS / target / "bugs.json").is_file():
        return f"no kvspec/corpus/{target}/bugs.json"
    import importlib.util
    if importlib.util.find_spec(package) is None:
        return f"{package} is not installed"
    return ""


def _run_cli(args):
    # in a fresh process, as a user runs it: the target's package is imported there
    # first, whatever this test session imported before
    # (cwd outside the checkout, as a user's would be: `python -m` puts the cwd first on
    # sys.path)
    r = subprocess.run([sys.executable, "-m", "kvspec.cli", *args], capture_output=True, text=True, timeout=600,
                       cwd=tempfile.gettempdir())
    return r.returncode, r


def _synthetic_run(target: str, ttf: float) -> dict:
    bugs = [{"id": "b1", "title": "t", "file": "b1.diff", "kind": "safety", "invariants": ["I1"], "level": "pool",
             "engine": "check"},
            {"id": "e1", "title": "t", "file": "e1.diff", "kind": "equivalent", "invariants": [], "level": "pool",
             "engine": "check"}]
    trials = [{"id": "b1", "seed": s, "applied": True, "killed": True, "invariant": "I1", "also": [],
               "seconds_to_failure": ttf * (s + 1), "repro_steps": 3, "minimal_steps": 2, "minimal_proven": True,
               "error": None} for s in range(2)]
    trials += [{"id": "e1", "seed": s, "applied": True, "killed": False, "invariant": None, "also": [],
                "seconds_to_failure": None, "repro_steps": None, "minimal_steps": None, "minimal_proven": False,
                "error": None} for s in range(2)]
    res = stats.summarize(target, bugs, trials, {}, {"seeds": 2, "timeout": 5.0, "jobs": 1}, 1.0)
    res["command"] = f"kvspec patches --target {target} --seeds 2 --timeout 5"
    return res


def test_reports_keep_one_section_per_target_and_rerender(tmp_path):
    a = _synthetic_run("vllm", 0.5)
    report.write_reports(a, str(tmp_path))
    report.write_reports(_synthetic_run("impl", 0.01), str(tmp_path))
    report.write_reports(_synthetic_run("impl", 0.02), str(tmp_path))  # replaces impl's section only
    doc = json.loads((tmp_path / "patches.json").read_text())
    assert list(doc["targets"]) == ["impl", "vllm"]
    assert doc["targets"]["impl"]["trials"][0]["seconds_to_failure"] == 0.02
    assert doc["targets"]["vllm"]["patches"] == a["patches"]
    md = (tmp_path / "patches.md").read_text()
    assert md.index("## Target `impl`") < md.index("## Target `vllm`")
    assert "`kvspec patches --target vllm --seeds 2 --timeout 5`" in md
    s = doc["targets"]["impl"]["summary"]["safety"]
    assert s["median_repro_over_minimal"] == 1.5 and s["solve_rate"] == 1.0
    (tmp_path / "patches.md").unlink()
    (tmp_path / "patches_ttf.png").unlink()
    assert command.main(["--render", str(tmp_path)]) == 0
    assert (tmp_path / "patches.md").read_text() == md and (tmp_path / "patches_ttf.png").is_file()


def test_a_target_without_a_corpus_is_a_one_line_usage_error(capsys, tmp_path, monkeypatch):
    (tmp_path / "corpus" / "impl").mkdir(parents=True)
    (tmp_path / "corpus" / "impl" / "bugs.json").write_text("[]")
    monkeypatch.setattr(runner, "CORPUS_ROOT", tmp_path / "corpus")
    rc, out = run(["patches", "--target", "nanovllm", "--seeds", "1"], capsys)
    assert rc == 2 and out.out == ""
    (line,) = out.err.strip().splitlines()
    assert "no bug corpus for target nanovllm" in line and "corpora here: impl" in line


@pytest.mark.upstream
@pytest.mark.parametrize("target, package", [("vllm", "vllm"), ("nanovllm", "nanovllm")])
def test_patches_on_an_upstream_corpus(target, package, tmp_path):
    missing = _available(target, package)
    if missing:
        pytest.skip(missing)
    bug = next(b for b in json.loads((CORPUS / target / "bugs.json").read_text()) if b["kind"] == "safety")
    rc, r = _run_cli(["patches", "--target", target, "--only", bug["id"], "--seeds", "1", "--timeout", "20",
                      "--json", "--report-dir", str(tmp_path)])
    d = json.loads(r.stdout)
    (row,) = d["patches"]
    assert row["applied"] and row["killed"] == 1.0 and rc == 0, (row, r.stderr[-2000:])
    doc = json.loads((tmp_path / "patches.json").read_text())
    key = f"{target} --only {bug['id']}"
    assert list(doc["targets"]) == [key] and f"## Target `{key}`" in (tmp_path / "patches.md").read_text()


def test_workers_leave_no_temporary_files_even_when_killed(tmp_path, monkeypatch):
    # Forked workers end in os._exit (no atexit handlers): the patched copies each trial
    # makes must still go, also for a worker killed at its hard limit.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    task = {"target": "impl", "patch": str(CORPUS / "impl" / "no_evict.diff"), "timeout": 5, "minimal": False}
    jobs = [("run_trial", dict(task, id="no_evict", seed=0), 60.0),
            ("run_trial", dict(task, id="popleft_loop", seed=1, patch=str(CORPUS / "impl" / "popleft_loop.diff")), 1.0)]
    done = {r["seed"]: r for r in runner.run_pool(jobs, 2)}
    assert done[0]["applied"] and done[0]["killed"] and done[0]["invariant"] in NO_EVICT["invariants"]
    assert done[1].get("timed_out") is True  # an equivalent mutant searched for 5 s, killed after 1 s
    assert list(tmp_path.iterdir()) == []
