"""kvspec.spec.fast_pool (the pool level's transition checks in one pass) against the
catalogue: it may only say "clean" where every transition check of the catalogue finds
nothing, and then it must record exactly the hash-history pairs HASH_CHAIN records.

The steps come from random walks of impl and of corpus bugs at pool level (misuses
included), and from targeted corruptions of them (one per condition of the fast pass);
and every condition is shown to matter: a copy of the module with that one condition
switched off lets a violation through on these steps.
"""
import copy
import random
import re
from pathlib import Path

import pytest

from kvspec.check.session import Session
from kvspec.mc.enumerate_ops import Bounds, enabled_ops
from kvspec.mc.split import StepChecker
from kvspec.spec import fast_pool, invariants
from kvspec.spec.invariants import CHECKS, check_step
from kvspec.spec.observation import BlockState
from kvspec.spec.ops import Alloc, Lookup, Reset
from kvspec.spec.shadow import HashMap

from test_mc import patched, pool  # noqa: E402  (fixture helpers)
from kvspec.targets import load_target

TRANSITION = [CHECKS[i] for i in StepChecker(fast=False).transition_idx]
BUGS = ["null_block_queued", "ref_not_decremented", "reset_keeps_index", "stale_index", "free_reversed_pool",
        "cache_overwrites_dupes", "evict_pops_wrong_dupe", "no_evict", "policy_mru"]


def _capture(target, usable: int, walks: int, length: int, seed: int) -> list:
    """Contexts of real steps (deep copies taken before the check ran; config and traits shared)."""
    rng = random.Random(seed)
    out: list = []
    cfg = pool(usable)
    for _ in range(walks):
        s = Session(target, cfg)
        shared = {id(s.config): s.config, id(s.traits): s.traits}

        def record(ctx):
            out.append(copy.deepcopy(ctx, dict(shared)))
            return check_step(ctx)
        s.step_check = record
        for _ in range(length):
            ops = enabled_ops(s.model, cfg, Bounds(misuse=True), used_labels=s.hashes.k2t.keys())
            if s.apply(rng.choice(ops)):
                break
    return out


@pytest.fixture(scope="module")
def steps() -> list:
    out = _capture(load_target("impl"), 3, 30, 10, 1) + _capture(load_target("impl"), 4, 10, 12, 2)
    for i, bug in enumerate(BUGS):
        out += _capture(patched(bug), 3, 6, 8, 10 + i)
    return out


def _set_block(obs, b, **kw):
    blocks = list(obs.blocks)
    blocks[b] = BlockState(**{**blocks[b].__dict__, **kw})
    return blocks


def _replace(ctx, **kw):
    c = copy.copy(ctx)
    c.__dict__.update(kw)
    return c


def _obs(o, **kw):
    c = copy.copy(o)
    object.__setattr__(c, "__dict__", {**o.__dict__, **kw})
    return c


def corruptions(ctx, rng):
    """Steps made from ``ctx``, each breaking one thing a transition check looks at."""
    o, p, m = ctx.obs, ctx.prev, ctx.model
    usable = list(o.usable_ids())
    b = rng.choice(usable)
    yield _replace(ctx, error=RuntimeError("boom"))
    yield _replace(ctx, misuse="a misuse")
    if isinstance(ctx.op, Alloc):
        yield _replace(ctx, result=tuple(reversed(ctx.result or ())) + (b,))
        yield _replace(ctx, result=(0,) + tuple(ctx.result or ()), expected=(0,) + tuple(ctx.expected or ()))
    if isinstance(ctx.op, Reset):
        yield _replace(ctx, result=not ctx.result)
    if isinstance(ctx.op, Lookup):
        yield _replace(ctx, result=None if ctx.result is not None else b)
        if ctx.result is not None:
            yield _replace(ctx, result=len(o.blocks) + 3)
            yield _replace(ctx, result=ctx.result - len(o.blocks))   # the same block, by a negative index
            other = [x for x in usable if m.hash[x] != ctx.op.hash]
            if other:
                yield _replace(ctx, result=rng.choice(other))
    yield _replace(ctx, obs=_obs(o, queue=tuple(o.queue) + (0,)))
    yield _replace(ctx, obs=_obs(o, blocks=tuple(_set_block(o, 0, hash=b"null"))))
    yield _replace(ctx, obs=_obs(o, index={**o.index, b"x": (0,)}))
    yield _replace(ctx, obs=_obs(o, index={**o.index, None: (0,)}))   # (the null block's own hash, None)
    yield _replace(ctx, obs=_obs(o, index={**o.index, b"orphan": (b,)}))   # an entry no block's hash matches
    if len(o.queue) > 1:
        yield _replace(ctx, obs=_obs(o, queue=tuple(reversed(o.queue))))
    for h, ids in o.index.items():   # INDEX_CONSISTENT: an entry dropped, an entry naming another block
        yield _replace(ctx, obs=_obs(o, index={k: v for k, v in o.index.items() if k != h}))
        others = [x for x in usable if x not in ids]
        if others:
            yield _replace(ctx, obs=_obs(o, index={**o.index, h: (rng.choice(others),)}))
        break
    yield _replace(ctx, obs=_obs(o, blocks=tuple(_set_block(o, b, hash=None if o.blocks[b].hash else b"h"))))
    # the same with the index kept consistent (so that only I4 / I3 can see it)
    h = o.blocks[b].hash
    if h is None:
        index = {**o.index, b"h": (b,)}
    else:
        index = {k: v for k, v in ((k, tuple(x for x in v if x != b)) for k, v in o.index.items()) if v}
    yield _replace(ctx, obs=_obs(o, blocks=tuple(_set_block(o, b, hash=None if h else b"h")), index=index))
    yield _replace(ctx, obs=_obs(o, blocks=tuple(_set_block(o, b, ref=o.blocks[b].ref + 1))))
    if o.blocks[b].ref > 0:
        yield _replace(ctx, prev=_obs(p, blocks=tuple(_set_block(p, b, ref=1, hash=b"other"))))
    if ctx.hashes is not None:
        hashed = [x for x in usable if o.blocks[x].hash is not None and m.hash[x] is not None]
        if hashed:
            x = rng.choice(hashed)
            h1 = copy.deepcopy(ctx.hashes)
            h1.t2k[o.blocks[x].hash] = "another label"
            yield _replace(ctx, hashes=h1)
            h2 = copy.deepcopy(ctx.hashes)
            h2.k2t[m.hash[x]] = b"another hash"
            yield _replace(ctx, hashes=h2)


def _verdicts(clean_fn, ctx) -> tuple:
    """(fast says clean, what the catalogue's transition checks find, the two hash histories)."""
    full_ctx = _replace(ctx, hashes=copy.deepcopy(ctx.hashes))
    fast_hashes = copy.deepcopy(ctx.hashes)
    try:
        found = [v for fn in TRANSITION for v in fn(full_ctx)]
    except Exception as e:   # the catalogue raises on this state: the fast pass must not vouch for it
        found = [repr(e)]
    pairs = clean_fn(_replace(ctx, hashes=fast_hashes))
    if pairs is not None and fast_hashes is not None:
        fast_pool.commit(fast_hashes, pairs)
    return pairs is not None, found, full_ctx.hashes, fast_hashes


def _unsound(clean_fn, ctxs, rng) -> list:
    bad = []
    for ctx in ctxs:
        for c in [ctx] + list(corruptions(ctx, rng)):
            clean, found, hist_full, hist_fast = _verdicts(clean_fn, c)
            if clean and (found or (hist_full is not None and (hist_full.t2k, hist_full.k2t)
                                    != (hist_fast.t2k, hist_fast.k2t))):
                bad.append((c.op, found))
    return bad


def test_the_fast_pass_stands_for_every_transition_check():
    # every transition check is in the one pass, or run beside it (StepChecker.beside)
    checker = StepChecker()
    beside = {invariants.CHECKS[i].__name__ for i in checker.beside}
    assert fast_pool.covers(fn.__name__ for fn in TRANSITION if fn.__name__ not in beside)
    assert beside == set()   # INDEX_CONSISTENT too is in the one pass now
    assert checker.fast is not None and StepChecker(fast=False).fast is None


def test_a_clean_answer_is_the_catalogues_and_records_the_same_pairs(steps):
    rng = random.Random(7)
    assert _unsound(fast_pool.pool_transition_clean, steps, rng) == []
    # and it is not vacuous: it vouches for most real steps, and refuses the failing ones
    verdicts = [_verdicts(fast_pool.pool_transition_clean, c) for c in steps]
    valid_clean = [clean for c, (clean, found, *_) in zip(steps, verdicts)
                   if c.misuse is None and c.error is None and not found]
    assert len(valid_clean) > len(steps) // 3 and sum(valid_clean) > 0.9 * len(valid_clean)
    assert any(found for _, found, *_ in verdicts)
    hist = HashMap()
    assert fast_pool.pool_transition_clean(_replace(steps[0], hashes=hist)) is None or hist.t2k == {}


def _mutants() -> list:
    """(line, source) for each condition of ``_clean`` switched off: a ``return None``
    that guards a finding becomes ``pass``."""
    src = Path(fast_pool.__file__).read_text()
    lines = src.split("\n")
    start = next(i for i, ln in enumerate(lines) if ln.startswith("def _clean("))
    out = []
    for i in range(start, len(lines)):
        ln = lines[i]
        if "return None" not in ln or "not the pool level" in ln or "# shape" in ln or "kept as a guard" in ln:
            continue
        out.append((ln.strip(), "\n".join(lines[:i] + [re.sub(r"return None", "pass", ln, count=1)] + lines[i + 1:])))
    return out


MUTANTS = _mutants()


@pytest.mark.parametrize("line", [m[0] for m in MUTANTS])
def test_switching_a_condition_off_lets_a_violation_through(steps, line):
    src = dict(MUTANTS)[line]
    ns: dict = {"__name__": "fast_pool_mutant"}
    exec(compile(src, "<fast_pool mutant>", "exec"), ns)
    assert _unsound(ns["pool_transition_clean"], steps, random.Random(7)), f"nothing caught the mutant without: {line}"


def test_the_search_is_the_same_with_and_without_the_fast_pass():
    from kvspec.mc.search import model_check
    import kvspec.mc.split as split

    a = model_check(load_target("impl"), pool(3), 6)
    orig = split.StepChecker.__init__

    def slow(self, fast=True):
        orig(self, fast=False)
    split.StepChecker.__init__ = slow
    try:
        b = model_check(load_target("impl"), pool(3), 6)
    finally:
        split.StepChecker.__init__ = orig
    assert (a.verdict, a.states, a.transitions, a.levels) == (b.verdict, b.states, b.transitions, b.levels)
    bug = patched("stale_index")
    c, d = model_check(bug, pool(3), 6), None
    split.StepChecker.__init__ = slow
    try:
        d = model_check(bug, pool(3), 6)
    finally:
        split.StepChecker.__init__ = orig
    assert c.verdict == "violation" and (c.counterexample, c.invariant, c.states) == (d.counterexample, d.invariant, d.states)
