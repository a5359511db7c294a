"""Managers of shapes found in the field study load without a shim (issue 20: "at least 90%
of the nano-vllm-derived and v1-style managers load"), and a bug planted in each is found.

The packages are this project's own code (tests/data/field_loading, see its README), one
per shape that kvspec used to refuse:

- nanolayout: the v1-style generation whose scheduler counts the tokens
  (``get_token_layout(seq)``, ``can_allocate(num_tokens)``, ``can_append(seq, n)``,
  ``allocate``/``may_append`` reading ``seq.num_new_tokens``): kvspec makes those calls;
- nanoglobal: a Sequence that reads the package's global config, which its engine sets
  with ``init_config(model)`` first: kvspec sets it as that would, without a model;
- nanopaged: a page size tied to the block size (the manager asserts the tie) and a
  scheduler hook the cache level does not make: the engine level keeps the tie at the
  run's block size.

Each is run as a first-time user runs kvspec: ``kvspec check --target FILE:BlockManager``
from the package's parent folder, nothing declared beyond what the manager states; a
planted bug is a textual edit of a copy, searched for with a bounded ``--max-examples``.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvspec.engine.nano_load import tied_sizes
from kvspec.targets.nano_api import LAYOUT, NANO_CALLS, counts_tokens, free_tiers, tier_ids

DATA = Path(__file__).parent / "data" / "field_loading"


def _kvspec(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-m", "kvspec", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


def _check(root: Path, package: str, n: int, *extra: str) -> tuple[subprocess.CompletedProcess, dict]:
    r = _kvspec(root, "check", "--target", f"{package}/engine/block_manager.py:BlockManager", "--max-examples",
                str(n), "--seed", "0", "--json", "--report-dir", str(root / "reports"), *extra)
    assert r.returncode in (0, 1), r.stdout + r.stderr  # loaded: a verdict, not a refusal (exit 2)
    return r, json.loads(r.stdout)


def _planted(tmp_path: Path, package: str, old: str, new: str) -> Path:
    shutil.copytree(DATA / package, tmp_path / package)
    f = tmp_path / package / "engine" / "block_manager.py"
    text = f.read_text()
    assert text.count(old) == 1, old
    f.write_text(text.replace(old, new))
    return tmp_path


# -- the v1-style generation: the scheduler counts tokens -----------------------------------------
def test_the_layout_generation_is_detected_from_its_signatures():
    from kvspec.targets.registry import load_target
    t = load_target(f"{DATA / 'nanolayout' / 'engine' / 'block_manager.py'}:BlockManager")
    assert t.api == LAYOUT
    assert counts_tokens(t.manager_cls.can_allocate) and not counts_tokens(t.manager_cls.allocate)


class _Shapes:
    def unannotated_count(self, num_tokens): ...
    def unannotated_seq(self, seq): ...
    def annotated_seq(self, seq: "Sequence"): ...  # noqa: F821
    def annotated_count(self, n: int): ...


def test_a_token_count_parameter_is_told_from_a_sequence():
    assert counts_tokens(_Shapes.unannotated_count) and counts_tokens(_Shapes.annotated_count)
    assert not counts_tokens(_Shapes.unannotated_seq) and not counts_tokens(_Shapes.annotated_seq)


def test_the_call_table_has_the_layout_generation():
    calls = {c.method: c for c in NANO_CALLS[LAYOUT]}
    assert calls["can_allocate"].args == ("num_tokens",)
    assert calls["get_token_layout"].args == ("seq",) and calls["can_append"].args == ("seq", "num_new_tokens")


def test_a_layout_manager_loads_and_passes(tmp_path):
    shutil.copytree(DATA / "nanolayout", tmp_path / "nanolayout")
    r, report = _check(tmp_path, "nanolayout", 100)
    assert report["verdict"] == "pass" and report["levels"] == ["cache"], r.stdout + r.stderr
    assert report["examples"] >= 100


def test_a_bug_planted_in_a_layout_manager_is_found(tmp_path):
    # the hash of a block filled after the first one no longer chains its parent's
    root = _planted(tmp_path, "nanolayout", "chain(prev if i > 0 else NONE, blk.token_ids)",
                    "chain(NONE, blk.token_ids)")
    _, report = _check(root, "nanolayout", 300)
    assert report["verdict"] == "violation"
    assert report["violations"][0]["invariant"] == "HASH_CHAIN"


def test_a_layout_manager_through_its_own_scheduler(tmp_path):
    shutil.copytree(DATA / "nanolayout", tmp_path / "nanolayout")
    r, report = _check(tmp_path, "nanolayout", 60, "--level", "engine")
    assert report["verdict"] == "pass" and report["levels"] == ["engine"], r.stdout + r.stderr


def test_a_token_count_admission_without_a_layout_is_one_line(tmp_path):
    root = _planted(tmp_path, "nanolayout", "    def get_token_layout(self, seq):", "    def token_layout(self, seq):")
    r = _kvspec(root, "check", "--target", "nanolayout/engine/block_manager.py:BlockManager", "--max-examples", "20",
                "--report-dir", str(root / "reports"))
    assert r.returncode == 2, r.stdout + r.stderr
    errors = [ln for ln in r.stderr.splitlines() if "error" in ln]
    assert len(errors) == 1 and "get_token_layout(seq)" in errors[0] and "Traceback" not in r.stderr
    assert not (root / "reports").exists() or not list((root / "reports").rglob("*repro*"))


def test_a_layout_manager_whose_can_append_takes_no_count_is_one_line(tmp_path):
    root = _planted(tmp_path, "nanolayout", "    def can_append(self, seq, num_new_tokens: int) -> bool:\n"
                                            "        end = seq.num_cached_tokens + num_new_tokens",
                    "    def can_append(self, seq) -> bool:\n        end = len(seq)")
    r = _kvspec(root, "check", "--target", "nanolayout/engine/block_manager.py:BlockManager", "--max-examples", "20")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "can_append(seq: Sequence, num_new_tokens: int)" in r.stderr and "NO_CRASH" not in r.stdout


# -- a second free pool, as the manager counts it -------------------------------------------------
class _TwoTier:
    def __init__(self):
        self.free_block_ids = [3]
        self.cached_blocks = {1 << 40: 1, 1 << 41: 0}

    def num_free(self):
        return len(self.free_block_ids) + len(self.cached_blocks)

    def check(self):
        assert len(self.free_block_ids) + len(self.used_block_ids) <= 8  # a total: no free pool


def test_free_tiers_are_read_from_how_the_manager_counts_free_blocks():
    assert free_tiers(_TwoTier, "free_block_ids") == ("cached_blocks",)
    assert tier_ids(_TwoTier().cached_blocks, 4) == [1, 0]  # hash -> block id: the ids, in LRU order


# -- a Sequence that reads the package's global config ----------------------------------------------
def test_a_sequence_reading_a_global_config_loads_with_a_note(tmp_path):
    shutil.copytree(DATA / "nanoglobal", tmp_path / "nanoglobal")
    r, report = _check(tmp_path, "nanoglobal", 100)
    assert report["verdict"] == "pass", r.stdout + r.stderr
    assert "nanoglobal.config._config" in r.stderr and "init_config" in r.stderr  # the note says what was set


def test_a_bug_planted_behind_a_global_config_is_found(tmp_path):
    root = _planted(tmp_path, "nanoglobal",
                    "prev = self.blocks[seq.block_table[-2]].hash if len(seq.block_table) > 1 else NONE",
                    "prev = NONE")
    _, report = _check(root, "nanoglobal", 300)
    assert report["verdict"] == "violation" and report["violations"][0]["invariant"] == "HASH_CHAIN"


# -- a page size tied to the block size, at the engine level ------------------------------------------
def test_tied_sizes_keep_the_packages_ratio_as_far_as_the_block_size_allows():
    defaults = {"kvcache_block_size": 256, "page_size": 32, "max_num_seqs": 4}
    for run, page in ((2, 1), (4, 1), (8, 1), (16, 2), (256, 32)):
        cfg = {"kvcache_block_size": run, "page_size": 32, "max_num_seqs": 4}
        assert tied_sizes(cfg, defaults, {"kvcache_block_size": run}) == {"page_size": page}
    assert tied_sizes({"kvcache_block_size": 4, "max_num_seqs": 4}, defaults, {"kvcache_block_size": 4}) == {}


def test_a_tied_page_size_package_loads_at_the_engine_level(tmp_path):
    shutil.copytree(DATA / "nanopaged", tmp_path / "nanopaged")
    r, report = _check(tmp_path, "nanopaged", 60)
    assert report["levels"] == ["engine"] and "note_pages" in r.stderr  # its scheduler's hook: the engine level
    assert report["verdict"] == "pass", r.stdout + r.stderr


def test_a_bug_planted_in_a_tied_page_size_package_is_found(tmp_path):
    root = _planted(tmp_path, "nanopaged", "                else:\n                    b.ref_count += 1\n",
                    "                else:\n                    pass\n")
    _, report = _check(root, "nanopaged", 300)
    assert report["verdict"] == "violation" and report["violations"][0]["invariant"] == "ACCOUNTING"


_CONFIG_MODULE = '''
class Config:
    def __init__(self, block_size=256):
        self.block_size = block_size

_current = None

def setup(block_size=256):
    global _current
    _current = Config(block_size)

def current():
    if _current is None:
        raise RuntimeError("call setup() first")
    return _current
'''

_SEQUENCE_MODULE = '''
from kvspec_test_field_cfg import current

class Sequence:
    def __init__(self, token_ids):
        self.block_size = current().block_size
        self.token_ids = list(token_ids)
'''


def test_an_initializer_without_required_arguments_is_called_with_the_block_size(monkeypatch, capsys):
    import types

    from kvspec.targets.nano_sequence import sequence_factory
    mods = {}
    for name, src in (("kvspec_test_field_cfg", _CONFIG_MODULE), ("kvspec_test_field_seq", _SEQUENCE_MODULE)):
        mods[name] = types.ModuleType(name)
        monkeypatch.setitem(sys.modules, name, mods[name])
        exec(compile(src, f"<{name}>", "exec"), mods[name].__dict__)
    seq = sequence_factory(mods["kvspec_test_field_seq"].Sequence)([1, 2, 3], 4, 1)
    assert seq.block_size == 4 and mods["kvspec_test_field_cfg"]._current.block_size == 4
    assert "called kvspec_test_field_cfg.setup()" in capsys.readouterr().err
