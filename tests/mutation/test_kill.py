"""The fast killing suite for mutation testing of impl (tools/mutate.py).

kvspec's stateful machines on impl for a few seconds per level, under valid use and
with misuse mixed in, plus small unit checks of what the machines do not observe
(usage, the hash encoding's inverse). Without ``KVSPEC_MUTANT`` it runs on the real
impl and must pass; with it (see conftest.py) it runs on the mutant, and a failure
kills the mutant. benchmarks/run_mutation.sh runs it together with the unit tests."""
import os
import time

import pytest

from kvspec import impl
from kvspec.checker import LevelSearch
from kvspec.targets.impl_target import ImplTarget

BUDGET = float(os.environ.get("KVSPEC_KILL_BUDGET", "2"))  # seconds per machine


def hunt(level: str, misuse: bool, budget: float = BUDGET, seed: int = 0):
    """kvspec check's search without the minimizer: the first finding, or None."""
    search = LevelSearch(ImplTarget(impl), level, misuse=misuse, seed=seed)
    end = time.monotonic() + budget
    while time.monotonic() < end:
        found = search.run_batch()
        if found:
            return found
        if search.robust:
            return next(iter(search.robust.values()))
    return None


@pytest.mark.parametrize("level", ["pool", "cache"])
@pytest.mark.parametrize("misuse", [False, True], ids=["valid", "misuse"])
def test_machines_find_nothing(level, misuse):
    f = hunt(level, misuse)
    assert f is None, f"{f.invariant}: {f.violations[0].message} after {f.steps}"


def test_usage_reports_the_held_fraction():
    pool = impl.BlockPool(5)
    assert pool.get_usage() == 0.0
    blocks = pool.get_new_blocks(2)
    assert pool.get_usage() == 0.5
    pool.free_blocks(blocks)
    assert pool.get_usage() == 0.0
    assert impl.BlockPool(1).get_usage() == 0.0
    m = impl.KVCacheManager(5, 2)
    assert m.usage == 0.0


def test_hash_input_encoding_round_trips():
    from kvspec.impl import hashing

    for parent, tokens, extra in ((b"", [], None), (b"p" * 32, [1, -2, 2**63 - 1], ("x", 1)), (b"q", [0], ())):
        data = hashing._encode(parent, tokens, extra)
        assert hashing._decode(data) == (parent, tokens, hashing._extra_bytes(extra))
        assert hashing._decode(data + b"!") is None and hashing._decode(data[:-1] if data else b"x") is None
    assert hashing.block_hash_input(None, [5]) == hashing._encode(hashing.NONE_HASH, [5], None)


def test_block_repr_names_id_ref_and_hash():
    b = impl.KVCacheBlock(3)
    assert repr(b) == "KVCacheBlock(id=3, ref=0, hash=None)"
    b.block_hash = bytes.fromhex("0123456789")
    assert repr(b) == "KVCacheBlock(id=3, ref=0, hash=01234567)"
