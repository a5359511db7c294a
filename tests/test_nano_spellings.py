"""nano-vllm variants that load with nothing declared (issue 31, part 4): the decode call
spelled ``append`` (MinivLLM's BlockManager) or ``append_slot``, a constructor that takes a
config object, an incremental-prefill manager (``can_allocate_prefill`` /
``ensure_blocks_for_prefill``) and ``allocate_blocks`` / ``free_blocks`` names.

Each manager is ``test_nano_variants.BASE`` (this project's own correct manager) with one
textual edit, so each test differs from a manager kvspec already drives in exactly the
spelling under test; a buggy edit shows that findings still come through."""
from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from kvspec.check.search import run_check
from kvspec.targets.registry import load_target
from tests.test_nano_variants import BASE, _chunked_src


def _write(tmp_path: Path, name: str, text: str) -> Path:
    f = tmp_path / f"{name}.py"
    f.write_text(textwrap.dedent(text))
    return f


def _check(target, tmp_path, n: int = 120):
    return run_check(target, "variant", level="cache", seed=0, max_examples=n, report_dir=str(tmp_path))


@pytest.mark.parametrize("decode", ["append", "append_slot"])
def test_a_decode_call_spelled_append_or_append_slot_loads_and_passes(tmp_path, capsys, decode):
    f = _write(tmp_path, f"m_{decode}", BASE.replace("def may_append(self, seq):", f"def {decode}(self, seq):"))
    t = load_target(f"{f}:BlockManager")
    assert t.names.resolve(t.manager_cls, "may_append") == decode
    assert f"BlockManager.{decode} is read as kvspec's 'may_append'" in capsys.readouterr().err  # the mapping shown
    assert _check(t, tmp_path).verdict == "pass"


def test_a_minivllm_shaped_leak_in_append_is_found(tmp_path):
    # append takes a new block without marking it held (ref_count stays 0): the block is
    # handed out while counted free.
    buggy = BASE.replace("def may_append(self, seq):", "def append(self, seq):").replace(
        "            table.append(self._take())",
        "            table.append(self._take()); self.blocks[table[-1]].ref_count = 0")
    f = _write(tmp_path, "m_append_bug", buggy)
    report = _check(load_target(f"{f}:BlockManager"), tmp_path, 200)
    assert report.verdict == "violation"


CONFIG_CTOR = '''
from dataclasses import dataclass


@dataclass
class Config:
    model: str = ""
    max_num_seqs: int = 16
    kvcache_block_size: int = 256
    num_kvcache_blocks: int = -1
    enable_prefix_caching: bool = True

    def __post_init__(self):
        assert self.model, "a model path is needed"  # the engine's own check: never run by kvspec
'''


def test_a_constructor_taking_a_config_object_is_built_from_the_packages_config(tmp_path):
    src = CONFIG_CTOR + BASE.replace(
        "def __init__(self, num_blocks, block_size):\n        self.block_size = block_size",
        "def __init__(self, config: Config):\n        num_blocks = config.num_kvcache_blocks\n"
        "        block_size = config.kvcache_block_size\n        self.block_size = block_size")
    f = _write(tmp_path, "m_config", src)
    t = load_target(f"{f}:BlockManager")
    from kvspec.spec.config import Config as RunConfig
    d = t.driver(RunConfig(level="cache", num_blocks=6, block_size=2))
    assert len(d.mgr.blocks) == 6 and d.mgr.block_size == 2
    assert _check(t, tmp_path).verdict == "pass"


def test_an_incremental_prefill_manager_is_driven_as_the_chunked_generation(tmp_path):
    src = _chunked_src().replace("def can_allocate(self, seq, num_tokens):",
                                 "def can_allocate_prefill(self, seq, num_tokens):").replace(
        "def allocate(self, seq, num_tokens):", "def ensure_blocks_for_prefill(self, seq, num_tokens):")
    f = _write(tmp_path, "m_incremental", src)
    t = load_target(f"{f}:BlockManager")
    assert t.api == "chunked"
    assert t.names.resolve(t.manager_cls, "allocate") == "ensure_blocks_for_prefill"
    assert _check(t, tmp_path).verdict == "pass"


def test_allocate_blocks_and_free_blocks_names_load(tmp_path):
    src = BASE.replace("def allocate(self, seq):", "def allocate_blocks(self, seq):").replace(
        "def deallocate(self, seq):", "def free_blocks(self, seq):")
    f = _write(tmp_path, "m_blocks_names", src)
    t = load_target(f"{f}:BlockManager")
    assert t.names.resolve(t.manager_cls, "deallocate") == "free_blocks"
    assert _check(t, tmp_path).verdict == "pass"
