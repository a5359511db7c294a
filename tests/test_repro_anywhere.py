"""Repro files run from anywhere (issue 22): the target is found from the repro file's
own location (``RAN_IN``: the directory ``kvspec check`` ran in, relative to the repro
and absolute), a patch's paths keep their meaning there, and ``KVSPEC_TARGET`` names
another target. The allocators are this project's examples, copied into ``tmp_path``."""
import difflib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GOOD = ROOT / "examples" / "my_block_manager.py"
BUGGY = ROOT / "examples" / "my_block_manager_buggy.py"
ENV = dict(os.environ, PYTHONPATH=str(ROOT))


def _check(cwd: Path, *argv: str) -> dict:
    r = subprocess.run([sys.executable, "-m", "kvspec", "check", *argv, "--max-examples", "1000", "--json"],
                       cwd=cwd, capture_output=True, text=True, env=ENV, timeout=600)
    assert r.returncode == 1, (r.stdout[-2000:], r.stderr[-2000:])
    return json.loads(r.stdout)["violations"][0]


def _pytest(repro: Path, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(repro)],
                          cwd=cwd, capture_output=True, text=True, env=dict(ENV, **env), timeout=600)


def test_a_repro_replays_from_another_directory_and_after_the_project_moves(tmp_path):
    proj = tmp_path / "proj"
    (proj / "src").mkdir(parents=True)
    shutil.copy(BUGGY, proj / "src" / "alloc.py")
    v = _check(proj, "--target", "src/alloc.py:BlockManager", "--report-dir", "out")
    assert v["invariant"] == "INDEX_CONSISTENT"
    repro = proj / v["repro"]
    text = repro.read_text()
    assert "TARGET = 'src/alloc.py:BlockManager'" in text and "RAN_IN = ('..'," in text

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    r = _pytest(repro, elsewhere)
    assert r.returncode == 1 and "INDEX_CONSISTENT" in r.stdout and "no such file" not in r.stdout, r.stdout[-3000:]

    # the checkout moves (or is cloned elsewhere): the path relative to the repro still holds
    moved = tmp_path / "moved" / "proj"
    moved.parent.mkdir()
    shutil.move(str(proj), str(moved))
    r = _pytest(moved / v["repro"], elsewhere)
    assert r.returncode == 1 and "INDEX_CONSISTENT" in r.stdout, r.stdout[-3000:]

    # KVSPEC_TARGET names another target (from the current directory): the fixed one passes
    shutil.copy(GOOD, elsewhere / "fixed.py")
    r = _pytest(moved / v["repro"], elsewhere, KVSPEC_TARGET="fixed.py:BlockManager")
    assert r.returncode == 0, r.stdout[-3000:]

    # nothing to be found anywhere: one line that says what to set
    shutil.rmtree(moved / "src")
    r = _pytest(moved / v["repro"], elsewhere)
    assert r.returncode == 1 and "KVSPEC_TARGET" in r.stdout, r.stdout[-3000:]


def test_a_patched_repro_replays_from_another_directory(tmp_path):
    """A patch names its file relative to the directory kvspec check ran in; the repro
    loads the target from there, so the diff's paths still match."""
    proj = tmp_path / "proj"
    (proj / "src").mkdir(parents=True)
    shutil.copy(GOOD, proj / "src" / "alloc.py")
    diff = "".join(difflib.unified_diff(GOOD.read_text().splitlines(True), BUGGY.read_text().splitlines(True),
                                        "a/src/alloc.py", "b/src/alloc.py"))
    (proj / "bug.diff").write_text(diff)
    v = _check(proj, "--target", "src/alloc.py:BlockManager", "--patch", "bug.diff", "--report-dir", "out")
    assert v["invariant"] == "INDEX_CONSISTENT"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    r = _pytest(proj / v["repro"], elsewhere)
    assert r.returncode == 1 and "INDEX_CONSISTENT" in r.stdout, r.stdout[-3000:]
    r = _pytest(proj / v["repro"], elsewhere, KVSPEC_PATCH="none")  # the unpatched file: passes
    assert r.returncode == 0, r.stdout[-3000:]
