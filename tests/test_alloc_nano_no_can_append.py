"""A nano-vllm-shaped manager without can_append (issue 31, RichardHuang2006/Mini-vLLM's
shape, re-created in ``tests/data/allocators/nano_pool_fork*.py``): ``can_allocate(seq,
num_tokens=None)`` / ``allocate(seq, num_tokens=None)`` with decode as a one-token chunk,
its state in a pool it owns, its own Sequence (prompt and output apart), and
``fork(parent, child)`` probed for copy-on-write. Loads with nothing declared; the correct
one passes, the planted missing copy is found as COPY_ON_WRITE."""
from __future__ import annotations

import importlib.util
from pathlib import Path

from kvspec.check.search import run_check
from kvspec.targets.nano_api import CHUNKED, chunked_by_default, detect_nano_api
from kvspec.targets.nano_sequence import split_sequence
from kvspec.targets.registry import load_target

CORPUS = Path(__file__).resolve().parents[1] / "tests" / "data" / "allocators"


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name.replace(".", "_"), CORPUS / name)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _check(name: str, tmp_path, n: int):
    spec = f"{CORPUS / name}:PoolBlockManager"
    target = load_target(spec)
    return target, run_check(target, spec, level="all", seed=0, max_examples=n, report_dir=str(tmp_path))


def test_the_shape_is_read_as_the_chunked_generation_with_its_sequence_adapted():
    mod = _module("nano_pool_fork.py")
    assert chunked_by_default(mod.PoolBlockManager) and detect_nano_api(mod.PoolBlockManager) == CHUNKED
    seq_cls = split_sequence(mod.Sequence)
    s = seq_cls(prompt_token_ids=[1, 2, 3])
    s.append_token(9)
    s.num_cached_tokens = 4  # kvspec's name for its num_computed_tokens
    assert (len(s), s.num_computed_tokens, s.output_token_ids) == (4, 4, [9])
    s.pop_token()
    assert s.output_token_ids == []


def test_a_manager_without_can_append_loads_with_nothing_declared_and_passes(tmp_path, capsys):
    target, report = _check("nano_pool_fork.py", tmp_path, 40)
    capsys.readouterr()
    assert getattr(target.manager_cls, "kvspec_pool_field", None) == "pool"  # observed through its pool
    assert report.verdict == "pass", [v.violations[0].message for v in report.violations]


def test_its_missing_copy_on_write_is_found(tmp_path, capsys):
    assert "BUG:" in (CORPUS / "nano_pool_fork_no_copy.py").read_text().split('"""')[1]
    _, report = _check("nano_pool_fork_no_copy.py", tmp_path, 150)
    capsys.readouterr()
    assert report.verdict == "violation"
    first = report.violations[0]
    assert first.invariant == "COPY_ON_WRITE" and "no copy" in first.violations[0].message
