"""The incremental check: would ``check_step`` find nothing after this step?

A fast path the session takes on valid steps; a report always comes from the full
checks of ``kvspec.spec.invariants``.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Optional

from kvspec.spec.model import CacheModel, PoolModel
from kvspec.spec.ops import Admit, Alloc, Lookup, Reset, Step
from kvspec.spec.shadow import HashMap
from kvspec.spec.invariants import StepContext, _refused, kv_integrity, max_hit, stable_ids


# -- the incremental check ---------------------------------------------------------
# ``fast_check`` answers one question: would ``check_step`` find nothing after this
# step? It may answer "no" when in doubt (the session then runs ``check_step`` on a
# full observation, so a report always comes from the full checks above), but it must
# never answer "yes" when a full check would fail. It is only asked about valid,
# non-raising, comparable steps, and it relies on one fact, kept by the session: the
# observation before the step passed the full checks (or this one). So a block that
# neither the target nor the model changed still passes every per-block check, and
# only changed blocks, changed index entries and running counts need a look.
class RequestsView:
    """What the request-level checks read of an observation, without the pool."""

    def __init__(self, requests) -> None:
        self.requests = requests

    def excerpt(self, block_ids=(), request_ids=()) -> str:
        return ""  # a finding here is discarded: the full path reports it


@dataclass
class FastStep:
    ctx: StepContext                 # obs/prev are RequestsViews
    live: Any                        # LiveObservation before the step
    new: dict                        # block id -> BlockState after, for every block the target changed
    queue: list                      # the target's queue after
    delta: Any                       # ObservationDelta
    pool: PoolModel                  # the model's pool, after (ref/hash are TrackedLists)
    model_changed: set               # blocks whose model ref or hash changed
    model_held: int                  # usable blocks the model holds, before (after, once checked)
    queue_may_differ: bool           # either side's queue may have changed
    zero: int = 0                    # usable target blocks with ref 0, after (set by the check)
    pairs: Optional[tuple] = None    # new HASH_CHAIN pairs to record once the step is clean

    def commit_hashes(self, hashes: Optional[HashMap]) -> None:
        if hashes is not None and self.pairs:
            hashes.t2k.update(self.pairs[0])
            hashes.k2t.update(self.pairs[1])


def fast_check(fs: FastStep) -> bool:
    """True only if ``check_step`` would return no violation for this step."""
    ctx, live, new, d, pool = fs.ctx, fs.live, fs.new, fs.delta, fs.pool
    op, result, expected = ctx.op, ctx.result, ctx.expected
    blocks = live.blocks
    n, start, null = len(blocks), live.usable_start, live.null_block
    cache = isinstance(ctx.model, CacheModel)

    # Request-level checks, bounded by the live requests: the full ones, verbatim.
    if max_hit(ctx) or stable_ids(ctx) or kv_integrity(ctx):
        return False
    # What the full checks compare of the op's result.
    if isinstance(op, Alloc) and (result != expected or (null is not None and isinstance(result, tuple) and null in result)):
        return False                                                   # EVICTION_ORDER, NULL_BLOCK
    if isinstance(op, Reset) and result != expected:
        return False                                                   # ACCOUNTING
    if isinstance(op, (Admit, Step)) and _refused(expected) != _refused(result):
        return False                                                   # ACCOUNTING, NO_LEAK
    if isinstance(op, Lookup) and (result is None) != (expected is None):
        return False                                                   # I4
    if isinstance(op, Admit) and isinstance(result, int) and isinstance(expected, int) and result < expected:
        return False                                                   # I4

    # Running counts: the free count against the queue and the ref-0 blocks (ACCOUNTING).
    zero = live.zero
    for b, st in new.items():
        if start <= b < n:
            zero += (st.ref == 0) - (blocks[b].ref == 0)
    fs.zero = zero
    if d.free_count != len(fs.queue) or d.free_count != zero:
        return False
    if fs.queue_may_differ and fs.queue != pool.queue:
        return False                                                   # EVICTION_ORDER
    held = fs.model_held
    for b, before in fs.pool.ref.log.items():
        if start <= b < n:
            held += (pool.ref[b] > 0) - (before > 0)
    fs.model_held = held
    quiet = not ctx.model.running() if cache else held == 0
    if quiet and (n - start) != zero:
        return False                                                   # NO_LEAK

    # The blocks either side changed (and, at cache level, every block a table names).
    chk = set(new)
    chk.update(fs.model_changed)
    tables = d.requests
    holders: Counter = Counter()
    if cache:
        bs = ctx.config.block_size
        for rid, rs in tables.items():
            chk.update(rs.table)
            holders.update(rs.table)
            q = ctx.model.reqs.get(rid)
            if q is not None and list(rs.table) != q.table:
                return False                                           # EVICTION_ORDER
            for i, b in enumerate(rs.table):
                if not 0 <= b < n or b == null:
                    return False                                       # NULL_BLOCK (and worse)
                st = new.get(b) or blocks[b]
                if st.hash is not None and (i + 1) * bs > rs.computed:
                    return False                                       # I3
        for rs in live.requests.values():
            chk.update(rs.table)

    index, complete = d.index, d.index_complete

    def entry(h):
        if complete or h in index:
            return index.get(h) or ()
        return live.index.get(h, ())

    hashes = set(index)
    if complete:
        hashes.update(live.index)
    t2k, k2t = (ctx.hashes.t2k, ctx.hashes.k2t) if ctx.hashes is not None else ({}, {})
    new_t2k: dict = {}
    new_k2t: dict = {}
    ref, key_of = pool.ref, pool.hash
    for b in chk:
        if not 0 <= b < n:
            return False
        s = new.get(b) or blocks[b]
        o = blocks[b]
        if s.hash is not None:
            hashes.add(s.hash)
        if o.hash is not None:
            hashes.add(o.hash)
        if b < start:
            continue
        if s.queued != (s.ref == 0):
            return False                                               # I1
        if s.ref < 0 or s.ref != (holders.get(b, 0) if cache else ref[b]):
            return False                                               # ACCOUNTING
        if o.ref > 0 and s.ref > 0 and o.hash is not None and s.hash != o.hash:
            return False                                               # I3
        key = key_of[b] if b < len(key_of) else None
        if (s.hash is None) != (key is None):
            return False                                               # I4
        if s.hash is not None:
            if b not in entry(s.hash):
                return False                                           # INDEX_CONSISTENT
            if ctx.hashes is not None:                                 # HASH_CHAIN, tentatively
                k = new_t2k.get(s.hash, t2k.get(s.hash))
                t = new_k2t.get(key, k2t.get(key))
                if (k is not None and k != key) or (t is not None and t != s.hash):
                    return False
                new_t2k[s.hash] = key
                new_k2t[key] = s.hash
    if null is not None:
        s = new.get(null) or blocks[null]
        if s.queued or s.hash is not None:
            return False                                               # NULL_BLOCK
    for h in hashes:
        for b in entry(h):
            if not 0 <= b < n or b == null or (new.get(b) or blocks[b]).hash != h:
                return False                                           # INDEX_CONSISTENT, NULL_BLOCK
        for b in live.index.get(h, ()):
            # a hashed block the entry held before must still be where its hash says
            if start <= b < n:
                s = new.get(b) or blocks[b]
                if s.hash is not None and b not in entry(s.hash):
                    return False                                       # INDEX_CONSISTENT
    fs.pairs = (new_t2k, new_k2t)
    return True
