"""State keys (kvspec.mc.canonical): symmetric states collapse, asymmetric ones do not."""
from dataclasses import replace

import pytest

from kvspec.mc.canonical import compact, pool_key, state_key
from kvspec.spec.config import Config
from kvspec.spec.ops import Admit, Alloc, Cache, Free, Lookup, Reset, Step, Touch
from kvspec.check.session import Session
from kvspec.targets import load_target

POOL = Config(level="pool", num_blocks=6)
CACHE = Config(level="cache", num_blocks=6, block_size=2)


@pytest.fixture(scope="module")
def impl():
    return load_target("impl")


def key(target, config, steps, symmetry=True):
    s = Session(target, config)
    lens = {}
    for op in steps:
        assert not s.apply(op), op
        if isinstance(op, Admit) and op.prompt is not None:
            lens[op.req] = len(op.prompt)
    return state_key(s, {"prompt_lens": lens}, symmetry)


SYMMETRIC_POOL = [
    ("which of two equal held blocks is freed",
     [Alloc(2), Free((1,))], [Alloc(2), Free((2,))]),
    ("the order in which two equal held blocks are freed",
     [Alloc(2), Free((1, 2))], [Alloc(2), Free((2, 1))]),
    ("which label a block is cached under",
     [Alloc(1), Cache((1,), ("a",))], [Alloc(1), Cache((1,), ("b",))]),
    ("two labels swapped together with their blocks' queue order",
     [Alloc(2), Cache((1, 2), ("a", "b")), Free((1, 2))], [Alloc(2), Cache((1, 2), ("b", "a")), Free((1, 2))]),
    ("which held block gets the second holder",
     [Alloc(3), Touch((1,))], [Alloc(3), Touch((3,))]),
]

ASYMMETRIC_POOL = [
    ("two blocks under one label, index order against queue order",
     [Alloc(2), Cache((1, 2), ("a", "a")), Free((1, 2))], [Alloc(2), Cache((1, 2), ("a", "a")), Free((2, 1))]),
    ("different ref counts",
     [Alloc(2), Touch((1,))], [Alloc(2)]),
    ("a cached block against an uncached one",
     [Alloc(1), Cache((1,), ("a",)), Free((1,))], [Alloc(1), Free((1,))]),
    ("one label on two blocks against two labels",
     [Alloc(2), Cache((1, 2), ("a", "a"))], [Alloc(2), Cache((1, 2), ("a", "b"))]),
    ("the queue position of the cached block",
     [Alloc(2), Cache((1,), ("a",)), Free((1, 2))], [Alloc(2), Cache((1,), ("a",)), Free((2, 1))]),
    ("a label the run has used before (hash history) against a fresh state",
     [Alloc(1), Cache((1,), ("a",)), Free((1,)), Reset()], [Alloc(1), Free((1,))]),
]


@pytest.mark.parametrize("why, a, b", SYMMETRIC_POOL, ids=[c[0] for c in SYMMETRIC_POOL])
def test_symmetric_pool_states_collapse(impl, why, a, b):
    assert key(impl, POOL, a) == key(impl, POOL, b)
    assert compact(key(impl, POOL, a)) == compact(key(impl, POOL, b))


@pytest.mark.parametrize("why, a, b", SYMMETRIC_POOL, ids=[c[0] for c in SYMMETRIC_POOL])
def test_without_symmetry_the_raw_states_stay_apart(impl, why, a, b):
    assert key(impl, POOL, a, symmetry=False) != key(impl, POOL, b, symmetry=False)


@pytest.mark.parametrize("why, a, b", ASYMMETRIC_POOL, ids=[c[0] for c in ASYMMETRIC_POOL])
def test_asymmetric_pool_states_stay_apart(impl, why, a, b):
    assert key(impl, POOL, a) != key(impl, POOL, b)
    assert compact(key(impl, POOL, a)) != compact(key(impl, POOL, b))


def test_lookup_changes_nothing_and_the_key_says_so(impl):
    base = [Alloc(2), Cache((1,), ("a",)), Free((1,))]
    assert key(impl, POOL, base) == key(impl, POOL, base + [Lookup("a"), Lookup("b")])


def test_the_null_block_is_never_renamed(impl):
    s = Session(impl, POOL)
    s.apply(Alloc(2))
    k = state_key(s)
    model_blocks = k[0]
    assert model_blocks[0] == (0, -1)      # block 0: the null block, ref 0, no label
    assert len(model_blocks) == POOL.num_blocks


def test_the_observation_is_part_of_the_key_not_only_the_model(impl):
    """Two sessions with one model state but observations that differ where no invariant
    looks (the order of the blocks under one hash) get different keys."""
    s = Session(impl, POOL)
    for op in [Alloc(2), Cache((1, 2), ("a", "a"))]:
        s.apply(op)
    obs = s.obs
    (h, ids), = obs.index.items()
    flipped = replace(obs, index={h: tuple(reversed(ids))})
    assert pool_key(s.model, obs, s.hashes) != pool_key(s.model, flipped, s.hashes)


SYMMETRIC_CACHE = [
    ("request ids swapped",
     [Admit("r1", (1, 2)), Admit("r2", (1, 2, 11, 12))], [Admit("r2", (1, 2)), Admit("r1", (1, 2, 11, 12))]),
    ("the same request under another name",
     [Admit("r1", (1, 2, 11))], [Admit("r7", (1, 2, 11))]),
]

ASYMMETRIC_CACHE = [
    ("a token decoded against the same token in the prompt",
     [Admit("r1", (1, 2)), Step("r1", 11)], [Admit("r1", (1, 2, 11))]),
    ("different prompts",
     [Admit("r1", (1, 2, 11))], [Admit("r1", (1, 2, 12))]),
    ("which request holds the longer table",
     [Admit("r1", (1, 2)), Admit("r2", (1, 2, 11, 12))], [Admit("r1", (1, 2, 11, 12)), Admit("r2", (1, 2, 11, 12))]),
]


@pytest.mark.parametrize("why, a, b", SYMMETRIC_CACHE, ids=[c[0] for c in SYMMETRIC_CACHE])
def test_symmetric_cache_states_collapse(impl, why, a, b):
    assert key(impl, CACHE, a) == key(impl, CACHE, b)


@pytest.mark.parametrize("why, a, b", ASYMMETRIC_CACHE, ids=[c[0] for c in ASYMMETRIC_CACHE])
def test_asymmetric_cache_states_stay_apart(impl, why, a, b):
    assert key(impl, CACHE, a) != key(impl, CACHE, b)


def _raw(s):
    m, o = s.model, s.obs
    return (tuple(m.ref), tuple(m.hash), tuple(m.queue), {k: tuple(v) for k, v in m.index.items()},
            o.blocks, o.queue, dict(o.index), o.free_count, dict(s.hashes.t2k))


def _renamed(raw, pb, pl):
    """``raw`` with blocks renamed by ``pb`` and labels by ``pl`` (target hashes follow their label)."""
    from kvspec.targets.impl_target import label_hash
    from kvspec.spec.observation import BlockState

    ph = {label_hash(a): label_hash(b) for a, b in pl.items()}
    ref, hsh, queue, index, ob, oq, oi, fc, t2k = raw
    n = len(ref)
    inv = {pb[b]: b for b in range(n)}
    return (tuple(ref[inv[b]] for b in range(n)), tuple(pl.get(hsh[inv[b]]) for b in range(n)),
            tuple(pb[b] for b in queue), {pl[k]: tuple(pb[b] for b in v) for k, v in index.items()},
            tuple(BlockState(ob[inv[b]].ref, ph.get(ob[inv[b]].hash), ob[inv[b]].queued) for b in range(n)),
            tuple(pb[b] for b in oq), {ph[h]: tuple(pb[b] for b in v) for h, v in oi.items()}, fc,
            {ph[h]: pl[k] for h, k in t2k.items()})


def _isomorphic(a, b, labels):
    """Brute force: is there a renaming of blocks (null fixed) and labels mapping a onto b?"""
    from itertools import permutations

    n = len(a[0])
    for pbl in permutations(range(1, n)):
        pb = {0: 0, **{i + 1: x for i, x in enumerate(pbl)}}
        for pll in permutations(labels):
            if _renamed(a, pb, dict(zip(labels, pll))) == b:
                return True
    return False


def test_equal_keys_only_for_isomorphic_states(impl):
    """Soundness, checked by brute force: over every path of up to three valid ops (no
    reduction) on a three-block pool, states with equal keys are images of each other
    under some renaming of blocks and labels, history and observation included. And
    the key is complete here: isomorphic states get equal keys."""
    from kvspec.mc.enumerate_ops import Bounds, enabled_pool_ops

    cfg = Config(level="pool", num_blocks=4)
    labels = ("a", "b")
    states = []
    frontier = [[]]
    for _ in range(3):
        nxt = []
        for path in frontier:
            s = Session(impl, cfg)
            for op in path:
                s.apply(op)
            states.append(s)
            nxt += [path + [op] for op in enabled_pool_ops(s.model, cfg, Bounds(symmetry=False, max_set=3))]
        frontier = nxt
    for path in frontier:
        s = Session(impl, cfg)
        for op in path:
            s.apply(op)
        states.append(s)
    groups: dict = {}
    for s in states:
        groups.setdefault(compact(state_key(s)), []).append(_raw(s))
    merged = 0
    for g in groups.values():
        for other in g[1:]:
            assert _isomorphic(g[0], other, labels)
            merged += 1
    assert merged > 100
    reps = [g[0] for g in groups.values()]
    for i, a in enumerate(reps):
        for b in reps[i + 1:]:
            if a[0] == b[0] or sorted(a[0]) == sorted(b[0]):
                assert not _isomorphic(a, b, labels)
