"""Radix / trie prefix caches (issue 31): a class with ``match_prefix``, ``insert``,
``evict`` and a way to unlock a match is driven at the cache level over a free list kvspec
supplies, with nothing declared (``kvspec.alloc.radix``). The caches are this project's own
(``tests/data/allocators/radix_*.py``): the correct one passes, each planted bug (named
``BUG:`` in its docstring) is found within a bounded number of examples, as one of the
symptoms ``radix_expected.json`` lists for it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvspec.alloc.radix import find_walk, infer_radix, parse_match
from kvspec.check.search import run_check
from kvspec.targets.registry import load_target

CORPUS = Path(__file__).resolve().parents[1] / "tests" / "data" / "allocators"
EXPECTED = json.loads((CORPUS / "radix_expected.json").read_text())


def _check(name: str, tmp_path, n: int = 40):
    spec = f"{CORPUS / name}:PrefixTree"
    target = load_target(spec)
    return target, run_check(target, spec, level="all", seed=0, max_examples=n, report_dir=str(tmp_path))


def test_a_correct_radix_cache_is_driven_with_nothing_declared_and_passes(tmp_path, capsys):
    target, report = _check("radix_tree.py", tmp_path)
    err = capsys.readouterr().err
    assert "radix prefix cache (inferred)" in err and "lock <- PrefixTree.inc_lock_ref(node)" in err  # shown
    assert target.traits.levels == ("cache",)
    assert report.verdict == "pass", [v.violations[0].message for v in report.violations]


@pytest.mark.parametrize("name", ["radix_evict_locked.py", "radix_match_divergence.py", "radix_evictable_double.py"])
def test_a_planted_radix_cache_bug_is_found(tmp_path, capsys, name):
    assert "BUG:" in (CORPUS / name).read_text().split('"""')[1]
    _, report = _check(name, tmp_path, n=150)
    capsys.readouterr()
    assert report.verdict == "violation"
    assert report.violations[0].invariant in EXPECTED[name], report.violations[0].invariant


def test_radix_roles_and_match_results_are_read_from_the_class():
    import importlib.util
    spec = importlib.util.spec_from_file_location("radix_tree_t", CORPUS / "radix_tree.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    m = infer_radix(mod.PrefixTree)
    assert (m["match"], m["insert"], m["evict"], m["lock"], m["unlock"], m["evictable"]) == \
        ("match_prefix", "insert", "evict", "inc_lock_ref", "dec_lock_ref", "evictable_size")
    assert find_walk(mod.PrefixTree()) == {"root": "root", "key": "key", "value": "value", "lock": "lock_ref"}
    assert parse_match((2, [4, 5, 6])) == ([4, 5], None)
    assert parse_match(([4, 5], "node")) == ([4, 5], "node")
    assert infer_radix(type("NotATree", (), {"insert": lambda self, k, v: None})) is None


def test_a_trie_without_a_way_to_unlock_is_refused_in_one_line(tmp_path):
    from kvspec.targets.base import TargetError
    f = tmp_path / "nounlock.py"
    f.write_text("class T:\n    def match_prefix(self, key):\n        return []\n"
                 "    def insert(self, key, values):\n        pass\n    def evict(self, n):\n        return []\n")
    with pytest.raises(TargetError) as e:
        load_target(f"{f}:T")
    assert "\n" not in str(e.value) and "a way to unlock a match" in str(e.value)
