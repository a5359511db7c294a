"""The allocator level (issue 31): allocators with an API of their own, checked with
nothing declared, their mapping shown, and a proposed declaration where kvspec cannot
infer one. The allocators are this project's own (``examples/free_list_allocator.py`` and
``tests/data/allocators``): a file whose docstring says ``BUG:`` carries the bug it names,
the others are correct, so each expected verdict is read off the file it checks."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvspec.check.search import run_check
from kvspec.errors import TargetError
from kvspec.targets.registry import load_target

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "tests" / "data" / "allocators"
EXAMPLE = ROOT / "examples" / "free_list_allocator.py"


def _check(target, tmp_path, n: int = 150, misuse: bool = False):
    return run_check(target, str(target.name), level="all", seed=0, max_examples=n, misuse=misuse,
                     report_dir=str(tmp_path))


def _manifest() -> list[tuple[Path, str]]:
    return [(CORPUS / f, c) for f, c in (line.split() for line in (CORPUS / "MANIFEST").read_text().splitlines()
                                         if line.strip())]


def _bug(path: Path) -> bool:
    doc = path.read_text().split('"""')[1]
    return "BUG:" in doc


def _misuse_only(path: Path) -> bool:
    return "--misuse" in path.read_text().split('"""')[1]


def test_the_example_free_list_passes_and_its_off_by_one_is_found(tmp_path, capsys):
    ok = load_target(f"{EXAMPLE}:FreeListAllocator")
    note = capsys.readouterr().err
    assert "free list allocator (inferred)" in note and "FreeListAllocator.allocate(n)" in note  # the mapping shown
    report = _check(ok, tmp_path)
    assert report.verdict == "pass" and "FreeListAllocator.free(ids)" in report.declaration
    bad = _check(load_target(f"{EXAMPLE}:EagerFreeListAllocator"), tmp_path, 100)
    assert bad.verdict == "violation" and bad.violations[0].invariant == "NO_CRASH"
    assert "allocate(1) returned None" in bad.violations[0].violations[0].message


def test_the_corpus_first_run_checks_80_percent_and_its_findings_are_the_named_bugs(tmp_path, capsys):
    """The acceptance measure: checked on the first run with nothing declared, and the
    share of first-run findings that are the bug the file names."""
    checked, refused, findings, real, missed = [], [], 0, 0, []
    for path, cls in _manifest():
        try:
            target = load_target(f"{path}:{cls}")
        except TargetError:
            refused.append(path.name)
            continue
        checked.append(path.name)
        report = _check(target, tmp_path / path.stem)
        if report.verdict == "violation":
            findings += 1
            real += _bug(path)
        elif _bug(path) and not _misuse_only(path):
            missed.append(path.name)
    capsys.readouterr()
    total = len(checked) + len(refused)
    assert len(checked) / total >= 0.8, refused
    assert findings and real / findings >= 0.9
    assert not missed, missed


def test_a_bug_only_a_misuse_shows_is_found_with_misuse(tmp_path):
    report = _check(load_target(f"{CORPUS / 'fl_double_free.py'}:NaiveAllocator"), tmp_path, 150, misuse=True)
    assert report.verdict == "violation" and report.violations[0].invariant == "ATOMIC_REJECT"


def _kvspec(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvspec", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600)


def test_odd_names_are_refused_with_a_proposal_that_works_once_pasted(tmp_path):
    project = tmp_path / "proj"
    project.mkdir()
    shutil.copy(CORPUS / "odd_names.py", project / "slab.py")
    (project / "pyproject.toml").write_text('[project]\nname = "slab"\nversion = "0"\n')
    args = ("check", "--target", "slab.py:Slab", "--max-examples", "60", "--seed", "0",
            "--report-dir", str(tmp_path / "r"))
    first = _kvspec(*args, cwd=project)
    assert first.returncode == 2
    errors = [line for line in first.stderr.splitlines() if line.startswith("kvspec: error:")]
    assert len(errors) == 1 and "has none of the APIs kvspec drives" in errors[0]
    lines = first.stderr.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("kvspec: proposed declaration"))
    proposal = [line[4:] for line in lines[start + 1:] if line.startswith("    ")]
    assert proposal[0] == "[tool.kvspec.alloc]" and 'allocate = "grab"' in "\n".join(proposal)
    with open(project / "pyproject.toml", "a") as f:
        f.write("\n".join(proposal) + "\n")  # the one paste
    second = _kvspec(*args, cwd=project)
    assert second.returncode == 0, second.stderr[-2000:]
    assert re.search(r"declaration: allocator API free list allocator \(\[tool\.kvspec\.alloc\] in .*pyproject",
                     second.stdout)


def test_a_declared_call_that_does_not_fit_the_signature_is_one_line(tmp_path):
    (tmp_path / "pyproject.toml").write_text('[tool.kvspec.alloc]\nshape = "free_list"\nallocate = "grab"\n'
                                             'free = "put_back"\n')
    f = tmp_path / "slab.py"
    f.write_text((CORPUS / "odd_names.py").read_text().replace("def grab(self, count: int)",
                                                               "def grab(self, count: int, owner)"))
    with pytest.raises(TargetError, match=r"Slab\.grab\(self, count: int, owner\) cannot be called as grab\(n: int\)"):
        load_target(f"{f}:Slab")


def test_kvspec_api_documents_the_allocator_level():
    out = _kvspec("api", "allocator", cwd=ROOT)
    assert out.returncode == 0
    assert "allocate_sequence(seq_id: int, n_tokens: int)" in out.stdout and "[tool.kvspec.alloc]" in out.stdout


def test_a_patch_applies_to_an_allocator_of_its_own(tmp_path):
    line = "        if n < 0 or n >= len(self.free_ids):  # BUG: >= refuses n == the free count\n"
    assert line in EXAMPLE.read_text()
    diff = tmp_path / "fix.diff"
    start = EXAMPLE.read_text().splitlines(keepends=True).index(line) + 1
    diff.write_text(f"--- a/{EXAMPLE.name}\n+++ b/{EXAMPLE.name}\n@@ -{start},1 +{start},1 @@\n-{line}"
                    f"+{line.replace('>=', '>')}")
    target = load_target(f"{EXAMPLE}:EagerFreeListAllocator", patch=str(diff))
    assert _check(target, tmp_path, 60).verdict == "pass"


def test_a_class_attribute_declaration_and_api_allocator(tmp_path, capsys):
    src = (CORPUS / "odd_names.py").read_text().replace(
        "class Slab:\n", "class Slab:\n    kvspec_alloc = {\"shape\": \"free_list\", \"allocate\": \"grab\", "
                         "\"free\": \"put_back\", \"num_free\": \"spare\"}\n\n")
    f = tmp_path / "slab.py"
    f.write_text(src)
    t = load_target(f"{f}:Slab")
    assert "Slab.kvspec_alloc" in t.traits.declaration and "Slab.grab(n)" in t.traits.declaration
    assert _check(t, tmp_path, 60).verdict == "pass"
    # --api allocator on a class that also fits no other API: the same inferred mapping
    t2 = load_target(f"{CORPUS / 'seq_table.py'}:SequenceBlockAllocator", api="allocator")
    assert "allocate_sequence(seq_id, n_tokens)" in t2.traits.declaration


def test_a_nano_manager_with_odd_names_gets_a_names_proposal_that_works_once_pasted(tmp_path):
    from tests.test_nano_variants import BASE
    project = tmp_path / "proj"
    project.mkdir()
    src = BASE
    for old, new in (("can_allocate", "has_room_for"), ("allocate", "admit"), ("deallocate", "evict"),
                     ("can_append", "can_grow"), ("may_append", "grow")):
        src = src.replace(f"def {old}(self, seq):", f"def {new}(self, seq):")
    (project / "mgr.py").write_text(src)
    (project / "pyproject.toml").write_text('[project]\nname = "mgr"\nversion = "0"\n')
    args = ("check", "--target", "mgr.py:BlockManager", "--max-examples", "40", "--seed", "0",
            "--report-dir", str(tmp_path / "r"))
    first = _kvspec(*args, cwd=project)
    assert first.returncode == 2 and "(kvspec api nanovllm)" in first.stderr
    lines = first.stderr.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("kvspec: proposed declaration"))
    proposal = [line[4:] for line in lines[start + 1:] if line.startswith("    ")]
    assert proposal[0] == "[tool.kvspec.names]" and 'may_append = "grow"' in proposal[-1]
    with open(project / "pyproject.toml", "a") as f:
        f.write("\n".join(proposal) + "\n")
    second = _kvspec(*args, cwd=project)
    assert second.returncode == 0, second.stderr[-2000:]
