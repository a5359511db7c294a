"""Every fix diff kvspec proposes upstream is a real patch: each file in
``reports/upstream_fixes/`` and each ```diff block of ``reports/upstream-findings.md`` is a
unified diff with hunk ranges that ``patch --dry-run -p1`` applies, without fuzz or
offset, to the installed release it was written against (issue 21).

A diff names its files as ``a/<package>/...``, relative to the directory that holds the
package (site-packages); the package is found with importlib, without importing it.
Skipped, with the reason, where the package or ``patch`` is missing or another release
is installed (the diff then targets lines that may have moved)."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIXES = ROOT / "reports" / "upstream_fixes"
FINDINGS = ROOT / "reports" / "upstream-findings.md"

# top-level package -> (distribution, the release the diffs were made against)
RELEASES = {
    "nanovllm_voxcpm": ("nano-vllm-voxcpm", "2.0.5"),
    "nanovllmnpu": ("nano-vllm-npu", "0.0.2"),
    "nanovllm": ("nano-vllm-fork", "20260210"),
    "lmcache": ("lmcache", "0.5.6"),
    "sglang": ("sglang", "0.5.23"),
    "vllm": ("vllm", "0.33.0"),
}
HUNK = re.compile(r"^@@ -\d+(,\d+)? \+\d+(,\d+)? @@", re.M)
TARGET = re.compile(r"^\+\+\+ b/([^/\s]+)/\S+", re.M)


def _diff_blocks(md: str) -> list[str]:
    return [m.group(1) for m in re.finditer(r"```diff\n(.*?)```", md, re.S)]


def _cases() -> list:
    out = [pytest.param(p.read_text(), id=p.name) for p in sorted(FIXES.glob("*.diff"))]
    out += [pytest.param(d, id=f"upstream-findings.md#{i + 1}") for i, d in enumerate(_diff_blocks(FINDINGS.read_text()))]
    return out


def test_there_are_fix_diffs_to_check():
    assert len(list(FIXES.glob("*.diff"))) >= 5
    assert len(_diff_blocks(FINDINGS.read_text())) >= 3


def _package_root(package: str) -> Path:
    """The directory that holds ``package`` (site-packages), found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"{package} is not installed")
    return Path(list(spec.submodule_search_locations)[0]).parent


@pytest.mark.parametrize("diff", _cases())
def test_fix_diff_applies_to_the_installed_release(diff: str, tmp_path: Path):
    assert diff.startswith("--- a/"), "a unified diff starts with its --- a/ header"
    assert HUNK.search(diff), "no hunk header with line ranges (@@ -a,b +c,d @@): patch cannot apply it"
    packages = set(TARGET.findall(diff))
    assert len(packages) == 1, f"one package per diff, got {packages}"
    package = packages.pop()
    dist, version = RELEASES[package]
    root = _package_root(package)
    installed = importlib.metadata.version(dist)
    if installed != version:
        pytest.skip(f"the diff is for {dist} {version}; {installed} is installed")
    if shutil.which("patch") is None:
        pytest.skip("no `patch` program on PATH")
    (tmp_path / "fix.diff").write_text(diff)
    r = subprocess.run(["patch", "--dry-run", "-p1", "-d", str(root), "-i", str(tmp_path / "fix.diff")],
                       capture_output=True, text=True)
    assert r.returncode == 0, f"patch --dry-run failed:\n{r.stdout}{r.stderr}"
    # applies exactly where the diff says: no hunk moved (offset) or matched loosely (fuzz)
    assert "offset" not in r.stdout and "fuzz" not in r.stdout, r.stdout
