"""Allocators of the shapes public repositories use (issue 31, second wave), as this
project's own re-creations in ``tests/data/allocators``: ref-counted pools freeing by
decref, allocators owning their KV tensors (built small, on the CPU), page objects,
sequence allocators without decode growth. Each loads with nothing declared and shows
the mapping it is driven by; KV_INTEGRITY on the tensors an allocator owns finds a write
into a held block (files named ``BUG:``), bounded by --max-examples."""
from __future__ import annotations

from pathlib import Path

import pytest

from kvspec.check.search import run_check
from kvspec.targets.registry import load_target

CORPUS = Path(__file__).resolve().parents[1] / "tests" / "data" / "allocators"


@pytest.mark.parametrize("name,cls,shown", [
    ("fl_refpool_decref.py", "RefPool", ("RefPool.allocate_many(n)", "RefPool.decref_many(ids)",
                                         "Touch(ids) -> RefPool.incref(id) per id")),
    ("fl_kv_tensors.py", "PagedKVStore", ("PagedKVStore.free(id) per id", "device='cpu'", "num_heads=1",
                                          "KV tensors <- PagedKVStore.k_cache, PagedKVStore.v_cache")),
    ("pg_page_objects.py", "PageCache", ("PageCache.allocate_page() x n", "PageCache.free_page(id) per id")),
    ("seq_no_append.py", "PrefillBlockManager", ("Step: none", "PrefillBlockManager.allocated_blocks[seq_id]")),
])
def test_the_shape_loads_with_nothing_declared_and_its_mapping_is_shown(capsys, name, cls, shown):
    load_target(f"{CORPUS / name}:{cls}")
    note = capsys.readouterr().err
    for words in shown:
        assert words in note, note


def _check(spec: str, tmp_path, n: int = 150):
    target = load_target(spec)
    return run_check(target, spec, level="all", seed=0, max_examples=n, report_dir=str(tmp_path))


@pytest.mark.parametrize("name,cls", [("fl_kv_tensors.py", "PagedKVStore"), ("seq_kv_owner.py", "SeqKVCache")])
def test_an_allocator_owning_correct_kv_tensors_passes(tmp_path, capsys, name, cls):
    report = _check(f"{CORPUS / name}:{cls}", tmp_path)
    capsys.readouterr()
    assert report.verdict == "pass", [v.violations[0].message for v in report.violations]


@pytest.mark.parametrize("name,cls", [("fl_kv_tensors_clear.py", "ClearingKVStore"),
                                      ("seq_kv_owner_clear.py", "DecodeKVCache")])
def test_a_write_into_a_held_block_of_the_owned_tensors_is_kv_integrity(tmp_path, capsys, name, cls):
    assert "BUG:" in (CORPUS / name).read_text().split('"""')[1]
    report = _check(f"{CORPUS / name}:{cls}", tmp_path)
    capsys.readouterr()
    assert report.verdict == "violation"
    first = report.violations[0]
    assert first.invariant == "KV_INTEGRITY" and "wrote into a block someone holds" in first.violations[0].message
