"""Tests that fail when kvspec's own checker is broken (issue 13's probes).

Each probe pairs a known-buggy target (impl with a monkeypatched method, a corpus patch,
or a small class written here) with kvspec's check: flagged with the check intact, and
no longer flagged once the test breaks that check with monkeypatch. The second half
shows the first half is what a broken checker would fail. Nothing here needs vLLM or
nano-vllm; searches are bounded by example counts, never seconds.
"""
import dataclasses
import time
from pathlib import Path

import pytest

import kvspec.check.session as session_mod
import kvspec.spec.invariants as inv
from kvspec.targets import watchdog
from kvspec.check.minimize import ddmin, deepening_search, fails_with, minimize_finding
from kvspec.check.session import Session, run_steps
from kvspec.spec.config import Config
from kvspec.spec.observation import RequestState
from kvspec.spec.ops import Admit, Alloc, Cache, Free, Lookup, Preempt, Step, Touch
from kvspec.targets.impl_target import ImplTarget
from kvspec.targets.registry import load_target

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "kvspec" / "corpus" / "impl"
POOL = Config(level="pool", num_blocks=5)
CACHE = Config(level="cache", num_blocks=8, block_size=2)


def _found(target, config, steps) -> set:
    """Every invariant the step list's first failing step violates (empty: it passes)."""
    return {v.invariant for v in run_steps(target, config, steps).violations}


def _without(monkeypatch, fn) -> None:
    """Break kvspec: drop one check from the catalogue's list."""
    monkeypatch.setattr(inv, "CHECKS", [c for c in inv.CHECKS if c is not fn])


@pytest.fixture
def impl_mod():
    from kvspec import impl
    return impl


# -- I4: a lookup returns a block cached under the hash looked up ------------------------------
def test_lookup_returning_another_hashs_block_is_caught(monkeypatch, impl_mod):
    def wrong_block(self, block_hash):
        for h, blocks in self.cached_block_hash_to_block.items():  # any other cached hash's block
            if h != block_hash:
                return next(iter(blocks.values())) if isinstance(blocks, dict) else blocks
        return None

    steps = [Alloc(2), Cache((1, 2), ("a", "b")), Lookup("a")]
    assert _found(ImplTarget(), POOL, steps) == set()  # the unbroken pool passes
    monkeypatch.setattr(impl_mod.BlockPool, "get_cached_block", wrong_block)
    assert "I4" in _found(ImplTarget(), POOL, steps)
    _without(monkeypatch, inv.cached_evictable)
    assert _found(ImplTarget(), POOL, steps) == set()  # only I4's hash comparison saw it


# -- I1: a block out of the queue keeps no links --------------------------------------------
def test_stale_links_on_a_removed_block_are_caught(monkeypatch, impl_mod):
    orig = impl_mod.FreeKVCacheBlockQueue.remove

    def remove_keeping_links(self, block):
        prev, nxt = block.prev_free_block, block.next_free_block
        orig(self, block)
        block.prev_free_block, block.next_free_block = prev, nxt  # left dangling

    steps = [Alloc(1), Cache((1,), ("a",)), Free((1,)), Touch((1,))]
    assert _found(ImplTarget(), POOL, steps) == set()
    monkeypatch.setattr(impl_mod.FreeKVCacheBlockQueue, "remove", remove_keeping_links)
    out = run_steps(ImplTarget(), POOL, steps)
    assert out.invariant == "I1" and "still has prev/next links" in out.violations[0].message
    _without(monkeypatch, inv.queue_iff_free)
    assert _found(ImplTarget(), POOL, steps) == set()


# -- ATOMIC_REJECT: the state comparison, and the exception class -------------------------------
def test_a_rejected_misuse_that_changed_the_state_is_caught(monkeypatch, impl_mod):
    orig = impl_mod.BlockPool.free_blocks

    def leaky_free(self, blocks):
        blocks = list(blocks)
        if any(b.ref_cnt == 0 for b in blocks) and self.get_num_free_blocks():
            self.get_new_blocks(1)  # state changed before the documented error is raised
        return orig(self, blocks)

    steps = [Alloc(1), Free((1,)), Free((1,))]  # the second free is a double free
    assert _found(ImplTarget(), POOL, steps) == set()  # impl rejects it cleanly
    monkeypatch.setattr(impl_mod.BlockPool, "free_blocks", leaky_free)
    out = run_steps(ImplTarget(), POOL, steps)
    assert out.invariant == "ATOMIC_REJECT" and "changed the state" in out.violations[0].message
    monkeypatch.setattr(inv, "_state", lambda o: ())  # break the state comparison only
    assert _found(ImplTarget(), POOL, steps) == set()


def test_a_misuse_rejected_with_the_wrong_exception_class_is_caught(monkeypatch, impl_mod):
    orig = impl_mod.BlockPool.get_new_blocks

    def asserting_get(self, n):
        assert n <= self.get_num_free_blocks(), "not enough blocks"  # documented: a KVCacheError
        return orig(self, n)

    steps = [Alloc(99)]
    monkeypatch.setattr(impl_mod.BlockPool, "get_new_blocks", asserting_get)
    out = run_steps(ImplTarget(), POOL, steps)
    assert out.invariant == "ATOMIC_REJECT" and "AssertionError" in out.violations[0].message
    monkeypatch.setattr(inv, "documented_errors", lambda traits, misuse: ())  # break the class check
    assert _found(ImplTarget(), POOL, steps) == set()


# -- I2 and KV_INTEGRITY, at the cache level, on impl's KVCacheManager ----------------------------
def _after(steps, config=CACHE) -> Session:
    s = Session(ImplTarget(), config, incremental=False)
    for op in steps:
        assert s.apply(op) == []
    return s


def test_a_block_table_changing_under_its_request_is_caught(monkeypatch):
    s = _after([Admit("r1", (1, 2, 3, 4, 5))])
    table = s.obs.requests["r1"].table
    spare = next(b for b in s.obs.usable_ids() if b not in table)
    moved = dataclasses.replace(s.obs, requests={"r1": RequestState((spare,) + tuple(table[1:]),
                                                                    s.obs.requests["r1"].computed)})
    ctx = s._context(Preempt("other"), moved, None, None, None, None)  # the target's table moved
    assert "I2" in {v.invariant for v in inv.check_step(ctx)}
    _without(monkeypatch, inv.stable_ids)
    assert "I2" not in {v.invariant for v in inv.check_step(ctx)}


def test_a_slot_holding_another_prefix_is_caught(monkeypatch):
    s = _after([Admit("r1", (1, 2, 3, 4, 5))])
    rs = s.obs.requests["r1"]
    s.shadow.slots[(rs.table[1], 0)] = (9, 9, 9)  # the KV there was computed for another prefix
    ctx = s._context(Preempt("other"), s.obs, None, None, None, None)
    assert [v.invariant for v in inv.check_step(ctx)] == ["KV_INTEGRITY"]
    _without(monkeypatch, inv.kv_integrity)
    assert inv.check_step(ctx) == []


def test_kv_integrity_on_a_corpus_patch_that_serves_a_wrong_hit():
    # hash_parent_first hashes the parent after the tokens: prefixes collide, and a
    # request reads KV of another prefix; KV_INTEGRITY is among what the check reports.
    from kvspec.check.search import run_check
    t = load_target("impl", patch=str(CORPUS / "hash_parent_first.diff"))
    report = run_check(t, "impl", level="cache", seed=0, max_examples=300, report_dir=str(ROOT / "reports" / "repros"))
    assert report.violations, "not found in 300 examples"
    seen = {v.invariant for f in report.violations for v in f.violations}
    assert seen & {"HASH_CHAIN", "MAX_HIT", "KV_INTEGRITY"}


# -- the model's policy traits -------------------------------------------------------------
def test_the_models_unhashed_blocks_first_trait_is_needed(monkeypatch):
    target = load_target("impl", patch=str(CORPUS / "policy_unhashed_first.diff"))
    assert target.traits.unhashed_free_first
    steps = [Alloc(3), Cache((1,), ("a",)), Free((1, 2, 3))]
    assert _found(target, POOL, steps) == set()  # the model follows the declared policy
    orig = session_mod.model_for

    def model_ignoring_the_trait(config, traits):
        m = orig(config, traits)
        (m.pool if hasattr(m, "pool") else m).unhashed_first = False
        return m

    monkeypatch.setattr(session_mod, "model_for", model_ignoring_the_trait)
    assert "EVICTION_ORDER" in _found(target, POOL, steps)


# -- the minimizer: ddmin shortens, and "minimal" only after a complete search -----------------
# ref_not_decremented: a free leaves the ref count as it was. Eight steps of noise, then the
# free that fails (fails_with wants the failure at the last step).
LONG = [Alloc(1), Cache((1,), ("a",)), Lookup("a"), Touch((1,)), Lookup("b"), Alloc(2), Lookup("a"), Touch((1,)),
        Free((2,))]


def test_ddmin_shortens_a_long_failing_sequence():
    t = load_target("impl", patch=str(CORPUS / "ref_not_decremented.diff"))
    inv_id = run_steps(t, POOL, LONG).invariant
    assert inv_id is not None and fails_with(t, POOL, LONG, inv_id, False)
    assert run_steps(t, POOL, LONG).index == len(LONG) - 1
    out = ddmin(t, POOL, LONG, inv_id, budget_s=float("inf"))
    assert len(out) <= 2 and fails_with(t, POOL, out, inv_id, False)
    for i in range(len(out)):  # 1-minimal: no single step can go
        assert not fails_with(t, POOL, out[:i] + out[i + 1:], inv_id, False)


def test_minimal_is_claimed_only_after_a_complete_search(monkeypatch):
    import kvspec.mc.search as mc

    t = load_target("impl", patch=str(CORPUS / "ref_not_decremented.diff"))
    inv_id = run_steps(t, POOL, LONG).invariant
    _, minimal, _ = minimize_finding(t, POOL, LONG, inv_id, deterministic=True)
    assert minimal is True  # the complete search proves it
    real = mc.model_check

    def first_pool_runs_out(target, config, *a, **kw):  # as if one pool hit the memory cap
        r = real(target, config, *a, **kw)
        if config.num_blocks == 2 and r.verdict == "pass":
            r.verdict, r.reason = "incomplete", "memory cap (simulated)"
        return r

    monkeypatch.setattr(mc, "model_check", first_pool_runs_out)
    found, cfg, complete = deepening_search(t, [dataclasses.replace(POOL, num_blocks=n) for n in (2, 5)], 3,
                                            inv_id, float("inf"))
    assert found is not None and complete is False
    _, minimal, _ = minimize_finding(t, POOL, LONG, inv_id, deterministic=True)
    assert minimal is None


# -- nano-vllm-style: the observed index is the manager's own ---------------------------------
NANO = ROOT / "examples" / "my_block_manager.py"
FORGETS = ("            self._cache(table[-1], seq.block(len(table) - 1), prefix)\n",
           "            blk = self.blocks[table[-1]]  # hashed, but never put in hash_to_block_id\n"
           "            blk.hash = self.compute_hash(seq.block(len(table) - 1), prefix)\n"
           "            blk.token_ids = list(seq.block(len(table) - 1))\n")


def test_a_manager_that_forgets_to_index_decode_filled_blocks_is_caught(tmp_path, monkeypatch):
    from kvspec.targets import nanovllm_target

    src = NANO.read_text()
    assert FORGETS[0] in src
    f = tmp_path / "forgets_index.py"
    f.write_text(src.replace(FORGETS[0], FORGETS[1]))
    target = load_target(f"{f}:BlockManager")
    steps = [Admit("r1", (1, 2, 3)), Step("r1", 4)]  # the step fills block 1 by decode
    assert _found(load_target(f"{NANO}:BlockManager"), CACHE, steps) == set()
    assert "INDEX_CONSISTENT" in _found(target, CACHE, steps)

    # An adapter that pads the index with every held hashed block hides it.
    driver_cls = type(target.driver(CACHE))
    orig = driver_cls.observe

    def padded(self):
        o = orig(self)
        index = {h: tuple(v) for h, v in o.index.items()}
        for b, s in enumerate(o.blocks):
            if s.hash is not None and b not in index.get(s.hash, ()):
                index[s.hash] = index.get(s.hash, ()) + (b,)
        return dataclasses.replace(o, index=index)

    monkeypatch.setattr(driver_cls, "observe", padded)
    assert "INDEX_CONSISTENT" not in _found(target, CACHE, steps)
    assert nanovllm_target  # (the adapter module under test)


# -- NO_HANG: a call that never returns ----------------------------------------------------
def test_a_hanging_call_is_a_no_hang_finding(monkeypatch, impl_mod):
    def hanging_free(self, blocks):
        time.sleep(3600)

    monkeypatch.setattr(impl_mod.BlockPool, "free_blocks", hanging_free)
    monkeypatch.setattr(watchdog, "_default", 0.5)
    out = run_steps(ImplTarget(), POOL, [Alloc(1), Free((1,)), Alloc(1)])
    assert out.index == 1 and out.invariant == "NO_HANG"
