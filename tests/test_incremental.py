"""The incremental checker reports exactly what the full checker reports.

Two sessions run side by side on every generated op, one observing and checking the
whole pool after each step (the reference), one from deltas: their findings (ids,
messages and state excerpts) and their observations must be equal after every step.
They run on the unpatched allocator and on every impl corpus patch, at both levels,
with misuse on, and on through violations (the session falls back to the full path
and resumes incremental checking once a state is clean again).
"""
from __future__ import annotations

import copy
import dataclasses
import json
import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, settings, strategies as st
from hypothesis.stateful import run_state_machine_as_test

from kvspec.spec.config import Config
from kvspec.spec.observation import HEAD, TAIL, splice_walk
from kvspec.check.session import Session
from kvspec.stateful import cache_machine, pool_machine
from kvspec.targets import load_target

CORPUS = Path(__file__).resolve().parents[1] / "kvspec" / "corpus" / "impl"
BUGS = json.loads((CORPUS / "bugs.json").read_text())
TOTALS = {"fast": 0, "steps": 0}


def lockstep(factory, target, sizes):
    if factory is cache_machine and getattr(target.traits, "cache_features", False):
        # The group-aware model (KV-cache groups, drafts, ...) always takes the full path:
        # the incremental one is checked on the single-group model it was built for.
        target = copy.copy(target)
        target.traits = dataclasses.replace(target.traits, cache_features=False)
    base = factory(target, misuse=True, sizes=sizes)

    class Lockstep(base):
        def start(self, config):
            self.session = Session(self.target, config, incremental=False)
            self.twin = Session(self.target, config, incremental=True)
            assert self.twin.initial == self.session.initial
            assert self.twin.incremental

        def run(self, op):
            full, inc = self.session.apply(op), self.twin.apply(op)
            TOTALS["steps"] += 1
            assert inc == full, f"after {self.session.steps}: incremental {inc} != full {full}"
            assert self.twin.obs == self.session.obs, f"observations differ after {self.session.steps}"

    Lockstep.__name__ = f"Lockstep{base.__name__}"
    return Lockstep


def _run(target, level, sizes, examples, steps=40, seed=0):
    machine = lockstep(cache_machine if level == "cache" else pool_machine, target, sizes)
    fast_before = _fast_total()
    run_state_machine_as_test(machine, settings=settings(
        max_examples=examples, stateful_step_count=steps, deadline=None, database=None, derandomize=True,
        phases=(Phase.generate,), suppress_health_check=list(HealthCheck)))
    return _fast_total() - fast_before


def _fast_total() -> int:
    return TOTALS["fast"]


@pytest.fixture(autouse=True)
def _count_fast_steps(monkeypatch):
    """Count the steps the incremental path vouched for, so the tests can tell that it ran."""
    orig = Session._fast

    def counted(self, *a, **kw):
        ok = orig(self, *a, **kw)
        TOTALS["fast"] += bool(ok)
        return ok

    monkeypatch.setattr(Session, "_fast", counted)


@pytest.mark.parametrize("level", ["pool", "cache"])
def test_same_findings_on_the_unpatched_allocator(level):
    fast = _run(load_target("impl"), level, st.integers(4, 12), examples=40)
    # the incremental path really ran: over a hundred steps (misuse steps, the scheduler's
    # at cache level included, always take the full path)
    assert fast > 100


@pytest.mark.parametrize("level", ["pool", "cache"])
def test_same_findings_on_larger_pools(level):
    # long queues: the walk splices long unchanged runs
    steps_before = TOTALS["steps"]
    fast = _run(load_target("impl"), level, st.integers(60, 200), examples=8, steps=80)
    # misuse, refused and not-comparable steps always take the full path, so only a share of
    # the steps are fast: 16% at the cache level and more at the pool level with these
    # derandomized draws; a tenth says the incremental path carries long queues, not a rate
    assert fast >= 0.1 * (TOTALS["steps"] - steps_before)


@pytest.mark.parametrize("bug", [b["id"] for b in BUGS])
def test_same_findings_on_every_corpus_patch(bug):
    meta = {b["id"]: b for b in BUGS}[bug]
    target = load_target("impl", patch=str(CORPUS / meta["file"]))
    for level in target.traits.levels:
        _run(target, level, st.integers(4, 9), examples=12, steps=30)


def test_sessions_stay_apart_from_the_full_path_only_where_they_must():
    """A long clean run goes the incremental way; a violation goes the full way, and the
    session resumes incremental checking afterwards."""
    target = load_target("impl", patch=str(CORPUS / "no_evict.diff"))
    from kvspec.spec.ops import Alloc, Cache, Free

    s = Session(target, Config(level="pool", num_blocks=6), incremental=True)
    ops = [Alloc(2), Cache((1, 2), ("a", "b")), Free((2, 1))]
    assert all(s.apply(op) == [] for op in ops) and s.fast_steps == 3
    found = s.apply(Alloc(5))  # pops cached blocks without evicting them: I4
    assert found and found[0].invariant == "I4" and s.fast_steps == 3
    ref = run_full(target, Config(level="pool", num_blocks=6), ops + [Alloc(5)])
    assert found == ref


def run_full(target, config, ops):
    s = Session(target, config, incremental=False)
    out = []
    for op in ops:
        out = s.apply(op)
    return out


def test_default_is_full_on_small_pools_and_incremental_on_large_ones(monkeypatch):
    monkeypatch.delenv("KVSPEC_INCREMENTAL", raising=False)
    t = load_target("impl")
    assert not Session(t, Config(level="pool", num_blocks=8)).incremental
    assert Session(t, Config(level="pool", num_blocks=1024)).incremental
    monkeypatch.setenv("KVSPEC_INCREMENTAL", "1")
    assert Session(t, Config(level="pool", num_blocks=8)).incremental
    monkeypatch.setenv("KVSPEC_INCREMENTAL", "0")
    assert not Session(t, Config(level="pool", num_blocks=1024)).incremental


def test_a_driver_without_deltas_keeps_the_full_path():
    t = load_target("impl")
    s = Session(t, Config(level="pool", num_blocks=128), incremental=True)
    assert s.incremental

    class Plain:  # the Driver interface only: apply and observe
        def __init__(self, d):
            self.d = d

        def apply(self, op):
            return self.d.apply(op)

        def observe(self):
            return self.d.observe()

    orig = type(t).driver
    try:
        type(t).driver = lambda self, config: Plain(orig(self, config))
        s = Session(t, Config(level="pool", num_blocks=128), incremental=True)
        assert not s.incremental
    finally:
        type(t).driver = orig


# -- the walk, against a plain walk of the same links -------------------------------
def naive_walk(n, nxt, prv, head_next, tail_prev):
    """Follow the links from the head as observe_pool does; None on any problem."""
    out, before, cur = [], HEAD, head_next
    while cur != TAIL:
        if cur is None or not 0 <= cur < n or len(out) > n:
            return None
        if prv.get(cur) != before:
            return None
        out.append(cur)
        before, cur = cur, nxt.get(cur)
    return out if tail_prev == before and len(set(out)) == len(out) else None


@pytest.mark.parametrize("seed", range(300))
def test_splice_walk_agrees_with_a_plain_walk(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 30)
    prev = rng.sample(range(n), rng.randint(0, n))
    nxt, prv = {}, {}
    chain = [HEAD] + prev + [TAIL]
    for a, b in zip(chain, chain[1:]):
        nxt[a], prv[b] = b, a
    head_next, tail_prev = nxt[HEAD], prv[TAIL]
    # the op: rewrite the links of a few blocks (a real relink most of the time, noise sometimes)
    new = list(prev)
    for _ in range(rng.randint(0, 3)):
        r = rng.random()
        if r < 0.3 and new:
            new.pop(rng.randrange(len(new)))
        elif r < 0.6:
            x = rng.randrange(n)
            if x not in new:
                new.insert(rng.choice([0, len(new)]), x)
        elif new:
            new.pop(0)
    written = set()
    chain = [HEAD] + new + [TAIL]
    for a, b in zip(chain, chain[1:]):
        if nxt.get(a) != b:
            nxt[a] = b
            written.add(a)
        if prv.get(b) != a:
            prv[b] = a
            written.add(b)
    for x in set(prev) - set(new):
        nxt[x], prv[x] = None, None
        written.add(x)
    if rng.random() < 0.3:  # a stray write: corrupt one link
        x = rng.randrange(n)
        (nxt if rng.random() < 0.5 else prv)[x] = rng.choice([None, HEAD, TAIL, rng.randrange(n)])
        written.add(x)
    head_next, tail_prev = nxt[HEAD], prv[TAIL]
    links = {b: (prv.get(b), nxt.get(b)) for b in written if b >= 0}
    queued = set(prev)
    got = splice_walk(prev, queued.__contains__, n, links, head_next, tail_prev)
    want = naive_walk(n, nxt, prv, head_next, tail_prev)
    if got is not None:
        queue, visited, left = got
        assert queue == want
        assert sorted(left) == sorted(queued - set(queue))
        assert visited == set(queue) & set(links)
