"""Copy-on-write allocators (issue 31): ``fork(parent, child)`` is mapped with nothing
declared and probed after each admission and step (``kvspec.alloc.cow``). The allocators
are this project's own (``tests/data/allocators/cow_*.py``): the correct one passes, each
planted bug (named ``BUG:`` in its docstring) is found as COPY_ON_WRITE within a bounded
number of examples."""
from __future__ import annotations

from pathlib import Path

import pytest

from kvspec.alloc.cow import copy_pairs
from kvspec.check.search import run_check
from kvspec.targets.registry import load_target

CORPUS = Path(__file__).resolve().parents[1] / "tests" / "data" / "allocators"


def _check(spec: str, tmp_path, n: int = 100):
    target = load_target(spec)
    return target, run_check(target, spec, level="all", seed=0, max_examples=n, report_dir=str(tmp_path))


def test_a_correct_copy_on_write_allocator_is_probed_and_passes(tmp_path, capsys):
    target, report = _check(f"{CORPUS / 'cow_fork.py'}:CowBlockManager", tmp_path)
    assert "fork <- CowBlockManager.fork(parent_id, child_id)" in capsys.readouterr().err  # the mapping shown
    assert report.verdict == "pass", [v.violations[0].message for v in report.violations]
    assert "CowBlockManager.fork" in target.traits.declaration


@pytest.mark.parametrize("name,cls,words", [
    ("cow_no_copy.py", "ForkingBlockManager", "no copy"),
    ("cow_copy_leak.py", "CowManager", "as before the fork"),
    ("cow_fork_no_incref.py", "ShareBlockManager", "the child holds it too"),
])
def test_a_planted_copy_on_write_bug_is_found(tmp_path, capsys, name, cls, words):
    assert "BUG:" in (CORPUS / name).read_text().split('"""')[1]
    _, report = _check(f"{CORPUS / name}:{cls}", tmp_path)
    capsys.readouterr()
    assert report.verdict == "violation"
    first = report.violations[0]
    assert first.invariant == "COPY_ON_WRITE" and words in first.violations[0].message


def test_copy_operations_are_read_in_the_shapes_allocators_return():
    assert copy_pairs(None) == []
    assert copy_pairs((3, 5)) == [(3, 5)]
    assert copy_pairs([(3, 5), (4, 6)]) == [(3, 5), (4, 6)]
    assert copy_pairs({3: [5, 6]}) == [(3, 5), (3, 6)]
    assert copy_pairs(True) is None  # not copies: only the tables speak
