"""kvspec.check.minimize: ddmin, canonical names, and the bounded BFS that proves minimality."""
from pathlib import Path

import pytest

from kvspec.spec.config import Config
from kvspec.check.minimize import ddmin, fails_with, minimize, minimize_finding, rename
from kvspec.spec.ops import Admit, Alloc, Cache, Finish, Free, Lookup, Preempt, Step, Touch
from kvspec.targets import load_target

CORPUS = Path(__file__).resolve().parents[1] / "kvspec" / "corpus" / "impl"


def patched(name):
    return load_target("impl", patch=str(CORPUS / f"{name}.diff"))


POOL5 = Config(level="pool", num_blocks=5)   # four usable blocks

# no_evict: the cached block 1 is popped by the second Alloc(2). ddmin cannot drop the
# first Alloc(2) (then nothing pops block 1), so its result is 1-minimal at five steps;
# Alloc(4) in one step does it in four.
FIVE = [Alloc(1), Cache((1,), ("a",)), Free((1,)), Alloc(2), Alloc(2)]


def test_rename_names_requests_and_labels_by_first_appearance():
    steps = [Admit("r7", (1, 2)), Admit("x", (1,)), Step("x", 11), Preempt("r7"), Admit("r7"), Finish("x"),
             Cache((1, 2), ("q", "z")), Lookup("z"), Cache((3,), ("q",))]
    assert rename(steps) == [Admit("r1", (1, 2)), Admit("r2", (1,)), Step("r2", 11), Preempt("r1"), Admit("r1"),
                             Finish("r2"), Cache((1, 2), ("a", "b")), Lookup("b"), Cache((3,), ("a",))]


def test_ddmin_alone_stops_at_a_one_minimal_list_that_is_not_the_shortest():
    t = patched("no_evict")
    assert fails_with(t, POOL5, FIVE, "I4", False)
    assert ddmin(t, POOL5, FIVE, "I4") == FIVE


def test_bfs_finds_the_shorter_counterexample_on_the_same_config():
    t = patched("no_evict")
    steps, minimal = minimize(t, POOL5, FIVE, "I4")
    assert minimal is True and len(steps) == 4
    assert fails_with(t, POOL5, steps, "I4", False)


def test_minimize_finding_moves_to_the_smallest_pool_that_fails_as_fast():
    t = patched("no_evict")
    padded = [Lookup("zz")] + FIVE[:3] + [Lookup("a"), Lookup("zz")] + FIVE[3:]
    assert fails_with(t, POOL5, padded, "I4", False)
    steps, minimal, cfg = minimize_finding(t, POOL5, padded, "I4")
    assert minimal is True and len(steps) == 4
    assert cfg.num_blocks == 2 and cfg.level == "pool"   # one usable block suffices
    assert steps == [Alloc(1), Cache((1,), ("a",)), Free((1,)), Alloc(1)]
    assert fails_with(t, cfg, steps, "I4", False)


def test_labels_come_out_canonical():
    t = patched("touch_no_remove")
    steps, minimal = minimize(t, POOL5, [Alloc(2), Cache((2, 1), ("zz", "yy")), Free((2,)), Touch((2,))], "I1")
    assert minimal is True and len(steps) == 4
    assert all(h in ("a", "b") for op in steps if isinstance(op, Cache) for h in op.hashes)


def test_cache_level_requests_come_out_canonical():
    t = patched("full_prompt_hit")
    cfg = Config(level="cache", num_blocks=6, block_size=2)
    long = [Admit("r9", (1, 2, 11)), Step("r9", 12), Admit("r4", (21, 22)), Finish("r4"), Admit("r5", (1, 2))]
    assert fails_with(t, cfg, long, "MAX_HIT", False)
    steps, minimal, small = minimize_finding(t, cfg, long, "MAX_HIT")
    assert minimal is True and len(steps) == 2
    assert [op.req for op in steps] == ["r1", "r2"]
    assert small.block_size == 2 and small.num_blocks <= cfg.num_blocks


def test_no_budget_means_no_claim():
    t = patched("no_evict")
    steps, minimal, cfg = minimize_finding(t, POOL5, FIVE, "I4", bfs_budget_s=0)
    assert minimal is None and steps == FIVE and cfg == POOL5


def test_misuse_findings_get_no_minimality_claim():
    t = load_target("impl")
    steps, minimal = minimize(t, POOL5, [Alloc(1), Free((1, 1))], "ATOMIC_REJECT", allow_misuse=True)
    assert minimal is None


def test_a_failure_at_construction_is_minimal_with_no_steps():
    t = patched("null_block_queued")
    steps, minimal, cfg = minimize_finding(t, Config(level="pool", num_blocks=9), [], "NULL_BLOCK")
    assert steps == [] and minimal is True and cfg.num_blocks == 2


def test_a_list_that_does_not_reproduce_is_returned_unchanged():
    t = load_target("impl")
    steps, minimal, cfg = minimize_finding(t, POOL5, FIVE, "I4")
    assert steps == FIVE and minimal is None and cfg == POOL5


@pytest.mark.parametrize("bug, cfg, steps, invariant, length", [
    ("stale_index", POOL5, FIVE, "INDEX_CONSISTENT", 4),
    ("ref_not_decremented", POOL5, [Alloc(3), Touch((2,)), Free((1, 2, 3))], "ACCOUNTING", 2),
    ("free_forward", Config(level="cache", num_blocks=7, block_size=2),
     [Admit("r1", (1, 2, 11, 12, 21)), Admit("r2", (1, 2)), Finish("r2"), Finish("r1")], "EVICTION_ORDER", 2),
])
def test_minimal_repros_fail_the_same_way(bug, cfg, steps, invariant, length):
    t = patched(bug)
    assert fails_with(t, cfg, steps, invariant, False)
    out, minimal, small = minimize_finding(t, cfg, steps, invariant)
    assert minimal is True and len(out) == length and fails_with(t, small, out, invariant, False)


def test_a_long_cache_level_finding_is_cut_to_a_proven_minimum_on_a_small_pool():
    # touch_after_alloc needs several requests under LRU pressure; Hypothesis hands over
    # a long sequence on a large pool. Searching each pool to the full ddmin length
    # (smallest pool first) used to spend the budget on pools too small for the bug;
    # iterative deepening must find the shortest, and prove it.
    from kvspec.mc.search import model_check

    t = patched("touch_after_alloc")
    big = Config(level="cache", num_blocks=11, block_size=4)
    # what kvspec check's ddmin left on seed 0 before the minimizer deepened (14 steps)
    long = [Admit("r1", (12, 3)), Admit("r2", (11, 12, 13, 14, 21, 22, 23, 24, 21, 22, 23, 24, 3)),
            Admit("r3", (11, 12, 13, 14, 1, 2, 3, 4, 1, 2, 3, 4, 23)), Admit("r4", (11, 12, 13, 14, 11, 12, 13, 14, 1)),
            Finish("r2"), Admit("r5", (11, 12, 13, 14, 11, 12, 13, 14, 11, 12, 13, 14, 22)), Finish("r5"),
            Admit("r6", (13, 14)), Finish("r4"), Admit("r7", (21, 22, 23, 24, 21, 22, 23, 24, 21, 23, 13)),
            Finish("r7"), Admit("r8", (21, 22, 23, 24, 2, 1)), Finish("r6"),
            Admit("r9", (21, 22, 23, 24, 21, 22, 23, 24, 21, 22, 23, 24, 1, 4, 14))]
    out = run_check_like(t, big, long)
    assert out is not None, "the recorded sequence no longer fails on touch_after_alloc"
    # bounded by work (states), not seconds: "proven minimal" must not depend on the machine's load
    steps, minimal, cfg = minimize_finding(t, big, long, out, deterministic=True)
    assert minimal is True and len(steps) < len(long) and cfg.num_blocks <= big.num_blocks
    assert fails_with(t, cfg, steps, out, False)
    # proven: no shorter sequence fails on the repro's pool (an independent mc run)
    r = model_check(t, cfg, len(steps) - 1, invariant=out)
    assert r.verdict == "pass"


def run_check_like(target, cfg, steps):
    """The invariant the step list fails with at its last step, or None."""
    from kvspec.check.session import run_steps

    out = run_steps(target, cfg, steps)
    return out.invariant if out.failed else None
