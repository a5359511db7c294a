"""The `sglang` target: sglang 0.5.23's PagedTokenToKVPoolAllocator (pool level) and
RadixCache over it (cache level), driven for real on CPU torch, loaded without running
sglang's package ``__init__``. Valid pool use passes; misuse findings are robustness
findings; at the cache level the radix tree's deduplication at insertion (a policy the
catalogue's I2 does not allow) is what kvspec reports first.

Needs `pip install --no-deps -r requirements/upstream.txt`; skipped, with that reason,
when sglang is missing."""
import importlib.util
import sys

import pytest

pytestmark = pytest.mark.upstream
if importlib.util.find_spec("sglang") is None:  # importorskip would run sglang/__init__
    pytest.skip("sglang is not installed: pip install --no-deps -r requirements/upstream.txt",
                allow_module_level=True)

from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis.stateful import run_state_machine_as_test  # noqa: E402

from kvspec.check.session import Session  # noqa: E402
from kvspec.errors import TargetError  # noqa: E402
from kvspec.spec.config import Config  # noqa: E402
from kvspec.spec.ops import Admit, Alloc, Finish, Free, Preempt, Step, Touch  # noqa: E402
from kvspec.stateful import pool_machine  # noqa: E402
from kvspec.targets.registry import load_target  # noqa: E402
from kvspec.targets.stub_import import package_dir  # noqa: E402

MACHINE = settings(max_examples=40, stateful_step_count=30, deadline=None, database=None,
                   suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def sg():
    return load_target("sglang")


def test_loads_without_the_package_init(sg):
    assert "sglang.srt.mem_cache.radix_cache" in sys.modules
    # the stand-in parents are gone again, and the real __init__ never ran
    assert "sglang" not in sys.modules or hasattr(sys.modules["sglang"], "__version__") is False
    assert "sglang.srt.mem_cache.memory_pool" not in sys.modules
    with pytest.raises(TargetError, match="page size"):
        sg.driver(Config(level="pool", block_size=1))


def test_missing_package_is_one_line_target_error():
    with pytest.raises(TargetError, match="pip install"):
        package_dir("kvspec_no_such_package", "sglang", "pip install --no-deps sglang==0.5.23")


def test_pool_frees_to_the_front_in_order(sg):
    s = Session(sg, Config(level="pool", num_blocks=5))
    assert s.initial == [] and s.obs.null_block == 0 and 0 not in s.obs.queue
    assert s.apply(Alloc(3)) == [] and s.last_result == (1, 2, 3)   # free_pages starts at page 1
    assert s.apply(Free((3, 1))) == []
    assert s.obs.queue == (3, 1, 4) == tuple(s.model.queue)          # most recently freed first
    assert s.apply(Alloc(2)) == [] and s.last_result == (3, 1)
    assert "Touch" in sg.traits.unsupported_ops
    with pytest.raises(TargetError):
        s.driver.apply(Touch((1,)))


def test_pool_machine_passes(sg):
    run_state_machine_as_test(pool_machine(sg), settings=MACHINE)


def test_double_free_is_accepted(sg):
    # sglang's free_page_ids does no check (only SGLANG_DEBUG_MEMORY_POOL asserts, after the fact)
    s = Session(sg, Config(level="pool", num_blocks=4))
    s.apply(Alloc(1))
    assert s.apply(Free((1,))) == []
    found = s.apply(Free((1,)))
    assert [v.invariant for v in found][:2] == ["ATOMIC_REJECT", "I1"]
    assert s.obs.queue.count(1) == 2


def test_cache_level_prefix_hits(sg):
    s = Session(sg, Config(level="cache", num_blocks=8, block_size=2))
    ops = [Admit("r1", (1, 2, 3, 4, 5)), Step("r1", 6), Finish("r1"), Admit("r2", (1, 2, 3, 4, 9)),
           Preempt("r2"), Admit("r2")]
    for op in ops:
        assert s.apply(op) == [], (op, s.obs.excerpt())
    assert s.last_result == 4                          # pages [1,2] and [3,4] hit, token 9 computed
    rs = s.obs.requests["r2"]
    assert rs.computed == 5 and len(rs.table) == 3
    # a tree page's hash is its path's tokens; held pages count their lock refs
    assert s.obs.blocks[rs.table[0]].hash == (1, 2) and s.obs.blocks[rs.table[1]].hash == (1, 2, 3, 4)
    assert s.obs.blocks[rs.table[0]].ref == 1


def test_cache_level_reports_insert_deduplication(sg):
    # The second request recomputes the last full page (a hit never covers the whole
    # prompt); inserting it finds the first request's page, so sglang frees the copy and
    # swaps the tree's page into the row: held blocks are deduplicated, which kvspec's
    # model (I2: never deduplicated) does not do. KV stays correct: equal content.
    s = Session(sg, Config(level="cache", num_blocks=6, block_size=2))
    assert s.apply(Admit("r1", (1, 2))) == []
    found = s.apply(Admit("r2", (1, 2)))
    assert found and found[0].invariant in ("I4", "I2", "EVICTION_ORDER")
    assert s.obs.requests["r2"].table == s.obs.requests["r1"].table
    assert "KV_INTEGRITY" not in {v.invariant for v in found}
