"""``kvspec check --minimize ddmin``: each finding cut down by ddmin alone, nothing proven
(the release sweep's way); the default also runs the bounded BFS that proves a repro shortest."""
import json
import subprocess
import sys
from pathlib import Path

from kvspec.check.search import run_check
from kvspec.check.session import run_steps
from kvspec.targets.registry import load_target

CORPUS = Path(__file__).resolve().parents[1] / "kvspec" / "corpus" / "impl"


def test_ddmin_alone_finds_the_same_bug_at_the_same_example_and_proves_nothing(tmp_path):
    t = load_target("impl", patch=str(CORPUS / "free_forward.diff"))
    kw = dict(level="cache", seed=0, max_examples=300)
    full = run_check(t, "impl", report_dir=str(tmp_path / "full"), **kw)
    quick = run_check(t, "impl", report_dir=str(tmp_path / "quick"), prove_minimal=False, **kw)
    assert full.verdict == quick.verdict == "violation"
    f, q = full.violations[0], quick.violations[0]
    assert (q.invariant, q.examples_to_failure) == (f.invariant, f.examples_to_failure)
    assert q.minimal is None and len(q.steps) >= len(f.steps)
    assert f.minimal is True   # the default proves this repro shortest; ddmin alone leaves it unproven
    out = run_steps(t, q.config, q.steps)   # the ddmin repro still fails, with its invariant
    assert out.failed and out.invariant == q.invariant


def test_the_option_reaches_the_command_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "kvspec", "check", "--target", "impl", "--level", "pool",
                        "--max-examples", "5", "--minimize", "ddmin", "--json", "--report-dir", str(tmp_path)],
                       capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0 and json.loads(r.stdout)["verdict"] == "pass", r.stderr[-1500:]
    bad = subprocess.run([sys.executable, "-m", "kvspec", "check", "--minimize", "bfs"], capture_output=True,
                         text=True, cwd=tmp_path)
    assert bad.returncode == 2 and "--minimize" in bad.stderr
