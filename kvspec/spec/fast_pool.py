"""The pool level's transition checks in one pass, for the model checker.

``kvspec.mc.split.StepChecker`` runs the catalogue's *transition checks* on every step
of a search (16 functions, each walking the observation again). At pool level most of
them cannot fire at all (no requests, no shadow KV store, no KV-cache groups) and the
rest read a handful of fields. ``pool_transition_clean`` answers, in one walk over the
blocks, one question: would every one of the catalogue's transition checks return
nothing on this step? It answers ``True`` only when it is sure, and ``None`` when in
doubt (a misuse, an error, a step that is not comparable, anything unexpected, any
exception); the caller then runs the catalogue's checks themselves, so a report is
always the catalogue's, word for word. It must never answer ``True`` where a check
would find something: tests/test_fast_pool.py holds it to the catalogue on states of
real searches and on random corruptions of them, and shows that dropping any one of
its conditions lets a violation through.

HASH_CHAIN does not only check, it *records* (``HashMap.pair``): every target hash /
content pair of the step goes into the hash history, which is part of the state key.
Here the pairs are found tentatively and ``commit`` writes them only on a clean
answer, in the order the check would write them (an answer of ``None`` writes
nothing: the catalogue's own check then does its writes).

INDEX_CONSISTENT is a transition check only because its exception for a declared
one-block-per-hash index reads the step; the pass vouches only for an index that is
consistent without that exception (every entry names a block of its hash, every hashed
usable block is in its entry), where the check finds nothing whatever the step.

Which checks it stands for is ``COVERS``: the names of the catalogue's checks whose
pool-level behaviour it repeats. ``covers(names)`` is False when the search's
transition checks include one that is not in it (a check added to the catalogue
later), and the search then runs the catalogue's checks as before.
"""
from __future__ import annotations

from typing import Any, Optional

from kvspec.spec.model import CacheModel, PoolModel
from kvspec.spec.ops import Alloc, Cache, CachePartial, Free, FreeForeign, Lookup, Reset, Touch

# The catalogue's checks this one pass repeats at pool level (kvspec.spec.invariants and
# kvspec.spec.group_checks); at pool level max_hit, stable_ids, kv_integrity and the
# group checks (min_hit included: it reads admissions) return nothing (they read requests, a CacheModel, the shadow store, or a
# GroupCacheModel), which the preconditions below make sure of.
COVERS = frozenset({"no_crash", "atomic_reject", "null_block", "accounting_step", "hash_chain", "full_only",
                    "cached_evictable", "max_hit", "no_leak", "stable_ids", "eviction_order", "kv_integrity",
                    "hit_content", "hit_agreement", "window", "slots", "index_consistent", "min_hit"})

_POOL_OPS = frozenset({Alloc, Free, Touch, Cache, CachePartial, FreeForeign, Lookup, Reset})


_MODEL_TYPES: dict = {}


def _pool_model(mt: type) -> bool:
    """A pool model whose class is none of the cache level's (no requests, no groups)."""
    ok = _MODEL_TYPES.get(mt)
    if ok is None:
        ok = _MODEL_TYPES[mt] = not issubclass(mt, CacheModel) and not hasattr(mt, "groups") \
            and not hasattr(mt, "reqs") and hasattr(mt, "held")
    return ok


def covers(names) -> bool:
    return set(names) <= COVERS


def pool_transition_clean(ctx: Any) -> Optional[tuple]:
    """The new hash-history pairs (a tuple, possibly empty) if every transition check of
    the catalogue finds nothing on this pool-level step; None when in doubt."""
    try:
        return _clean(ctx)
    except Exception:
        return None   # the catalogue's checks will meet (and report, or raise on) the same state


def commit(hashes: Any, pairs: tuple) -> None:
    """Write HASH_CHAIN's records, as ``HashMap.pair`` would have, in the same order."""
    t2k, k2t = hashes.t2k, hashes.k2t
    for th, key in pairs:
        t2k[th] = key
        k2t[key] = th


def _clean(ctx: Any) -> Optional[tuple]:
    if ctx.misuse is not None or ctx.error is not None:
        return None                       # NO_CRASH, ATOMIC_REJECT and a not-comparable step
    model, obs, prev, op = ctx.model, ctx.obs, ctx.prev, ctx.op
    mt = type(model)
    md = model.__dict__
    if ctx.shadow is not None or obs.requests or type(op) not in _POOL_OPS \
            or not (_MODEL_TYPES.get(mt) or _pool_model(mt)) or "groups" in md or "reqs" in md:
        return None                       # not the pool level: the cache-level checks would read more
    result, expected = ctx.result, ctx.expected
    t = type(op)
    if t is Alloc and result != expected:
        return None                       # not comparable; EVICTION_ORDER
    if t is Reset and result != expected:
        return None                       # ACCOUNTING (accounting_step)
    if t is Lookup and (result is None) != (expected is None):
        return None                       # I4
    blocks, pblocks = obs.blocks, prev.blocks
    n = len(blocks)
    ref, key_of = model.ref, model.hash
    if len(pblocks) != n or len(key_of) != n or len(ref) != n:
        return None  # shape
    null = obs.null_block
    if null is not None:                  # NULL_BLOCK
        if null in obs.queue or blocks[null].hash is not None:
            return None  # NULL_BLOCK: queued
        if t is Alloc and isinstance(result, tuple) and null in result:
            return None  # NULL_BLOCK: allocated
    index = obs.index
    for h, ids in index.items():          # INDEX_CONSISTENT: every entry names a block holding its hash
        for x in ids:
            if null is not None and x == null:
                return None  # NULL_BLOCK: indexed
            if type(x) is not int or not 0 <= x < n or blocks[x].hash != h:
                return None  # INDEX_CONSISTENT: an entry names a block of another hash
    if list(obs.queue) != model.queue:
        return None                       # EVICTION_ORDER
    usable = obs.usable_ids()
    if type(usable) is not range:
        return None  # shape (a null block inside the pool)
    if mt.held is PoolModel.held and mt.usable is PoolModel.usable and (model.null is None or model.null == 0):
        # (inlined ``not model.held()``: no usable block with a ref count, the usable
        # blocks being ``range(1 or 0, n)`` here; max() walks the list in C)
        quiet = max(ref[1 if model.null == 0 else 0:], default=0) <= 0
    else:
        quiet = not model.held()
    hashes = ctx.hashes
    if hashes is not None:
        t2k, k2t = hashes.t2k, hashes.k2t
    else:
        t2k, k2t = {}, {}
    t2k_get, k2t_get = t2k.get, k2t.get
    new_t2k: dict = {}
    new_k2t: dict = {}
    pairs: list = []
    for b in usable:
        s = blocks[b]
        h, key = s.hash, key_of[b]
        r = s.ref
        if r and quiet:
            return None                   # NO_LEAK
        o = pblocks[b]
        if h is None:
            if key is not None:
                return None               # I4 (cached_evictable): lost its hash
            if r > 0 and o.ref > 0 and o.hash is not None:
                return None               # I3 (full_only): a held block lost its hash
            continue
        if key is None:
            return None                   # I4 (cached_evictable): still carries a hash
        if r > 0 and o.ref > 0 and o.hash is not None and h != o.hash:
            return None                   # I3 (full_only)
        if b not in index.get(h, ()):
            return None  # INDEX_CONSISTENT: a hashed block missing from the index
        if hashes is None:
            continue
        k = t2k_get(h)                    # HASH_CHAIN, tentatively
        if k is not None and k == key and k2t_get(key) == h:
            continue                      # a pair the history holds: recording it changes nothing
        if k is None:
            k = new_t2k.get(h)
        if k is not None and k != key:
            return None  # HASH_CHAIN: one hash, two contents
        th = k2t_get(key)
        if th is None:
            th = new_k2t.get(key)
        if th is not None and th != h:
            return None  # HASH_CHAIN: one content, two hashes
        new_t2k[h] = key
        new_k2t[key] = h
        pairs.append((h, key))
    if t is Lookup and result is not None:            # I4: the block found holds that label
        if not (isinstance(result, int) and 0 <= result < n):
            return None  # I4: lookup out of range
        seen = blocks[result].hash
        if key_of[result] != op.hash or seen is None:
            return None  # I4: lookup of another label
        seen_key = new_t2k.get(seen, t2k.get(seen))
        if seen_key not in (None, op.hash):
            return None  # (I4: already HASH_CHAIN's above; kept as a guard)
    return tuple(pairs)
