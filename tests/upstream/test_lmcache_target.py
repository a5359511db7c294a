"""The `lmcache` target: LMCache 0.5.6's PagedTensorMemoryAllocator, driven for real at
pool level (nothing mocked), loaded without running ``lmcache/__init__.py``; its
double-release path (``ref_count_down`` below zero resets the count "as a hack" and
frees the page again) found under misuse as a robustness finding with a short repro.

Needs `pip install --no-deps -r requirements/upstream.txt`; skipped, with that reason,
when lmcache is missing."""
import importlib.util

import pytest

pytestmark = pytest.mark.upstream
if importlib.util.find_spec("lmcache") is None:  # importorskip would run lmcache/__init__ (numba)
    pytest.skip("lmcache is not installed: pip install --no-deps -r requirements/upstream.txt",
                allow_module_level=True)

from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis.stateful import run_state_machine_as_test  # noqa: E402

from kvspec.check.search import run_check  # noqa: E402
from kvspec.check.session import Session  # noqa: E402
from kvspec.errors import TargetError  # noqa: E402
from kvspec.mc.fork import ReplayFork, choose_fork  # noqa: E402
from kvspec.spec.config import Config  # noqa: E402
from kvspec.spec.ops import Alloc, Free, Lookup, Touch  # noqa: E402
from kvspec.stateful import pool_machine  # noqa: E402
from kvspec.targets.lmcache_target import LMCachePoolDriver  # noqa: E402
from kvspec.targets.registry import load_target  # noqa: E402

MACHINE = settings(max_examples=40, stateful_step_count=30, deadline=None, database=None,
                   suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def lmc():
    return load_target("lmcache")


def test_loads_without_the_package_init(lmc):
    import sys
    assert "lmcache" not in sys.modules or not hasattr(sys.modules["lmcache"], "__version__"), \
        "lmcache/__init__.py ran"
    assert lmc.traits.levels == ("pool",) and lmc.traits.free_order == "fifo"
    with pytest.raises(TargetError, match="pool"):
        lmc.driver(Config(level="cache"))
    with pytest.raises(TargetError, match="--patch"):
        load_target("lmcache", patch=__file__)


def test_valid_ops_follow_fifo(lmc):
    s = Session(lmc, Config(level="pool", num_blocks=4))
    assert s.initial == []
    for op in (Alloc(2), Touch((0,)), Free((0,)), Free((1,)), Free((0,))):
        assert s.apply(op) == [], op
    # LMCache pops pages from the left and appends freed ones on the right
    assert s.obs.queue == (2, 3, 1, 0) == tuple(s.model.queue)
    assert s.apply(Alloc(3)) == [] and s.last_result == (2, 3, 1)
    assert isinstance(s.driver, LMCachePoolDriver)


def test_unsupported_ops_are_never_run(lmc):
    # no prefix cache: Lookup has no API; the machines skip it (Traits.unsupported_ops)
    assert "Lookup" in lmc.traits.unsupported_ops
    with pytest.raises(TargetError):
        Session(lmc, Config(level="pool", num_blocks=3)).driver.apply(Lookup("a"))


def test_pool_machine_passes(lmc):
    run_state_machine_as_test(pool_machine(lmc), settings=MACHINE)


def test_double_release_is_a_short_robustness_finding(lmc, tmp_path):
    report = run_check(lmc, "lmcache", level="pool", misuse=True, seed=0, max_examples=150,
                       report_dir=str(tmp_path))
    assert not report.violations  # valid use passes
    doubles = [f for f in report.robustness if any("double free" in v.message for v in f.violations)]
    assert doubles, [str(f.violations[0]) for f in report.robustness]
    f = min(doubles, key=lambda f: len(f.steps))
    assert 2 <= len(f.steps) <= 3, f.steps
    assert f.violations[0].invariant == "ATOMIC_REJECT"
    # replayed by hand: the page is listed twice in the free deque afterwards
    s = Session(lmc, f.config)
    for op in f.steps:
        found = s.apply(op)
    assert {"ATOMIC_REJECT", "I1"} <= {v.invariant for v in found}
    page = f.steps[-1].blocks[0]
    assert s.obs.queue.count(page) >= 2


def test_model_checker_forks_by_replay(lmc):
    # every page object holds a threading.Lock: neither pickle nor deepcopy can fork it
    s = Session(lmc, Config(level="pool", num_blocks=3))
    assert isinstance(choose_fork(s, [Alloc(1), Alloc(2)]), ReplayFork)
    from kvspec.mc.search import model_check
    res = model_check(lmc, Config(level="pool", num_blocks=3), depth=3)
    assert res.verdict == "pass" and res.states > 1 and res.fork == "replay"
