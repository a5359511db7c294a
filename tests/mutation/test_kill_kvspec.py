"""The killing suite's direct checks for kvspec's own checker (tools/mutate.py --module).

Run first for every kvspec module (a second or two in all): what the probes in
tests/test_checker_probes.py and the minimizer/mc tests leave unobserved. In the default
pytest run they run on the real kvspec and must pass; under a mutant of kvspec's
invariants, session or minimizer a failure kills it."""
from pathlib import Path

import pytest

from kvspec.check.session import Session, run_steps
from kvspec.spec import invariants as inv
from kvspec.spec.config import Config
from kvspec.spec.ops import Admit, Alloc, Cache, Finish, Free, Lookup, Preempt, Prefill, Reset, Step, Touch
from kvspec.targets import load_target
from kvspec.targets.impl_target import ImplTarget

CORPUS = Path(__file__).resolve().parents[2] / "kvspec" / "corpus" / "impl"
POOL = Config(level="pool", num_blocks=5)
CACHE = Config(level="cache", num_blocks=7, block_size=2)


def test_every_catalogued_invariant_has_a_priority_and_a_clean_run_violates_nothing():
    assert set(inv.PRIORITY) == set(inv.CATALOGUE)
    steps = [Alloc(2), Cache((1, 2), ("a", "b")), Free((1, 2)), Lookup("a"), Alloc(3)]
    assert run_steps(ImplTarget(), POOL, steps).violations == []


# One shortest counterexample per corpus bug of impl, as `kvspec mc` found it
# (model_check(patched, POOL or CACHE, depth 5, max_states=3000); the invariant is the
# first one the checker names, which is one of those bugs.json lists for the bug). Each
# pins one check (and PRIORITY's order): the patched impl must fail it first,
# the real impl must pass the same valid steps. Mutants of a check that make it blind
# fail the first half; mutants that make it flag correct behaviour fail the second.
REPROS = [
    ("no_evict", POOL, "I4", [Alloc(n=1), Cache(blocks=(1,), hashes=('a',)), Free(blocks=(1,)), Alloc(n=4)]),
    ("touch_no_remove", POOL, "I1", [Alloc(n=1), Cache(blocks=(1,), hashes=('a',)), Free(blocks=(1,)), Touch(blocks=(1,))]),
    ("ref_not_decremented", POOL, "ACCOUNTING", [Alloc(n=1), Free(blocks=(1,))]),
    ("partial_cached", CACHE, "I3", [Admit(req='r1', prompt=(1, 2), chunk=1)]),
    ("hash_no_parent", CACHE, "HASH_CHAIN", [Admit(req='r1', prompt=(1, 2, 1, 2))]),
    ("free_forward", CACHE, "EVICTION_ORDER", [Admit(req='r1', prompt=(1, 2, 11)), Preempt(req='r1')]),
    ("full_prompt_hit", CACHE, "MAX_HIT", [Admit(req='r1', prompt=(1, 2)), Admit(req='r2', prompt=(1, 2))]),
    ("stale_index", POOL, "INDEX_CONSISTENT", [Alloc(n=1), Cache(blocks=(1,), hashes=('a',)), Free(blocks=(1,)), Alloc(n=4)]),
    ("capacity_off_by_one", CACHE, "NO_LEAK", [Admit(req='r1', prompt=(1, 2, 11, 12, 21, 22)), Admit(req='r2', prompt=(1, 2, 11, 12, 21, 22), extra='lora:A')]),
    ("null_block_queued", POOL, "NULL_BLOCK", []),
    ("append_n_no_count", POOL, "ACCOUNTING", [Alloc(n=1), Free(blocks=(1,))]),
    ("popleft_n_no_relink", POOL, "I1", [Alloc(n=1)]),
    ("cache_no_index", POOL, "INDEX_CONSISTENT", [Alloc(n=1), Cache(blocks=(1,), hashes=('a',))]),
    ("cache_overwrites_dupes", POOL, "INDEX_CONSISTENT", [Alloc(n=2), Cache(blocks=(1, 2), hashes=('a', 'a'))]),
    ("evict_pops_wrong_dupe", POOL, "INDEX_CONSISTENT", [Alloc(n=2), Cache(blocks=(1, 2), hashes=('a', 'a')), Free(blocks=(1,)), Alloc(n=3)]),
    ("reset_while_held", POOL, "ACCOUNTING", [Alloc(n=1), Reset()]),
    ("reset_keeps_index", POOL, "INDEX_CONSISTENT", [Alloc(n=1), Cache(blocks=(1,), hashes=('a',)), Free(blocks=(1,)), Reset()]),
    ("free_reversed_pool", POOL, "EVICTION_ORDER", [Alloc(n=2), Free(blocks=(1, 2))]),
    ("alloc_mru", POOL, "EVICTION_ORDER", [Alloc(n=1)]),
    ("step_no_cache", CACHE, "I4", [Admit(req='r1', prompt=(1, 2), chunk=1), Prefill(req='r1', n=2)]),
    ("recache_hits", CACHE, "NO_CRASH", [Admit(req='r1', prompt=(1, 2)), Admit(req='r2', prompt=(1, 2, 11))]),
    ("hashes_not_extended", CACHE, "NO_CRASH", [Admit(req='r1', prompt=(1, 2, 11)), Step(req='r1', token=11)]),
    ("preempt_stale_cached_count", CACHE, "I4", [Admit(req='r1', prompt=(1, 2)), Preempt(req='r1'), Admit(req='r1')]),
    ("lora_not_hashed", CACHE, "HASH_CHAIN", [Admit(req='r1', prompt=(1, 2)), Admit(req='r2', prompt=(1, 2), extra='lora:A')]),
]


def _first(target, config, steps, incremental):
    """(index, invariants) of the first failing step, as a Session in that mode sees it."""
    s = Session(target, config, incremental=incremental)
    if s.initial:
        return -1, [v.invariant for v in s.initial]
    for i, op in enumerate(steps):
        found = s.apply(op)
        if found:
            return i, [v.invariant for v in found]
    return None, []


@pytest.mark.parametrize("bug, config, invariant, steps", REPROS, ids=[r[0] for r in REPROS])
def test_each_corpus_bugs_shortest_repro_is_named_by_its_invariant_and_impl_passes_it(bug, config, invariant, steps):
    patched = load_target("impl", patch=str(CORPUS / f"{bug}.diff"))
    out = run_steps(patched, config, steps)
    assert out.violations, f"{bug}: no violation"
    # a shortest counterexample fails at its last step (-1: when the target is built)
    assert out.index == len(steps) - 1 and out.steps == list(steps)
    assert out.violations[0].invariant == invariant, [v.invariant for v in out.violations]
    clean = run_steps(ImplTarget(), config, steps)
    assert clean.violations == [], [v.message for v in clean.violations]
    assert out.failed is True and clean.failed is False and clean.invariant is None
    # The incremental session (on by default from 64 blocks, so the small pools above go
    # the full way) must stop at the same step with the same first invariant; impl stays clean.
    full = _first(patched, config, steps, False)
    assert _first(patched, config, steps, True) == full and full[1][0] == invariant
    assert _first(ImplTarget(), config, steps, True) == (None, [])
    if config.level == "cache" and _first(_plain(ImplTarget()), config, steps, False) == (None, []):
        # Where impl passes under the single-group CacheModel (what a target without
        # cache_features gets; not for chunked or extra-key ops), that model's incremental
        # session must agree with its full one, on impl and on the patched copy.
        assert _first(_plain(ImplTarget()), config, steps, True) == (None, [])
        assert _first(_plain(patched), config, steps, True) == _first(_plain(patched), config, steps, False)


def _plain(target):
    """The target as one without cache_features: kvspec checks it against CacheModel."""
    import dataclasses

    target.traits = dataclasses.replace(target.traits, cache_features=False)
    return target


# -- session's incremental ATOMIC_REJECT fast path (_fast_rejected) -------------------------
# A double free rejected with the documented error after changing one thing: only a ref
# count, only a hash, or only the free queue's order. The full and the incremental session must both name ATOMIC_REJECT.
@pytest.mark.parametrize("change", ["ref", "hash", "order", "order_up", "index", "enqueue_held"])
@pytest.mark.parametrize("incremental", [False, True], ids=["full", "incremental"])
def test_a_rejected_double_free_that_changed_one_ref_or_hash_is_caught(monkeypatch, change, incremental):
    from kvspec import impl

    steps = [Alloc(2), Cache((2,), ("a",)), Free((1,)), Free((1,))]
    assert _first(ImplTarget(), POOL, steps, incremental) == (None, [])
    orig = impl.BlockPool.free_blocks

    def free_touching_another(self, blocks):
        blocks = list(blocks)
        if any(b.ref_cnt == 0 for b in blocks):  # the double free: change block 2, then reject
            other = self.blocks[2]
            if change == "ref":
                other.ref_cnt += 1
            elif change == "hash":
                other.block_hash = b"x" * 32
            elif change == "index":  # block 2 keeps its hash, its index entry goes
                self.cached_block_hash_to_block.pop(other.block_hash)
            elif change == "enqueue_held":  # block 2, still held, linked into the free queue
                self.free_block_queue.append(other)  # (with the free count left as it was)
                self.free_block_queue.num_free_blocks -= 1
            else:  # the queue's last block moved to its head (a queue that sorts lower than
                # before), or its head to its tail (one that sorts higher)
                q = self.free_block_queue
                free = q.get_all_free_blocks()
                for b in free:
                    q.remove(b)
                for b in ([free[-1], *free[:-1]] if change == "order" else [*free[1:], free[0]]):
                    q.append(b)
        return orig(self, blocks)

    monkeypatch.setattr(impl.BlockPool, "free_blocks", free_touching_another)
    at, found = _first(ImplTarget(), POOL, steps, incremental)
    assert at == 3 and found[0] == "ATOMIC_REJECT", found


@pytest.mark.parametrize("incremental", [False, True], ids=["full", "incremental"])
def test_a_lookup_that_reorders_the_free_queue_is_caught(monkeypatch, incremental):
    # A lookup changes nothing in the model, so the incremental check may skip the queue
    # comparison only if the target's queue did not change either (session's queue_may_differ).
    from kvspec import impl

    steps = [Alloc(2), Cache((1, 2), ("a", "b")), Free((1, 2)), Lookup("a")]
    assert _first(ImplTarget(), POOL, steps, incremental) == (None, [])
    orig = impl.BlockPool.get_cached_block

    def get_and_requeue(self, block_hash):
        b = orig(self, block_hash)
        if b is not None and b.ref_cnt == 0:  # move the free block to the tail: a new eviction order
            self.free_block_queue.remove(b)
            self.free_block_queue.append(b)
        return b

    monkeypatch.setattr(impl.BlockPool, "get_cached_block", get_and_requeue)
    assert _first(ImplTarget(), POOL, steps, incremental) == (3, ["EVICTION_ORDER"])


def test_a_freed_block_left_out_of_the_queue_is_an_i1_finding_first(monkeypatch):
    # I1 ranks before ACCOUNTING (which sees the same bug as a wrong free count): the
    # report must name the cause, a ref-0 block missing from the free queue.
    from kvspec import impl

    monkeypatch.setattr(impl.FreeKVCacheBlockQueue, "append_n", lambda self, blocks: None)
    out = run_steps(ImplTarget(), POOL, [Alloc(1), Free((1,))])
    assert out.invariant == "I1" and "has ref_cnt 0 but is not in the free queue" in out.violations[0].message


def test_a_block_allocated_out_of_order_is_not_called_a_deduplicated_block():
    # alloc_mru hands r1 another block than the model's: I4 and EVICTION_ORDER (what mc
    # names for this one-step repro), never I2, which is about one block held by two requests.
    out = run_steps(load_target("impl", patch=str(CORPUS / "alloc_mru.diff")), CACHE, [Admit("r1", (1, 2))])
    assert [v.invariant for v in out.violations] == ["I4", "EVICTION_ORDER"]


def test_the_incremental_sessions_live_state_is_what_the_target_shows_after_every_step():
    # What the incremental session commits (blocks, queue, index, free count) must equal a
    # full observation of the target, or the next step is checked against a wrong state.
    s = Session(ImplTarget(), POOL, incremental=True)
    steps = [Alloc(2), Cache((1, 2), ("a", "b")), Free((2, 1)), Lookup("a"), Touch((1,)), Alloc(3), Free((1,)),
             Alloc(1), Cache((1,), ("c",)), Free((1, 3)), Reset(), Alloc(4)]
    for op in steps:
        assert s.apply(op) == []
        assert s.obs == s.driver.observe(), op
    assert s.fast_steps > len(steps) // 2  # the incremental path is what was exercised


@pytest.mark.parametrize("incremental", [False, True], ids=["full", "incremental"])
def test_a_valid_op_that_raises_is_no_crash_in_both_modes(monkeypatch, incremental):
    from kvspec import impl

    def boom(self, n):
        raise RuntimeError("allocator bug")

    monkeypatch.setattr(impl.BlockPool, "get_new_blocks", boom)
    assert _first(ImplTarget(), POOL, [Alloc(1)], incremental) == (0, ["NO_CRASH"])


def test_a_free_count_above_the_queue_length_is_accounting(monkeypatch):
    from kvspec import impl

    orig = impl.FreeKVCacheBlockQueue.append_n

    def append_n_counting_one_more(self, blocks):
        orig(self, blocks)
        self.num_free_blocks += 1

    monkeypatch.setattr(impl.FreeKVCacheBlockQueue, "append_n", append_n_counting_one_more)
    out = run_steps(ImplTarget(), POOL, [Alloc(1), Free((1,))])
    assert out.invariant == "ACCOUNTING", [v.message for v in out.violations]


# -- ddmin's deterministic cap (max_tests: candidate replays instead of seconds) --------------
# no_evict's repro above with two lookups that ddmin can drop
LONG = [Alloc(1), Cache((1,), ("a",)), Lookup("b"), Free((1,)), Lookup("a"), Alloc(4)]


def test_ddmin_under_a_replay_cap_shortens_as_the_timed_one_does_and_keeps_to_the_cap(monkeypatch):
    from kvspec.check import minimize

    t = load_target("impl", patch=str(CORPUS / "no_evict.diff"))
    timed = minimize.ddmin(t, POOL, LONG, "I4")
    assert len(timed) < len(LONG) and minimize.fails_with(t, POOL, timed, "I4", False)
    assert minimize.ddmin(t, POOL, LONG, "I4", max_tests=minimize.DDMIN_MAX_TESTS) == timed
    calls = []
    orig = minimize.fails_with
    monkeypatch.setattr(minimize, "fails_with", lambda *a: calls.append(1) or orig(*a))
    # The cap is checked between rounds: the first round tries both halves' complements,
    # then two replays are spent and ddmin must stop.
    minimize.ddmin(t, POOL, LONG, "I4", max_tests=2)
    assert len(calls) == 2
    # a cap that a round overshoots still ends ddmin after that round, short of the minimum
    calls.clear()
    capped = minimize.ddmin(t, POOL, LONG, "I4", max_tests=3)
    assert len(capped) > len(timed) and 3 <= len(calls) <= 3 + len(LONG)


def test_ddmin_cuts_a_two_step_list_to_the_one_step_that_fails():
    from kvspec.check.minimize import ddmin

    t = load_target("impl", patch=str(CORPUS / "alloc_mru.diff"))
    assert ddmin(t, POOL, [Lookup("a"), Alloc(1)], "EVICTION_ORDER") == [Alloc(1)]


def test_fails_with_at_construction_names_exactly_that_invariant():
    from kvspec.check.minimize import fails_with

    t = load_target("impl", patch=str(CORPUS / "null_block_queued.diff"))
    assert fails_with(t, POOL, [], "NULL_BLOCK", False)
    assert not fails_with(t, POOL, [], "ACCOUNTING", False)  # sorts before NULL_BLOCK
    assert not fails_with(t, POOL, [Alloc(1)], "NULL_BLOCK", False)  # it fails before any step


@pytest.mark.parametrize("incremental", [False, True], ids=["full", "incremental"])
def test_a_pool_of_more_than_256_blocks_passes_a_clean_run(incremental):
    # CPython shares the int objects up to 256 only: a check comparing counts or ids with
    # `is` passes on small pools and fails on real ones.
    big = Config(level="pool", num_blocks=300)
    steps = [Alloc(280), Cache((1, 2), ("a", "b")), Free(tuple(range(1, 281))), Lookup("a"), Alloc(290)]
    assert _first(ImplTarget(), big, steps, incremental) == (None, [])


def test_a_target_that_cannot_be_built_in_time_is_a_target_error(monkeypatch):
    import time

    from kvspec.targets import watchdog
    from kvspec.errors import TargetError

    t = ImplTarget()
    orig = t.driver
    monkeypatch.setattr(t, "driver", lambda config: time.sleep(1.0) or orig(config))
    monkeypatch.setattr(watchdog, "_default", 0.2)
    with pytest.raises(TargetError, match="did not return within"):
        Session(t, POOL)


def test_a_prefix_hit_shorter_than_the_cache_holds_is_i4_not_max_hit(monkeypatch):
    # MAX_HIT is about hits that are too long; a hit that misses cached blocks is I4's.
    from kvspec import impl

    orig = impl.KVCacheManager.get_computed_blocks

    def one_block_less(self, request):
        blocks, n = orig(self, request)
        return (blocks[:-1], max(n - self.block_size, 0)) if blocks else (blocks, n)

    steps = [Admit("r1", (1, 2, 11, 12, 21)), Admit("r2", (1, 2, 11, 12, 22))]
    assert run_steps(ImplTarget(), CACHE, steps).violations == []
    monkeypatch.setattr(impl.KVCacheManager, "get_computed_blocks", one_block_less)
    out = run_steps(ImplTarget(), CACHE, steps)
    assert out.index == 1 and out.invariant == "I4", [v.invariant for v in out.violations]


def test_a_lookup_returning_an_uncached_block_is_i4(monkeypatch):
    from kvspec import impl

    steps = [Alloc(2), Cache((1,), ("a",)), Lookup("a")]
    assert run_steps(ImplTarget(), POOL, steps).violations == []
    monkeypatch.setattr(impl.BlockPool, "get_cached_block", lambda self, h: self.blocks[2])  # held, no hash
    out = run_steps(ImplTarget(), POOL, steps)
    assert out.index == 2 and out.invariant == "I4", [v.message for v in out.violations]


@pytest.mark.parametrize("incremental", [False, True], ids=["full", "incremental"])
def test_long_requests_pass_under_the_single_group_model(incremental):
    # Tables of several blocks, a shared prefix and decode steps under CacheModel: its KV
    # shadow and KV_INTEGRITY (block index p // block_size) must see impl as correct.
    big = Config(level="cache", num_blocks=12, block_size=2)
    steps = [Admit("r1", (1, 2, 11, 12, 21, 22, 31)), Step("r1", 5), Step("r1", 6), Admit("r2", (1, 2, 11, 12, 21, 9)),
             Step("r2", 7), Finish("r1"), Admit("r3", (1, 2, 11, 12, 21, 22, 31, 5, 6)), Preempt("r2")]
    assert _first(_plain(ImplTarget()), big, steps, incremental) == (None, [])


def test_a_hashed_partial_block_past_the_first_is_i3_and_says_how_full_it_is():
    # partial_cached with a chunk of 3 tokens: r1's block 1 holds token 2 only, yet is hashed.
    t = load_target("impl", patch=str(CORPUS / "partial_cached.diff"))
    out = run_steps(t, CACHE, [Admit("r1", (1, 2, 11, 12), chunk=3)])
    assert out.invariant == "I3"
    assert out.violations[0].message == "block 2 (block 1 of r1) is hashed but holds only 1 of 2 computed tokens"


def test_a_cache_level_session_keeps_a_kv_shadow_whatever_string_object_names_the_level():
    # Config.level may come from the command line (a new str, not the interned literal).
    level = "".join(["ca", "che"])
    assert Session(ImplTarget(), Config(level=level, num_blocks=7, block_size=2)).shadow is not None
    assert Session(ImplTarget(), POOL).shadow is None


def test_deepening_search_skips_a_pool_it_cannot_build_and_claims_no_proof():
    from kvspec.check.minimize import deepening_search

    t = load_target("impl", patch=str(CORPUS / "no_evict.diff"))
    found, cfg, complete = deepening_search(t, [Config(level="pool", num_blocks=0), POOL], 4, "I4", float("inf"))
    assert cfg == POOL and complete is False and run_steps(t, POOL, found).invariant == "I4"


def test_max_hit_names_a_whole_prompt_hit_and_a_hit_past_the_cached_prefix(monkeypatch):
    from kvspec import impl

    t = load_target("impl", patch=str(CORPUS / "full_prompt_hit.diff"))
    out = run_steps(t, CACHE, [Admit("r1", (1, 2)), Admit("r2", (1, 2))])
    assert out.invariant == "MAX_HIT" and "hit all 2 prompt tokens" in out.violations[0].message
    orig = impl.KVCacheManager.get_computed_blocks

    def one_block_more(self, request):  # claims a free block past the cached prefix as hit
        blocks, n = orig(self, request)
        if blocks and n + self.block_size < request.num_tokens:
            extra = next(b for b in self.block_pool.blocks[1:] if b.ref_cnt == 0 and b not in blocks)
            return blocks + [extra], n + self.block_size
        return blocks, n

    monkeypatch.setattr(impl.KVCacheManager, "get_computed_blocks", one_block_more)
    out = run_steps(ImplTarget(), CACHE, [Admit("r1", (1, 2, 11)), Finish("r1"), Admit("r2", (1, 2, 12, 13, 14))])
    assert "MAX_HIT" in {v.invariant for v in out.violations}
    assert any("but only 2 are cached" in v.message for v in out.violations)


def test_a_table_handed_out_in_another_order_is_eviction_order(monkeypatch):
    # The free queue ends the same; only the request's table shows the other policy.
    from kvspec import impl

    orig = impl.BlockPool.get_new_blocks
    monkeypatch.setattr(impl.BlockPool, "get_new_blocks", lambda self, n: list(reversed(orig(self, n))))
    out = run_steps(_plain(ImplTarget()), CACHE, [Admit("r1", (1, 2, 11, 12, 21))])
    assert any(v.invariant == "EVICTION_ORDER" and "r1 got blocks" in v.message for v in out.violations)


def test_an_observation_that_hangs_after_a_step_is_no_hang(monkeypatch):
    import time

    from kvspec.targets import watchdog

    monkeypatch.setattr(watchdog, "_default", 0.3)
    s = Session(ImplTarget(), POOL, incremental=False)
    orig = s.driver.observe
    monkeypatch.setattr(s.driver, "observe", lambda: time.sleep(1.5) or orig())
    assert [v.invariant for v in s.apply(Alloc(1))][:1] == ["NO_HANG"]


def test_a_shared_block_whose_ref_count_missed_a_holder_is_accounting(monkeypatch):
    from kvspec import impl

    monkeypatch.setattr(impl.BlockPool, "touch", lambda self, blocks: None)  # a hit that takes no reference
    out = run_steps(ImplTarget(), CACHE, [Admit("r1", (1, 2, 11)), Admit("r2", (1, 2, 12))])
    assert out.index == 1 and out.invariant == "ACCOUNTING" and "but 2 tables that hold it" in out.violations[0].message


# -- kvspec.spec.fast_check: the incremental check must vouch for correct steps ---------------
# A check that refuses a clean step only costs time (the session then goes the full way),
# so a mutant that makes fast_check over-cautious changes no finding: it shows only in
# Session.fast_steps, the number of steps the incremental check vouched for.
FAST_POOL = [Alloc(2), Cache((1, 2), ("a", "b")), Free((2,)), Alloc(1), Free((1,)), Lookup("a"), Touch((1,)),
             Free((1,)), Free((2,)), Alloc(3), Reset()]
FAST_CACHE = [Admit("r1", (1, 2, 11, 12, 21, 22, 31)), Step("r1", 5), Step("r1", 6), Admit("r2", (1, 2, 11, 12, 21, 9)),
              Step("r2", 7), Finish("r1"), Admit("r3", (1, 2, 11, 12, 21, 22, 31, 5, 6)), Preempt("r2")]


@pytest.mark.parametrize("level", ["pool", "cache"])
def test_the_incremental_check_vouches_for_every_step_of_a_clean_run(level):
    config, steps = (POOL, FAST_POOL) if level == "pool" else (Config(level="cache", num_blocks=12, block_size=2), FAST_CACHE)
    s = Session(_plain(ImplTarget()), config, incremental=True)
    assert s.incremental
    assert [(op, s.apply(op)) for op in steps] == [(op, []) for op in steps]
    assert s.fast_steps == len(steps)


def test_a_hashed_block_past_the_reported_computed_count_is_i3_in_both_modes():
    # The target hashes r1's two full blocks but reports 3 computed tokens, not 5: block 1
    # holds only 1 of them. Only the I3 check reads rs.computed; the model hashes both too.
    big = Config(level="cache", num_blocks=12, block_size=2)
    for incremental in (False, True):
        s = Session(_plain(ImplTarget()), big, incremental=incremental)
        orig = s.driver.apply

        def apply_low(op, drv=s.driver, orig=orig):
            r = orig(op)
            drv.reqs[op.req].num_computed_tokens -= 2
            return r

        s.driver.apply = apply_low
        assert [v.invariant for v in s.apply(Admit("r1", (1, 2, 11, 12, 21)))][:1] == ["I3"], incremental


# -- kvspec.mc.canonical ---------------------------------------------------------------------
def _key(config, steps, symmetry=True, target=None):
    from kvspec.mc.canonical import state_key

    s = Session(target or ImplTarget(), config)
    lens = {}
    for op in steps:
        assert not s.apply(op), op
        lens[op.req] = len(op.prompt)
    return state_key(s, {"prompt_lens": lens}, symmetry)


def test_requests_admitted_in_another_order_under_swapped_names_share_a_key():
    # r1 (1, 2) then r2 (5, 6), against r1 (5, 6) then r2 (1, 2): the same state with the
    # requests and their blocks renamed, but dict (admission) order ranks them differently.
    a, b = [Admit("r1", (1, 2)), Admit("r2", (5, 6))], [Admit("r1", (5, 6)), Admit("r2", (1, 2))]
    assert _key(CACHE, a) == _key(CACHE, b)
    assert _key(CACHE, a, symmetry=False) != _key(CACHE, b, symmetry=False)


def test_a_key_reads_every_kv_cache_groups_table():
    # With a sliding-window group, each request has a second table (GroupReq.more).
    cfg = Config(level="cache", num_blocks=9, block_size=2, kv_groups="full,swa:4")
    one, other = _key(cfg, [Admit("r1", (1, 2, 11))]), _key(cfg, [Admit("r1", (1, 2, 12))])
    assert one != other and _key(cfg, [Admit("r7", (1, 2, 11))]) == one


def test_an_observation_with_more_blocks_than_the_pool_keeps_them_in_the_key():
    # A target showing a block past the configured pool: states that differ only in it
    # must not share a key (nothing else flags the extra block).
    from dataclasses import replace

    from kvspec.mc.canonical import cache_key
    from kvspec.spec.observation import BlockState

    s = Session(ImplTarget(), CACHE)
    s.apply(Admit("r1", (1, 2, 11)))
    obs = s.obs
    free, held = (replace(obs, blocks=tuple(obs.blocks) + (BlockState(r, None, not r),)) for r in (0, 1))
    assert cache_key(s.model, free, s.hashes, s.shadow, {"r1": 3}) != cache_key(s.model, held, s.hashes, s.shadow, {"r1": 3})


# -- kvspec.mc.search ------------------------------------------------------------------------
def test_the_memory_cap_stops_a_search_that_grew_past_it(monkeypatch):
    # The process seems to grow by 3 GiB once the search starts: a 2 GiB cap must stop it
    # (at the first memory look, 64 expanded states in) as incomplete, with its rates reported.
    from kvspec.mc import budget, search

    calls = []
    monkeypatch.setattr(budget, "rss_bytes", lambda: 0 if calls.append(1) or len(calls) == 1 else 3 * 2**30)
    res = search.model_check(ImplTarget(), POOL, 4, mem_cap_gib=2.0)
    assert res.verdict == "incomplete" and res.reason.startswith("memory cap of 2 GiB"), (res.verdict, res.reason)
    d = res.to_dict()
    assert d["transitions_per_second"] == round(res.transitions / res.seconds, 1) and d["peak_rss_mib"] == 3 * 2**10


def test_rss_bytes_reads_whole_pages_of_a_live_process():
    import os

    from kvspec.mc.search import rss_bytes

    if not os.path.exists("/proc/self/statm"):
        pytest.skip("rss_bytes reads Linux's /proc/self/statm, absent here")
    rss = rss_bytes()
    assert rss >= 2**20 and rss % os.sysconf("SC_PAGE_SIZE") == 0   # a Python process holds over 1 MiB


def test_a_search_for_one_invariant_matches_only_the_first_failure_at_construction(monkeypatch):
    # A pool built with a queued block whose ref_cnt is 1 fails at once, first I1, then others.
    from kvspec import impl
    from kvspec.mc.search import model_check

    orig = impl.BlockPool.__init__

    def held_but_queued(self, *a, **k):
        orig(self, *a, **k)
        self.blocks[2].ref_cnt = 1

    monkeypatch.setattr(impl.BlockPool, "__init__", held_but_queued)
    first = Session(ImplTarget(), POOL).initial
    assert first[0].invariant == "I1" and first[-1].invariant != "I1"
    hit = model_check(ImplTarget(), POOL, 2, invariant="I1")
    assert hit.verdict == "violation" and hit.counterexample == [] and hit.invariant == "I1"
    # a search for an invariant that is not the first (whatever its name's order) finds nothing
    assert model_check(ImplTarget(), POOL, 2, invariant="I4").verdict == "pass"


def test_pool_searches_compute_each_states_enabled_ops_once_per_ops_key(monkeypatch):
    # Only speed rides on the memo (a miss recomputes the same ops), so count the misses.
    from kvspec.mc import search

    keys, calls = [], []
    orig_key, orig_ops = search.pool_ops_key, search.enabled_ops
    monkeypatch.setattr(search, "pool_ops_key", lambda *a: keys.append(orig_key(*a)) or keys[-1])
    monkeypatch.setattr(search, "enabled_ops", lambda *a, **k: calls.append(1) or orig_ops(*a, **k))
    res = search.model_check(ImplTarget(), POOL, 4)  # depth 4: 103 lookups of 90 ops keys
    assert res.verdict == "pass" and None not in keys
    assert len(calls) == len(set(keys)) < len(keys)
