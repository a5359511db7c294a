"""Explicit copy-on-write (issue 31): a sequence allocator whose engine calls
``copy_on_write(seq_id, block_idx)`` before a write into a shared block (the protocol of
MiaoLu3/LLM-Engine's BlockManager, re-created in ``tests/data/allocators/cow_explicit*.py``)
gets that call before each write into a partial last block, with nothing declared; the fork
probe (``kvspec.alloc.cow``) reads the copies it returns. The correct one passes, the
planted leak of the copy's source is found as COPY_ON_WRITE."""
from __future__ import annotations

from pathlib import Path

from kvspec.alloc.shapes import infer
from kvspec.check.search import run_check
from kvspec.targets.registry import load_target

CORPUS = Path(__file__).resolve().parents[1] / "tests" / "data" / "allocators"


def _check(name: str, tmp_path, n: int):
    spec = f"{CORPUS / name}:ExplicitCowManager"
    return run_check(load_target(spec), spec, level="all", seed=0, max_examples=n, report_dir=str(tmp_path))


def test_the_mapping_calls_copy_on_write_and_asks_can_allocate_in_blocks():
    import importlib.util
    spec = importlib.util.spec_from_file_location("cow_explicit_t", CORPUS / "cow_explicit.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    amap = infer(mod.ExplicitCowManager)
    assert (amap.get("append_token"), amap.get("fork"), amap.get("copy_on_write")) == \
        ("allocate_token", "fork_sequence", "copy_on_write")
    assert amap.per_id.get("can_allocate_blocks")
    assert "copy_on_write(seq_id, block_idx)" in amap.describe(mod.ExplicitCowManager)


def test_a_correct_explicit_copy_on_write_allocator_passes(tmp_path, capsys):
    report = _check("cow_explicit.py", tmp_path, 40)
    capsys.readouterr()
    assert report.verdict == "pass", [v.violations[0].message for v in report.violations]


def test_a_copy_that_keeps_its_source_holder_is_found(tmp_path, capsys):
    assert "BUG:" in (CORPUS / "cow_explicit_leak.py").read_text().split('"""')[1]
    report = _check("cow_explicit_leak.py", tmp_path, 150)
    capsys.readouterr()
    assert report.verdict == "violation"
    first = report.violations[0]
    assert first.invariant == "COPY_ON_WRITE" and "not 1 as before the fork" in first.violations[0].message
