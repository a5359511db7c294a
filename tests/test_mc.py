"""kvspec mc: the search itself, its stopping rules, and the CLI contract."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvspec.cli import main
from kvspec.spec.config import Config
from kvspec.mc.enumerate_ops import Bounds, enabled_ops
from kvspec.mc.search import confirm, model_check
from kvspec.spec.ops import Alloc, Cache, Free, Touch
from kvspec.check.session import Session, run_steps
from kvspec.targets import load_target

CORPUS = Path(__file__).resolve().parents[1] / "kvspec" / "corpus" / "impl"


@pytest.fixture(scope="module")
def impl():
    return load_target("impl")


def patched(name):
    return load_target("impl", patch=str(CORPUS / f"{name}.diff"))


def pool(usable):
    return Config(level="pool", num_blocks=usable + 1)


def cache(usable, block_size=2):
    return Config(level="cache", num_blocks=usable + 1, block_size=block_size)


# -- the search ---------------------------------------------------------------------------
def test_small_pool_search_passes_and_counts(impl):
    r = model_check(impl, pool(3), 5)
    assert r.verdict == "pass" and r.counterexample is None and r.invariant is None
    assert r.depth == 5 and r.states == sum(r.levels) and r.transitions >= r.states - 1
    assert r.fork == "compact"   # impl's drivers snapshot and restore themselves in place


def test_a_tiny_pool_is_exhausted(impl):
    r = model_check(impl, pool(1), 30)
    assert r.verdict == "pass" and r.exhausted and r.depth < 30 and r.levels[-1] == 0


def test_depth_zero_checks_only_the_initial_state(impl):
    r = model_check(impl, pool(3), 0)
    assert r.verdict == "pass" and r.states == 1 and r.transitions == 0


def test_every_transition_is_driven_not_only_those_to_new_states():
    """touch_no_remove breaks only the step that revives a cached block, and that step
    always lands on a state that alloc + cache reach two steps sooner. A search that
    drove the target only into new states could never see it."""
    r = model_check(patched("touch_no_remove"), pool(3), 6)
    assert r.verdict == "violation" and r.invariant == "I1"
    assert r.counterexample == [Alloc(1), Cache((1,), ("a",)), Free((1,)), Touch((1,))]


@pytest.mark.parametrize("bug, level, invariant, length", [
    ("no_evict", "pool", "I4", 4), ("ref_not_decremented", "pool", "ACCOUNTING", 2),
    ("full_prompt_hit", "cache", "MAX_HIT", 2), ("partial_cached", "cache", "I3", 1),
    ("null_block_queued", "pool", "NULL_BLOCK", 0),
])
def test_shortest_counterexample_replays_from_scratch(bug, level, invariant, length):
    t = patched(bug)
    cfg = pool(3) if level == "pool" else cache(3)
    r = model_check(t, cfg, 6)
    assert r.verdict == "violation" and r.invariant == invariant and len(r.counterexample) == length
    assert confirm(t, cfg, r)
    out = run_steps(t, cfg, r.counterexample)
    assert out.index == length - 1 if length else out.index == -1


def test_no_shorter_counterexample_exists_than_the_one_reported():
    """Cross-check breadth-first order against a plain unreduced enumeration of every
    path one step shorter."""
    t = patched("no_evict")
    cfg = pool(2)
    r = model_check(t, cfg, 6)
    assert len(r.counterexample) == 4
    frontier = [[]]
    for _ in range(3):
        nxt = []
        for path in frontier:
            s = Session(t, cfg)
            assert not any(s.apply(op) for op in path)
            nxt += [path + [op] for op in enabled_ops(s.model, cfg, Bounds(symmetry=False))]
        frontier = nxt
    for path in frontier:
        assert not run_steps(t, cfg, path).failed


@pytest.mark.parametrize("bug", ["no_evict", "touch_no_remove", "stale_index", "free_forward", "capacity_off_by_one"])
def test_symmetry_reduction_keeps_verdicts_and_lengths(bug):
    t = patched(bug)
    level = "cache" if bug in ("free_forward", "capacity_off_by_one") else "pool"
    cfg = pool(3) if level == "pool" else cache(3)
    on = model_check(t, cfg, 5)
    off = model_check(t, cfg, 5, Bounds(symmetry=False))
    assert on.verdict == off.verdict == "violation" and on.invariant == off.invariant
    assert len(on.counterexample) == len(off.counterexample)


def test_symmetry_reduction_shrinks_the_state_space(impl):
    on = model_check(impl, pool(3), 5)
    off = model_check(impl, pool(3), 5, Bounds(symmetry=False))
    assert on.verdict == off.verdict == "pass"
    assert on.states < off.states and on.transitions < off.transitions


@pytest.mark.parametrize("fork", ["compact", "pickle", "deepcopy", "replay"])
def test_every_way_of_forking_a_state_sees_the_same_state_space(impl, fork):
    ref = model_check(impl, cache(2), 4, fork="replay")
    r = model_check(impl, cache(2), 4, fork=fork)
    assert r.fork == fork and (r.states, r.transitions, r.levels) == (ref.states, ref.transitions, ref.levels)


@pytest.mark.parametrize("level", ["pool", "cache"])
def test_compact_fork_and_key_memo_see_what_pickle_sees(impl, level):
    """The fast paths (in-place fork, keys remembered per exact state) change no count."""
    cfg, d = (pool(3), 6) if level == "pool" else (cache(3), 5)
    old = model_check(impl, cfg, d, fork="pickle", key_memo=False)
    new = model_check(impl, cfg, d, fork="compact", key_memo=True)
    assert new.fork == "compact" and old.fork == "pickle"
    assert (new.verdict, new.states, new.transitions, new.levels) == (old.verdict, old.states, old.transitions, old.levels)


@pytest.mark.parametrize("bug", ["touch_no_remove", "ref_not_decremented", "popleft_n_no_relink", "free_forward",
                                 "hash_no_parent", "null_block_queued"])
def test_compact_fork_finds_what_pickle_finds(bug):
    """Patched allocators (broken links, wrong counts) fork in place as faithfully."""
    t = patched(bug)
    level = "cache" if bug in ("free_forward", "hash_no_parent") else "pool"
    cfg = pool(3) if level == "pool" else cache(3)
    old = model_check(t, cfg, 6, fork="pickle", key_memo=False)
    new = model_check(t, cfg, 6)
    assert new.fork == ("" if bug == "null_block_queued" else "compact")   # that one fails at construction
    assert (new.verdict, new.invariant, new.counterexample, new.states, new.transitions) == \
        (old.verdict, old.invariant, old.counterexample, old.states, old.transitions)


def test_in_place_restore_puts_back_every_object(impl):
    """restore() writes the saved values back into the same objects; later steps do not
    leak into the snapshot, and a state it cannot save exactly gives None."""
    from kvspec.spec.ops import Admit, Finish, Step
    from kvspec.targets.snapshot import GraphSnapshot

    for cfg, steps, more in [(pool(4), [Alloc(3), Cache((1, 2), ("a", "b")), Free((2, 1))],
                              [Alloc(4), Touch((3,)), Free((1, 2, 3))]),
                             (cache(4), [Admit("r1", (1, 2, 11)), Admit("r2", (1, 2, 11, 12))],
                              [Step("r1", 11), Finish("r2"), Admit("r3", (1, 2))])]:
        s = Session(impl, cfg)
        for op in steps:
            assert not s.apply(op)
        d = s.driver
        before = d.observe()
        pool_obj = d.pool if cfg.level == "pool" else d.mgr.block_pool
        blocks = list(pool_obj.blocks)
        snap = d.snapshot()
        assert snap is not None
        for op in more:
            s.apply(op)
        assert d.observe() != before
        assert d.restore(snap) is d
        assert d.observe() == before and all(a is b for a, b in zip(pool_obj.blocks, blocks))
        # the driver goes on from the restored state exactly like a fresh replay
        fresh = Session(impl, cfg)
        for op in steps + more:
            fresh.apply(op)
        for op in more:
            s.apply(op)
        assert s.driver.observe() == fresh.obs
    # a foreign object linked into the pool later cannot be saved in place (the objects
    # restored in place are those reachable at the first snapshot)
    s = Session(impl, pool(2))
    assert s.driver.snapshot() is not None
    other = type(s.driver.pool)(3)
    s.driver.pool.free_block_queue.head.next_free_block = other.blocks[1]
    assert s.driver.snapshot() is None
    g = GraphSnapshot([[1, 2], {"x": (3, 4)}])
    assert g.ok and g.capture() is not None


def test_observations_are_unchanged_by_the_fast_constructors(impl):
    """observe_pool builds Observations and BlockStates without their constructors;
    the objects must equal (and hash like) the constructors' own."""
    from dataclasses import fields

    from kvspec.spec.observation import BlockState, Observation

    s = Session(impl, pool(3))
    s.apply(Alloc(2))
    s.apply(Cache((1,), ("a",)))
    o = s.driver.observe()
    rebuilt = Observation(**{f.name: getattr(o, f.name) for f in fields(Observation)})
    assert type(o) is Observation and o == rebuilt and hash(o.blocks) == hash(rebuilt.blocks)
    assert all(type(b) is BlockState and b == BlockState(b.ref, b.hash, b.queued) for b in o.blocks)
    # and the fast constructor is the one in use: a field added to Observation once turned
    # it off unnoticed (every observation of a search then took the frozen constructor)
    from kvspec.targets import v1_driver

    assert v1_driver._OBS_FAST, "Observation changed shape: update v1_driver._OBS_FIELDS"
    assert o.__dict__.keys() == rebuilt.__dict__.keys()


def test_invariant_filter_prunes_other_failures():
    """hash_no_parent first shows as HASH_CHAIN; asking for another invariant prunes those
    transitions and keeps looking."""
    t = patched("hash_no_parent")
    first = model_check(t, cache(3), 3)
    assert first.invariant == "HASH_CHAIN"
    other = model_check(t, cache(3), 2, invariant="I1")
    assert other.verdict == "pass" and other.pruned > 0


def test_time_cap_gives_incomplete_never_pass(impl):
    r = model_check(impl, pool(5), 8, time_cap=0.05)
    assert r.verdict == "incomplete" and "time cap" in r.reason and r.depth < 8


def test_memory_cap_gives_incomplete_never_pass(impl):
    r = model_check(impl, pool(5), 8, mem_cap_gib=0.001)
    assert r.verdict == "incomplete" and "memory cap" in r.reason


def test_progress_goes_to_stderr(impl, capsys):
    model_check(impl, pool(4), 6, progress=True)
    err = capsys.readouterr().err
    assert "[mc] depth" in err and "states/s" in err


def test_enabled_ops_are_all_valid_and_match_the_machines_rules(impl):
    cfg = pool(4)
    s = Session(impl, cfg)
    for op in [Alloc(3), Cache((1,), ("a",)), Free((1, 2)), Touch((3,))]:
        s.apply(op)
    ops = enabled_ops(s.model, cfg, Bounds(symmetry=False))
    assert ops and all(s.model.misuse_reason(op) is None for op in ops)
    kinds = {type(op).__name__ for op in ops}
    assert kinds == {"Alloc", "Free", "Touch", "Cache", "Lookup", "Reset"}
    assert all(max(s.model.ref[b] for b in op.blocks) < 2 for op in ops if isinstance(op, Touch))
    ccfg = cache(3)
    c = Session(impl, ccfg)
    cops = enabled_ops(c.model, ccfg, Bounds())
    assert {type(op).__name__ for op in cops} == {"Admit"} and all(c.model.misuse_reason(op) is None for op in cops)


# -- the command line ---------------------------------------------------------------------
def run_json(args, capsys):
    rc = main(args + ["--json"])
    out = capsys.readouterr()
    return rc, json.loads(out.out)


def test_cli_pass_has_the_contract_keys(capsys):
    rc, d = run_json(["mc", "--blocks", "3", "--depth", "4"], capsys)
    assert rc == 0 and d["verdict"] == "pass" and d["counterexample"] is None
    for k in ("verdict", "states", "transitions", "depth", "seconds", "states_per_second", "counterexample",
              "invariant", "repro"):
        assert k in d
    assert d["states"] > 1 and d["transitions"] > 0 and d["depth"] == 4


def test_cli_incomplete_exits_0_and_says_so(capsys):
    rc, d = run_json(["mc", "--blocks", "5", "--depth", "9", "--time-cap", "0.2"], capsys)
    assert rc == 0 and d["verdict"] == "incomplete" and d["reason"]


def test_cli_violation_writes_a_repro_that_fails_patched_and_passes_unpatched(capsys, tmp_path):
    rc, d = run_json(["mc", "--patch", str(CORPUS / "stale_index.diff"), "--blocks", "2", "--depth", "6",
                      "--report-dir", str(tmp_path)], capsys)
    assert rc == 1 and d["verdict"] == "violation" and d["invariant"] == "INDEX_CONSISTENT"
    assert len(d["counterexample"]) == 4 and d["counterexample"][0] == {"op": "Alloc", "n": 1}
    assert d["replayed"] is True and (tmp_path / "kvspec-mc.json").is_file()
    repro = d["repro"]
    assert "minimal: true" in Path(repro).read_text()
    env = dict(os.environ)
    env.pop("KVSPEC_PATCH", None)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", repro],
                       capture_output=True, text=True, env=env, cwd=tmp_path)
    assert r.returncode == 1 and "INDEX_CONSISTENT" in r.stdout
    env["KVSPEC_PATCH"] = "none"
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", repro],
                       capture_output=True, text=True, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stdout


def test_cli_text_output(capsys, tmp_path):
    rc = main(["mc", "--patch", str(CORPUS / "ref_not_decremented.diff"), "--blocks", "2", "--depth", "3",
               "--report-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 1 and "ACCOUNTING" in out and "shortest counterexample, 2 steps" in out and "repro:" in out


@pytest.mark.parametrize("args, needle", [
    (["mc", "--blocks", "0"], "--blocks"),
    (["mc", "--depth", "-1"], "--depth"),
    (["mc", "--target", "nope"], "unknown target"),
    (["mc", "--patch", "/does/not/exist.diff"], "cannot read patch"),
    (["mc", "--level", "sideways"], "level"),
])
def test_cli_usage_errors_are_one_line_exit_2(args, needle):
    r = subprocess.run([sys.executable, "-m", "kvspec.cli", *args], capture_output=True, text=True)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in r.stderr


@pytest.mark.slow
def test_acceptance_pool_5_blocks_depth_8(impl):
    # no time cap: the search is finite, and its verdict must not depend on the machine's speed
    r = model_check(impl, pool(5), 8, time_cap=float("inf"))
    assert r.verdict == "pass" and r.depth == 8


@pytest.mark.slow
def test_acceptance_cache_4_blocks_2_requests_depth_8(impl):
    r = model_check(impl, cache(4), 8, Bounds(requests=2), time_cap=float("inf"))
    assert r.verdict == "pass" and r.depth == 8


def test_misuse_option_adds_misuse_calls_that_impl_rejects_atomically(impl):
    cfg = pool(2)
    s = Session(impl, cfg)
    s.apply(Alloc(1))
    ops = enabled_ops(s.model, cfg, Bounds(misuse=True))
    misuse = [op for op in ops if s.model.misuse_reason(op) is not None]
    assert len(misuse) >= 5
    r = model_check(impl, cfg, 3, Bounds(misuse=True))
    assert r.verdict == "pass" and r.transitions > model_check(impl, cfg, 3).transitions


def test_a_driver_with_its_own_snapshot_is_forked_through_it(impl):
    """The optional driver protocol: ``snapshot()`` and ``restore(snap) -> driver``."""
    import copy

    from kvspec.targets.impl_target import ImplTarget

    calls = {"snapshot": 0, "restore": 0}

    class SnapTarget(ImplTarget):
        def driver(self, config):
            d = super().driver(config)
            mod = self.mod

            class Snap(type(d)):
                def snapshot(self):
                    calls["snapshot"] += 1
                    return copy.deepcopy(self.pool, {id(mod): mod})

                def restore(self, snap):
                    calls["restore"] += 1
                    new = copy.copy(self)
                    new.pool = copy.deepcopy(snap, {id(mod): mod})
                    return new

            d.__class__ = Snap
            return d

    t = SnapTarget()
    ref = model_check(impl, pool(3), 4)
    r = model_check(t, pool(3), 4)
    assert r.fork == "driver-snapshot" and calls["snapshot"] > 0 and calls["restore"] > 0
    assert (r.states, r.transitions) == (ref.states, ref.transitions)
