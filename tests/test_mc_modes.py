"""kvspec mc's modes: a state checked once, the fork fallback, parallel workers, the flags."""
import json
import subprocess
import sys
import textwrap

import pytest

from kvspec.cli import main
from kvspec.errors import UsageError
from kvspec.mc.search import confirm, model_check
from kvspec.mc.split import StepChecker, is_state_check
from kvspec.spec import invariants
from kvspec.spec.config import Config
from kvspec.targets import load_target

from test_mc import impl, patched, pool  # noqa: E402,F401  (the same fixtures: impl is a fixture)


def cache(usable):
    return Config(level="cache", num_blocks=usable + 1, block_size=2)


def same(a, b):
    return (a.verdict, a.states, a.levels, a.invariant, a.counterexample) == \
        (b.verdict, b.states, b.levels, b.invariant, b.counterexample)


# -- a state checked once ------------------------------------------------------------------
def test_the_split_follows_what_a_check_reads():
    names = StepChecker().names()
    # reads only the observation after the step
    assert is_state_check(invariants.queue_iff_free) and is_state_check(invariants.accounting)
    # index_consistent reads ctx.comparable (whether a replaced entry's block may differ: a
    # declared index policy), so it runs on every transition
    assert not is_state_check(invariants.index_consistent)
    # reads the op / the result / the state before
    assert not is_state_check(invariants.eviction_order) and not is_state_check(invariants.full_only)
    assert not is_state_check(invariants.accounting_step)
    # records pairs in the hash history (part of the state key): runs on every step
    assert not is_state_check(invariants.hash_chain)
    assert set(names["state"]) | set(names["transition"]) == {f.__name__ for f in invariants.CHECKS}


def test_the_split_reads_the_code_and_follows_only_same_module_functions():
    # defined by exec: no source file, so only the compiled code can tell
    g: dict = {"__name__": "fake_checks", "foreign": print}
    exec(textwrap.dedent("""
        def helper(ctx):
            return ctx.prev
        def via_helper(ctx):
            return helper(ctx)
        def via_foreign(ctx):
            return foreign(ctx)
        def state_only(ctx):
            return [b for b in ctx.obs.blocks if b.ref < 0]
        def in_a_comprehension(ctx):
            return [x for x in ctx.result]
        def writes_history(ctx):
            return ctx.hashes.pair(1, 2)
    """), g)
    assert is_state_check(g["state_only"])
    for name in ("via_helper", "via_foreign", "in_a_comprehension", "writes_history"):
        assert not is_state_check(g[name]), name


@pytest.mark.parametrize("level", ["pool", "cache"])
def test_checking_a_state_once_keeps_the_state_space(impl, level):
    cfg, d = (pool(4), 5) if level == "pool" else (cache(2), 4)
    once = model_check(impl, cfg, d, check_once=True)
    every = model_check(impl, cfg, d, check_once=False)
    assert same(once, every) and once.transitions == every.transitions
    # the state checks ran once per new state, not once per transition
    assert once.state_checks == once.states - 1 < once.transitions


# -- forking -----------------------------------------------------------------------------
LOCK_POOL = """
import threading
from impl.block_pool import BlockPool as _Base

class BlockPool(_Base):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self._lock = threading.Lock()   # cannot be pickled
"""


def test_a_driver_that_cannot_be_pickled_falls_back_to_another_fork(tmp_path, impl):
    path = tmp_path / "lock_pool.py"
    path.write_text(LOCK_POOL)
    t = load_target(f"{path}:BlockPool", api="blockpool")
    r = model_check(t, pool(3), 4)
    assert r.verdict == "pass" and r.fork not in ("pickle", "compact")
    ref = model_check(load_target(f"{path}:BlockPool", api="blockpool"), pool(3), 4, fork="replay")
    assert (r.states, r.levels) == (ref.states, ref.levels) and r.states > 1
    with pytest.raises(UsageError, match="--fork pickle"):
        model_check(t, pool(3), 2, fork="pickle")
    # and --workers, which sends states pickled between levels, falls back to one process
    w = model_check(t, pool(3), 4, workers=2)
    assert w.workers == 1 and (w.states, w.levels) == (ref.states, ref.levels)


# -- parallel search ---------------------------------------------------------------------
def test_two_workers_see_the_same_states(impl):
    one = model_check(impl, pool(4), 5)
    two = model_check(impl, pool(4), 5, workers=2)
    assert two.workers == 2 and same(one, two) and one.transitions == two.transitions


@pytest.mark.parametrize("bug,level", [("no_evict", "pool"), ("stale_index", "pool"), ("free_forward", "cache")])
def test_two_workers_find_the_same_shortest_counterexample(bug, level):
    t = patched(bug)
    cfg = pool(3) if level == "pool" else cache(3)
    one = model_check(t, cfg, 6)
    two = model_check(t, cfg, 6, workers=3)
    assert one.verdict == "violation" and same(one, two) and one.transitions == two.transitions
    assert confirm(t, cfg, two)


@pytest.fixture
def tiny_chunks(monkeypatch):
    """Split every level of two states or more, in chunks of one state: the small
    configurations below then go through the forked workers, the shared counter and
    the chunk-order merge (by default a level under 64 states is expanded in one process)."""
    from kvspec.mc import parallel
    monkeypatch.setattr(parallel, "MIN_SLICE", 1)
    monkeypatch.setattr(parallel, "MIN_CHUNK", 1)


def test_split_levels_see_the_same_states(impl, tiny_chunks):
    one = model_check(impl, pool(4), 5)
    two = model_check(impl, pool(4), 5, workers=2)
    three = model_check(impl, pool(4), 5, workers=3)
    assert two.split_levels >= 4 and three.split_levels >= 4   # every level from the second on
    for r in (two, three):
        assert same(one, r) and one.transitions == r.transitions
        # every new key's state checks ran in some process (two chunks may both run them)
        assert one.state_checks == one.states - 1 <= r.state_checks


@pytest.mark.parametrize("bug,level", [("no_evict", "pool"), ("stale_index", "pool"), ("free_forward", "cache")])
def test_split_levels_find_the_same_shortest_counterexample(bug, level, tiny_chunks):
    t = patched(bug)
    cfg = pool(3) if level == "pool" else cache(3)
    one = model_check(t, cfg, 6)
    two = model_check(t, cfg, 6, workers=2)
    assert one.verdict == "violation" and two.split_levels >= 1
    assert same(one, two) and one.transitions == two.transitions
    assert confirm(t, cfg, two)


def test_a_failing_worker_is_reported_not_lost(impl, tiny_chunks, monkeypatch):
    from kvspec.mc import parallel
    real = parallel._share

    def share():
        if parallel._LEVEL["in_child"]:   # a forked worker, whatever it would have claimed
            raise ValueError("boom in a worker")
        return real()

    monkeypatch.setattr(parallel, "_share", share)
    with pytest.raises(RuntimeError, match="a worker process failed: ValueError: boom in a worker"):
        model_check(impl, pool(4), 5, workers=2)


def test_a_capped_worker_sends_keys_without_states(impl, tiny_chunks, monkeypatch):
    """A share stopped by a cap ends the level incomplete, so its new states are never
    expanded: they come back as keys and counts only (at a large level the saved states
    were gigabytes, and sending them kept a capped search running minutes past its cap)."""
    from kvspec.mc import parallel
    real_expand, real_level = parallel._expand, parallel.run_level
    seen_results = []

    def expand(lo, hi, local):
        r = real_expand(lo, hi, local)
        if parallel._LEVEL["in_child"] and any(k == parallel.NEW for _, _, _, k, _ in r["records"]):
            r["timeout"], r["reason"] = True, "time cap (test)"   # as a CapReached in the worker
        return r

    def run_level(*a, **kw):
        results, k = real_level(*a, **kw)
        seen_results.append(results)
        return results, k

    monkeypatch.setattr(parallel, "_expand", expand)
    monkeypatch.setattr(parallel, "run_level", run_level)
    r = model_check(impl, pool(4), 5, workers=2)
    assert r.verdict == "incomplete" and r.reason == "time cap (test)"
    capped = [c for c in seen_results[-1] if c["timeout"] and c["records"]]
    new = [pl for c in capped for _, _, _, kind, pl in c["records"] if kind == parallel.NEW]
    assert new and all(pl[2] is None for pl in new)


def test_a_worker_closes_the_read_ends_it_inherits(monkeypatch):
    """So that a worker whose search died gets an error on sending, instead of blocking
    forever on a full pipe that its own copy of the read end keeps open."""
    import multiprocessing
    from kvspec.mc import parallel
    monkeypatch.setattr(parallel, "_share", lambda: {"chunks": {}})
    recv, send = multiprocessing.Pipe(duplex=False)
    other, other_send = multiprocessing.Pipe(duplex=False)
    try:
        parallel._worker(send, [other])
        assert other.closed and send.closed and recv.recv() == ("ok", {"chunks": {}})
    finally:
        parallel._LEVEL.clear()
        recv.close()
        other_send.close()


def test_the_default_split_keeps_small_levels_in_one_process(impl):
    from kvspec.mc import parallel
    r = model_check(impl, pool(4), 5, workers=2)
    # level d expands the states found at depth d - 1 (r.levels[d - 1])
    wide = [n for n in r.levels[:5] if n >= 2 * parallel.MIN_SLICE]
    assert r.workers == 2 and 0 < len(wide) < 5 and r.split_levels == len(wide)


# -- the flags ----------------------------------------------------------------------------
def test_cli_symmetry_fork_workers_flags(capsys):
    out = {}
    for args in (["--symmetry", "on"], ["--symmetry", "off"], ["--fork", "pickle"], ["--workers", "2"],
                 ["--check-once", "off"]):
        assert main(["mc", "--blocks", "3", "--depth", "4", "--json", *args]) == 0
        out[tuple(args)] = json.loads(capsys.readouterr().out)
    on, off = out[("--symmetry", "on")], out[("--symmetry", "off")]
    assert off["states"] > on["states"] and off["bounds"]["symmetry"] is False
    assert out[("--fork", "pickle")]["fork"] == "pickle" and out[("--fork", "pickle")]["states"] == on["states"]
    assert out[("--workers", "2")]["workers"] == 2 and out[("--workers", "2")]["states"] == on["states"]
    assert out[("--check-once", "off")]["state_checks"] == 0 and out[("--check-once", "off")]["states"] == on["states"]


@pytest.mark.parametrize("args,needle", [(["--workers", "0"], "--workers"), (["--fork", "sideways"], "--fork"),
                                         (["--symmetry", "maybe"], "--symmetry")])
def test_cli_bad_flags_are_one_line_exit_2(args, needle):
    r = subprocess.run([sys.executable, "-m", "kvspec.cli", "mc", *args], capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr and needle in r.stderr


# -- what the model says of each enabled op, asked once per set of ops ----------------------
@pytest.mark.parametrize("level,symmetry", [("pool", True), ("pool", False), ("cache", True)])
def test_the_misuse_answers_handed_to_apply_are_the_models_own(monkeypatch, impl, level, symmetry):
    """The search asks ``misuse_reason`` once per (remembered) list of enabled ops and
    hands the answers to ``Session.apply``; each must be what the model says in the
    very state the op is applied in."""
    from kvspec.check.session import ASK, Session
    from kvspec.mc.enumerate_ops import Bounds
    real = Session.apply
    handed = []

    def apply(self, op, misuse=ASK):
        if misuse is not ASK:
            handed.append(misuse)
            assert misuse == self.model.misuse_reason(op), op
        return real(self, op, misuse)

    monkeypatch.setattr(Session, "apply", apply)
    cfg = pool(4) if level == "pool" else cache(3)
    r = model_check(impl, cfg, 4, Bounds(symmetry=symmetry, misuse=True))
    assert r.verdict == "pass" and len(handed) == r.transitions > 100
    if level == "pool":   # the pool level's misuse ops: answers that are not None came through too
        assert any(m is not None for m in handed) and None in handed


# -- a packed frontier ---------------------------------------------------------------------
def _packed_and_plain(monkeypatch, target, cfg, depth):
    """The same search with the frontier packed from the first memory check on (by
    default only past a quarter of the memory cap, which no test reaches), and plain."""
    from kvspec.mc import search
    monkeypatch.setattr(search, "PACK_AT", -1.0)
    packed = model_check(target, cfg, depth)
    monkeypatch.setattr(search, "PACK_AT", 0.25)
    return packed, model_check(target, cfg, depth)


@pytest.mark.parametrize("level,depth", [("pool", 6), ("cache", 5)])
def test_a_packed_frontier_sees_the_same_states(impl, monkeypatch, level, depth):
    packed, plain = _packed_and_plain(monkeypatch, impl, pool(4) if level == "pool" else cache(3), depth)
    assert packed.packed_from is not None and packed.packed_from < depth - 1 and plain.packed_from is None
    assert same(plain, packed)
    assert (plain.transitions, plain.state_checks) == (packed.transitions, packed.state_checks)


@pytest.mark.parametrize("bug", ["no_evict", "stale_index"])
def test_a_packed_frontier_finds_the_same_shortest_counterexample(bug, monkeypatch):
    t = patched(bug)
    cfg = pool(4)
    packed, plain = _packed_and_plain(monkeypatch, t, cfg, 8)
    # found past the first packed level: its path goes through packed states
    assert plain.verdict == "violation" and packed.packed_from is not None and packed.depth > packed.packed_from
    assert same(plain, packed) and plain.transitions == packed.transitions
    assert confirm(t, cfg, packed)


def test_the_cli_says_when_states_were_kept_packed(monkeypatch, capsys):
    from kvspec.mc import search
    argv = ["mc", "--target", "impl", "--level", "pool", "--blocks", "3", "--depth", "5"]
    assert main(argv) == 0
    assert "kept packed" not in capsys.readouterr().out
    monkeypatch.setattr(search, "PACK_AT", -1.0)
    assert main(argv) == 0
    assert "states kept packed from depth 2" in capsys.readouterr().out
