"""Adapting kvspec to a manager without forking it (issue 20, item 5): a declared name map
(``kvspec_names`` / ``[tool.kvspec.names]``) and conservative aliases, the observation
hook ``kvspec_observe``, and free lists other than a plain deque (an OrderedDict, a lazily
cleaned deque whose truth is a set, a v1-style BlockPool whose free list is a deque).

Every manager is this project's own code: ``test_nano_variants.BASE`` edited textually,
one variant per test, so each differs from a correct manager in exactly its variant."""
from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from kvspec.check.search import run_check
from kvspec.check.session import Session
from kvspec.errors import TargetError, UsageError
from kvspec.spec.config import Config
from kvspec.spec.ops import Admit, Finish, Step
from kvspec.targets.names import Names, read_free_list, read_names
from kvspec.targets.registry import load_target
from test_nano_variants import BASE  # noqa: E402  (the base manager)


def _write(tmp_path: Path, name: str, text: str) -> Path:
    f = tmp_path / f"{name}.py"
    f.write_text(textwrap.dedent(text))
    return f


def _check(target, tmp_path, n: int = 120, level: str = "cache"):
    return run_check(target, "names", level=level, seed=0, max_examples=n, report_dir=str(tmp_path))


def _declare(src: str, decl: str) -> str:
    return src.replace("class BlockManager:\n", f"class BlockManager:\n    {decl}\n\n", 1)


# -- the name map and aliases ---------------------------------------------------------------
RENAMED = re.sub(r"\.hash\b", ".hash_value", BASE.replace("self.hash_to_block_id", "self._hash_to_block_id")
                 .replace("self.free_block_ids", "self.free_list"))


def test_private_and_renamed_fields_by_declaration_and_alias(tmp_path, capsys):
    assert "self._hash_to_block_id" in RENAMED and "blk.hash_value" in RENAMED
    with pytest.raises(TargetError, match="free_block_ids"):  # free_list is no obvious alias: refused
        load_target(f"{_write(tmp_path, 'undeclared', RENAMED)}:BlockManager")
    f = _write(tmp_path, "declared", _declare(RENAMED, 'kvspec_names = {"free_block_ids": "free_list"}'))
    t = load_target(f"{f}:BlockManager")
    err = capsys.readouterr().err
    assert "BlockManager._hash_to_block_id is read as kvspec's 'hash_to_block_id'" in err
    assert "Block.hash_value is read as kvspec's 'hash'" in err
    assert _check(t, tmp_path).verdict == "pass"


def test_a_name_map_in_pyproject(tmp_path):
    f = _write(tmp_path, "pyproj", RENAMED)
    (tmp_path / "pyproject.toml").write_text('[tool.kvspec.names]\nfree_block_ids = "free_list"\n'
                                             '"Block.hash" = "hash_value"\n')
    t = load_target(f"{f}:BlockManager")
    assert t.names.declared == {"free_block_ids": "free_list", "hash": "hash_value"}
    s = Session(t, Config(level="cache", num_blocks=4, block_size=2))
    assert s.apply(Admit("r1", (1, 2, 3))) == [] and s.obs.queue == (2, 3)


def test_two_candidates_are_never_guessed(tmp_path):
    two = BASE.replace("        self.hash = -1\n", "        self.hash = -1\n        self.block_hash = -1\n")
    two = re.sub(r"\.hash\b", ".hash_value", two)
    f = _write(tmp_path, "two", two)
    with pytest.raises(UsageError, match="several candidates .*hash_value, block_hash"):
        load_target(f"{f}:BlockManager")
    f = _write(tmp_path, "two_declared", _declare(two, 'kvspec_names = {"Block.hash": "hash_value"}'))
    assert _check(load_target(f"{f}:BlockManager"), tmp_path, 60).verdict == "pass"


def test_declaration_mistakes_are_one_line_usage_errors(tmp_path):
    class M:
        kvspec_names = {"hash_to_blocks": "x"}
    with pytest.raises(UsageError, match="unknown name 'hash_to_blocks'"):
        read_names(M)
    M.kvspec_names = {"hash": 3}
    with pytest.raises(UsageError, match="must name an attribute"):
        read_names(M)
    n = Names({"hash": "nope"}, "M.kvspec_names")
    with pytest.raises(UsageError, match="has no 'nope'"):
        n.resolve(M, "hash")


# -- the observation hook --------------------------------------------------------------------
HOOKED = BASE.replace("self.free_block_ids", "self.free_slots").replace("self.hash_to_block_id", "self.table")
HOOK = '''
    def kvspec_observe(self):
        return {"blocks": [(b.ref_count, b.hash if b.hash != -1 else None, b.token_ids) for b in self.blocks],
                "free": list(self.free_slots), "index": dict(self.table)}
'''


def test_the_observation_hook_replaces_reading_the_internals(tmp_path):
    with pytest.raises(TargetError, match="kvspec_observe"):
        load_target(f"{_write(tmp_path, 'unhooked', HOOKED)}:BlockManager")
    src = HOOKED.replace("    def deallocate", HOOK.lstrip("\n") + "\n    def deallocate")
    t = load_target(f"{_write(tmp_path, 'hooked', src)}:BlockManager")
    assert _check(t, tmp_path).verdict == "pass"
    # a hook that leaves a free block out of the queue (its order is the allocator's own choice)
    bad = src.replace('"free": list(self.free_slots)', '"free": list(self.free_slots)[1:]')
    assert _check(load_target(f"{_write(tmp_path, 'hooked_bad', bad)}:BlockManager"), tmp_path).verdict == "violation"


# -- free lists other than a deque -----------------------------------------------------------
ORDERED = BASE.replace("from collections import deque", '''from collections import OrderedDict


class FreeIds(OrderedDict):
    """Free block ids in an OrderedDict (keys), next reused first."""

    def popleft(self):
        return self.popitem(last=False)[0]

    def remove(self, b):
        del self[b]

    def append(self, b):
        self[b] = None''').replace("deque(range(num_blocks))", "FreeIds.fromkeys(range(num_blocks))")

# Lazy: a revived block's entry stays in the deque as a tombstone (popping skips it); the
# set holds the truth; a re-freed block's tombstone is dropped so the deque stays LRU.
LAZY = (BASE.replace("        self.used_block_ids = set()\n",
                     "        self.used_block_ids = set()\n        self.FREESET = set(range(num_blocks))\n"
                     "        self.stale = set()\n")
        .replace("        b = self.free_block_ids.popleft()\n",
                 "        b = self.free_block_ids.popleft()\n        while b not in self.FREESET:\n"
                 "            self.stale.discard(b)\n            b = self.free_block_ids.popleft()\n"
                 "        self.FREESET.discard(b)\n")
        .replace("            self.free_block_ids.remove(b)\n",
                 "            self.FREESET.discard(b)\n            self.stale.add(b)\n")
        .replace("                self.free_block_ids.append(b)\n",
                 "                if b in self.stale:\n                    self.free_block_ids.remove(b)\n"
                 "                    self.stale.discard(b)\n"
                 "                self.free_block_ids.append(b)\n                self.FREESET.add(b)\n")
        .replace("len(self.free_block_ids)", "len(self.FREESET)"))


def test_an_ordered_dict_free_list(tmp_path):
    t = load_target(f"{_write(tmp_path, 'ordered', ORDERED)}:BlockManager")
    assert _check(t, tmp_path).verdict == "pass"


def test_a_lazily_cleaned_deque_is_read_through_its_companion_set(tmp_path):
    src = LAZY.replace("FREESET", "free_block_ids_set")
    t = load_target(f"{_write(tmp_path, 'lazy', src)}:BlockManager")
    s = Session(t, Config(level="cache", num_blocks=5, block_size=2))
    for op in (Admit("r1", (1, 2, 3)), Finish("r1"), Admit("r2", (1, 2, 5))):  # r2 revives block 0
        assert s.apply(op) == []
    assert list(s.driver.mgr.free_block_ids)[-1] == 0 and 0 not in s.obs.queue  # a tombstone, skipped
    assert _check(t, tmp_path, 150).verdict == "pass"
    # The same manager with its set under a name kvspec does not guess: a false I1, until declared.
    odd = LAZY.replace("FREESET", "truth")
    assert _check(load_target(f"{_write(tmp_path, 'lazy_odd', odd)}:BlockManager"), tmp_path, 150).verdict \
        == "violation"
    declared = _declare(odd, 'kvspec_names = {"free_block_set": "truth"}')
    assert _check(load_target(f"{_write(tmp_path, 'lazy_decl', declared)}:BlockManager"), tmp_path, 150).verdict \
        == "pass"
    # A private set whose name says "free" (``_free_set``, as a public manager spells it) is the one candidate.
    private = LAZY.replace("FREESET", "_free_set")
    assert _check(load_target(f"{_write(tmp_path, 'lazy_private', private)}:BlockManager"), tmp_path, 150).verdict \
        == "pass"


def test_read_free_list_rules():
    assert read_free_list([3, 1, 2]) == ([3, 1, 2], [])
    assert read_free_list([3, 1, 2, 1], truth={1, 2}) == ([1, 2], [])
    assert read_free_list([3], truth={3, 4}) == ([3], ["block 4 is in the free set but the free deque never yields it"])
    with pytest.raises(TypeError, match="no eviction order"):
        read_free_list({1, 2})


DEQUE_POOL = '''
from collections import deque

from kvspec.impl import block_pool


class DequeQueue(deque):
    """The impl pool's free-queue calls on a plain deque of blocks."""

    @property
    def num_free_blocks(self):
        return len(self)

    def popleft_n(self, n):
        return [self.popleft() for _ in range(n)]

    def append_n(self, blocks):
        self.extend(blocks)


class DequePool(block_pool.BlockPool):
    def __init__(self, num_gpu_blocks, enable_caching=True):
        super().__init__(num_gpu_blocks, enable_caching=enable_caching)
        self.free_block_queue = DequeQueue(b for b in self.blocks if b is not self.null_block)
        for b in self.blocks:
            b.prev_free_block = b.next_free_block = None
'''


def test_a_v1_block_pool_whose_free_list_is_a_deque(tmp_path):
    t = load_target(f"{_write(tmp_path, 'deque_pool', DEQUE_POOL)}:DequePool")
    assert t.api == "blockpool"
    assert _check(t, tmp_path, 150, level="pool").verdict == "pass"
    bad = DEQUE_POOL + '''
    def free_blocks(self, ordered_blocks):
        super().free_blocks(list(ordered_blocks)[::-1])  # the wrong end of a request first
'''
    report = _check(load_target(f"{_write(tmp_path, 'deque_pool_bad', bad)}:DequePool"), tmp_path, 300, level="pool")
    assert report.verdict == "violation"


def test_a_step_is_still_driven_through_renamed_names(tmp_path):
    f = _write(tmp_path, "steps", _declare(RENAMED, 'kvspec_names = {"free_block_ids": "free_list"}'))
    s = Session(load_target(f"{f}:BlockManager"), Config(level="cache", num_blocks=4, block_size=2))
    for op in (Admit("r1", (1, 2, 3)), Step("r1", 4), Step("r1", 5), Finish("r1")):
        assert s.apply(op) == []
