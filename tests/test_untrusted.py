"""Issue 32: patches and targets are untrusted input.

* a symbolic link, in the target's tree or in kvspec's copy, that leads out of the tree
  is never read or written through (``kvspec.patching.read_inside`` / ``write_inside``);
* a run the code under test ends itself (``os._exit(0)``, SIGKILL) exits non-zero with
  one line saying so, and one JSON object under ``--json`` (``kvspec.guard``);
* report files are written atomically: two processes rewriting one report directory
  never leave a torn file (``kvspec.atomic_write``).

The hostile diffs themselves (absolute paths, ``..``, links, binary, modes) are in the
argv fuzz test, tests/test_cli_fuzz.py.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from kvspec.cli import main
from kvspec.errors import PatchError
from kvspec.patching import read_inside, safe_path, write_inside

ROOT = Path(__file__).resolve().parents[1]


# -- links leading out of the tree ------------------------------------------------------
@pytest.fixture
def tree_with_links(tmp_path):
    tree, outside = tmp_path / "tree", tmp_path / "outside"
    (tree / "pkg").mkdir(parents=True)
    outside.mkdir()
    (outside / "real.py").write_text("secret = 1\n")
    (tree / "pkg" / "out_dir").symlink_to(outside, target_is_directory=True)
    (tree / "pkg" / "out_file.py").symlink_to(outside / "real.py")
    (tree / "pkg" / "plain.py").write_text("x = 1\n")
    return tree, outside


@pytest.mark.parametrize("rel", ["pkg/out_dir/new.py", "pkg/out_dir/real.py", "pkg/out_file.py"])
def test_write_inside_never_writes_through_a_link(tree_with_links, rel):
    tree, outside = tree_with_links
    before = sorted(p.name for p in outside.iterdir())
    with pytest.raises(PatchError, match="symbolic link"):
        write_inside(tree, rel, "pwned = 1\n")
    assert sorted(p.name for p in outside.iterdir()) == before
    assert (outside / "real.py").read_text() == "secret = 1\n"


def test_write_inside_writes_a_plain_file(tree_with_links):
    tree, _ = tree_with_links
    out = write_inside(tree, "pkg/new/mod.py", "y = 2\n")
    assert out == tree / "pkg" / "new" / "mod.py" and out.read_text() == "y = 2\n"


@pytest.mark.parametrize("rel", ["pkg/out_dir/real.py", "pkg/out_file.py"])
def test_read_inside_refuses_a_link_out_of_the_tree(tree_with_links, rel):
    tree, _ = tree_with_links
    with pytest.raises(PatchError, match="leading out"):
        read_inside(tree, rel)
    assert read_inside(tree, "pkg/plain.py") == "x = 1\n"


@pytest.mark.parametrize("name", ["/etc/passwd", "a/../../b.py", "..", "C:/x.py", "a\\..\\b.py", "~/x.py", ""])
def test_safe_path_refuses_paths_that_leave_the_tree(name):
    with pytest.raises(PatchError):
        safe_path(name)


def test_safe_path_normalizes_harmless_paths():
    assert safe_path("vllm//v1/./core/block_pool.py") == "vllm/v1/core/block_pool.py"


def test_a_user_package_with_a_link_out_is_refused_end_to_end(tmp_path, monkeypatch, capsys):
    """``module:NAME`` in a package whose file is a link out of it: a diff to that file is
    refused (exit 2, one line) and the file the link points to is untouched."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "real.py").write_text("VALUE = 1\n")
    pkg = tmp_path / "src" / "linkedpkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "alloc.py").write_text("from kvspec.impl import KVCacheManager\n\n\nclass T(KVCacheManager):\n    pass\n")
    (pkg / "helper.py").symlink_to(outside / "real.py")
    diff = tmp_path / "link.diff"
    diff.write_text("--- a/linkedpkg/helper.py\n+++ b/linkedpkg/helper.py\n@@ -1 +1 @@\n-VALUE = 1\n+VALUE = 2\n")
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    monkeypatch.chdir(tmp_path / "src")
    rc = main(["check", "--target", "linkedpkg.alloc:T", "--patch", str(diff), "--max-examples", "1"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert len(err.strip().splitlines()) == 1 and "symbolic link" in err, err
    assert (outside / "real.py").read_text() == "VALUE = 1\n"


# -- a target that ends the process -----------------------------------------------------
# `os._exit(0)` is caught inside the call (watchdog.guarded turns it into a finding);
# `posix._exit(0)` (the function under os's name) and SIGKILL end the process, which the
# CLI's child process reports.
ENDS = {
    "exit0": "os._exit(0)",
    "bound_exit0": "posix._exit(0)",
    "sigkill": "os.kill(os.getpid(), signal.SIGKILL)",
}


def _ending_target(tmp_path: Path, how: str) -> str:
    f = tmp_path / f"ends_{how}.py"
    f.write_text("import os\nimport posix\nimport signal\n\nfrom kvspec.impl import KVCacheManager\n\n\n"
                 "class T(KVCacheManager):\n"
                 "    def allocate_slots(self, *args, **kwargs):\n"
                 f"        {ENDS[how]}\n")
    return f"{f}:T"


def _kvspec(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvspec", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600, env={**os.environ, **env})


@pytest.mark.parametrize("how", ["bound_exit0", "sigkill"])
def test_a_target_that_ends_the_process_is_never_a_pass(tmp_path, how):
    target = _ending_target(tmp_path, how)
    args = ["check", "--target", target, "--level", "cache", "--max-examples", "5"]
    plain = _kvspec(args, tmp_path)
    assert plain.returncode == 2, plain
    lines = plain.stderr.strip().splitlines()
    assert len(lines) == 1 and "ended before it finished" in lines[0], plain.stderr
    assert ("exit status 0" if how == "bound_exit0" else "SIGKILL") in lines[0], plain.stderr
    as_json = _kvspec(args + ["--json"], tmp_path)
    assert as_json.returncode == 2, as_json
    obj = json.loads(as_json.stdout)  # one JSON object, nothing else
    assert obj["verdict"] == "error" and "ended before it finished" in obj["error"], as_json.stdout


@pytest.mark.parametrize("in_process", ["0", "1"])
def test_os_exit_inside_a_target_call_is_a_finding_not_the_end_of_the_run(tmp_path, in_process):
    """Caught at the call boundary, so it holds in-process too (the pytest plugin's case)."""
    target = _ending_target(tmp_path, "exit0")
    r = _kvspec(["check", "--target", target, "--level", "cache", "--max-examples", "5", "--json"], tmp_path,
                KVSPEC_IN_PROCESS=in_process)
    assert r.returncode == 1, r
    found = json.loads(r.stdout)["violations"]
    assert found and found[0]["invariant"] == "NO_CRASH" and "os._exit(0)" in found[0]["message"], r.stdout


def test_without_the_child_process_a_bound_os_exit_0_would_pass(tmp_path):
    """The failure the child process prevents, shown: run in-process (KVSPEC_IN_PROCESS=1),
    a target calling posix._exit (os._exit's own function) makes kvspec exit 0 with nothing on stdout."""
    target = _ending_target(tmp_path, "bound_exit0")
    r = _kvspec(["check", "--target", target, "--level", "cache", "--max-examples", "5", "--json"], tmp_path,
                KVSPEC_IN_PROCESS="1")
    assert r.returncode == 0 and r.stdout == "", r


def test_the_pytest_plugin_does_not_pass_a_target_that_calls_os_exit(tmp_path):
    target = _ending_target(tmp_path, "exit0")
    (tmp_path / "test_gate.py").write_text(
        "from kvspec.stateful import machines_for\n\n"
        f"TestGate = machines_for({target!r}, level='cache', profile='dev')\n")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_gate.py"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode != 0, r.stdout + r.stderr
    assert "os._exit(0)" in r.stdout, r.stdout


def test_a_completed_run_keeps_its_exit_code_and_json(tmp_path):
    bad = _kvspec(["check", "--patch", str(ROOT / "kvspec" / "corpus" / "impl" / "no_evict.diff"),
                   "--level", "pool", "--max-examples", "300", "--json", "--report-dir", str(tmp_path / "r")],
                  tmp_path)
    assert bad.returncode == 1, bad
    assert json.loads(bad.stdout)["verdict"] == "violation"
    usage = _kvspec(["check", "--bogus", "--json"], tmp_path)
    assert usage.returncode == 2 and json.loads(usage.stdout)["verdict"] == "error", usage


# -- atomic report files ----------------------------------------------------------------
def _report(n_warnings: int, seed: int):
    from kvspec.check.search import CheckReport
    return CheckReport(target="impl", patch=None, levels=["pool"], misuse=False, seed=seed, budget=1.0,
                       examples=seed, warnings=[f"warning {i} of run {seed} " + "x" * 200 for i in range(n_warnings)])


def _writer(directory: str, seed: int, n_warnings: int, rounds: int) -> None:
    from kvspec.report.files import write_check_reports
    report = _report(n_warnings, seed)
    for _ in range(rounds):
        write_check_reports(report, directory)


def test_two_processes_rewriting_one_report_directory_never_leave_a_torn_file(tmp_path):
    from kvspec.report.files import JSON_NAME, JUNIT_NAME, MD_NAME, write_check_reports

    d = tmp_path / "reports"
    # Two different reports, one large (a torn write of it would show), one small.
    runs = {1: 2000, 2: 3}
    expected = {}
    for seed, n in runs.items():
        write_check_reports(_report(n, seed), str(d))
        expected[seed] = tuple((d / name).read_bytes() for name in (JSON_NAME, MD_NAME, JUNIT_NAME))
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(str(d), seed, n, 60)) for seed, n in runs.items()]
    for p in procs:
        p.start()
    reads = 0
    while any(p.is_alive() for p in procs) or reads < 20:
        for i, name in enumerate((JSON_NAME, MD_NAME, JUNIT_NAME)):
            data = (d / name).read_bytes()
            assert data in (expected[1][i], expected[2][i]), f"{name}: a torn file ({len(data)} bytes)"
        json.loads((d / JSON_NAME).read_text())
        ET.fromstring((d / JUNIT_NAME).read_bytes())
        reads += 1
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    assert sorted(p.name for p in d.iterdir()) == sorted([JSON_NAME, MD_NAME, JUNIT_NAME])  # no temp file left


def test_write_atomic_leaves_the_old_file_when_writing_fails(tmp_path):
    from kvspec.atomic_write import replacing

    f = tmp_path / "r.json"
    f.write_text('{"old": 1}\n')
    with pytest.raises(RuntimeError):
        with replacing(f) as tmp:
            tmp.write_text('{"new": ')
            raise RuntimeError("the writer failed half-way")
    assert f.read_text() == '{"old": 1}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_a_plain_git_diff_is_still_accepted():
    """No false refusal: git's headers (index, an executable-bit change, a quoted name)
    and a ``diff -u x.orig x`` pair of names parse to the file they change."""
    from kvspec.patching import parse_unified_diff

    git = ("diff --git a/impl/block_pool.py b/impl/block_pool.py\nold mode 100644\nnew mode 100755\n"
           "index 1111111..2222222\n--- a/impl/block_pool.py\n+++ b/impl/block_pool.py\n@@ -1 +1 @@\n-a\n+b\n"
           'diff --git "a/impl/with space.py" "b/impl/with space.py"\nnew file mode 100644\n'
           '--- /dev/null\n+++ "b/impl/with space.py"\n@@ -0,0 +1 @@\n+x = 1\n')
    assert [(f.path, f.new_file) for f in parse_unified_diff(git)] == [("impl/block_pool.py", False),
                                                                       ("impl/with space.py", True)]
    plain = "--- impl/block_pool.py.orig\t2026-01-01\n+++ impl/block_pool.py\t2026-01-01\n@@ -1 +1 @@\n-a\n+b\n"
    assert [f.path for f in parse_unified_diff(plain)] == ["impl/block_pool.py"]
