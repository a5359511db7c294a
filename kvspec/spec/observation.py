"""The one normalized observation every target adapter produces.

An adapter reads its allocator's internals into this shape after every step; the
invariant catalogue, the model checker's state key and the report's block views
all read it and nothing else.
"""
from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Hashable, Mapping, Optional


@dataclass(frozen=True)
class BlockState:
    ref: int
    hash: Optional[Hashable]  # the target's own hash value (opaque), None if uncached
    queued: bool              # reachable by walking the free queue


@dataclass(frozen=True)
class RequestState:
    table: tuple[int, ...]    # block ids, logical block 0 first
    computed: int             # tokens whose KV is in the table (cached prefix included)
    # The tables of KV-cache groups 1.. (group 0's is ``table``); empty with one group.
    groups: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True)
class Observation:
    blocks: tuple[BlockState, ...]            # indexed by block id
    queue: tuple[int, ...]                    # free queue, front (evicted first) first
    index: Mapping[Hashable, tuple[int, ...]]  # hash -> block ids holding it
    free_count: int                           # what the target reports as free
    null_block: Optional[int] = 0             # None for targets without one
    requests: Mapping[str, RequestState] = field(default_factory=dict)
    # Problems the adapter found walking the queue (links that disagree with the walk).
    queue_problems: tuple[str, ...] = ()
    # (invariant, message): what the adapter's own probes found (the allocator level's
    # copy-on-write probe, kvspec.alloc.cow), reported by the step that ran them.
    found: tuple[tuple[str, str], ...] = ()

    def usable_ids(self):
        if self.null_block is None or self.null_block == 0:
            return range(1 if self.null_block == 0 else 0, len(self.blocks))
        return [b for b in range(len(self.blocks)) if b != self.null_block]  # a null block elsewhere

    def short_hash(self, h: Optional[Hashable]) -> str:
        if h is None:
            return "-"
        if isinstance(h, (bytes, bytearray)):
            return h.hex()[:6]
        return str(h)[:10]

    def block_rows(self, ids=None) -> list[dict]:
        """Per-block rows for reports: id, ref, hash (short), queued."""
        ids = range(len(self.blocks)) if ids is None else ids
        return [
            {"block": i, "ref": self.blocks[i].ref, "hash": self.short_hash(self.blocks[i].hash),
             "queued": self.blocks[i].queued}
            for i in ids if 0 <= i < len(self.blocks)
        ]

    def excerpt(self, block_ids=(), request_ids=()) -> str:
        """A one-line state excerpt naming the given blocks and requests."""
        parts = []
        for r in self.block_rows(sorted(set(block_ids))):
            parts.append(f"block {r['block']}: ref={r['ref']} hash={r['hash']} queued={r['queued']}")
        for rid in request_ids:
            rs = self.requests.get(rid)
            if rs is not None:
                parts.append(f"{rid}: table={list(rs.table)} computed={rs.computed}")
        parts.append(f"queue={list(self.queue)} free_count={self.free_count}")
        return "; ".join(parts)


# -- incremental observation -------------------------------------------------------
# A driver that can tell which blocks an op wrote (see ``ImplPoolDriver.observe_delta``)
# reports only those, and the session keeps the rest of the observation from the step
# before. Queue links name blocks by id, or one of these markers.
HEAD, TAIL, FOREIGN = -1, -2, -3


@dataclass
class ObservationDelta:
    """What an op changed, as a driver reads it back: every block the op *wrote* (not
    only those it meant to), the queue ends, the index entries it touched, and the
    per-request part in full (it is bounded by the live requests, not the pool)."""
    blocks: dict                      # id -> (ref, hash, prev link, next link)
    head_next: Optional[int]          # first block of the queue (TAIL when empty)
    tail_prev: Optional[int]          # last block of the queue (HEAD when empty)
    free_count: int
    index: dict                       # hash -> block ids now (None: no entry) for every hash touched
    index_complete: bool = False      # ``index`` is the whole index (the op touched all of it)
    requests: Mapping[str, RequestState] = field(default_factory=dict)


def _position(seq: list, x: int) -> int:
    if seq and seq[0] == x:
        return 0
    if seq and seq[-1] == x:
        return len(seq) - 1
    return seq.index(x)


def splice_walk(prev: list, was_queued, num_blocks: int, links: dict, head_next, tail_prev):
    """The free queue after an op, from the queue before it (``prev``, a clean list) and
    the links of the blocks the op wrote: the walk ``observe_pool`` would make, found
    without visiting the blocks the op left alone.

    A block the op did not write kept its links, so from it the walk runs along ``prev``
    until the next written block: that run is one slice. Returns ``(queue, visited,
    left)``: the new queue, the written blocks it holds, and the blocks that left it;
    or None if the walk is anything but a clean list (a link that disagrees, a cycle, a
    block from elsewhere, an unwritten block that was not queued), which the caller
    then observes in full, so that the report is exactly the full observer's.
    """
    first = prev[0] if prev else TAIL
    last = prev[-1] if prev else HEAD
    if not links and head_next == first and tail_prev == last:
        return prev, set(), []
    dpos = sorted(_position(prev, b) for b in links if was_queued(b))
    out: list = []
    runs: list = []
    visited: set = set()
    cur, before = head_next, HEAD
    while cur != TAIL:
        if type(cur) is not int or not 0 <= cur < num_blocks:
            return None  # fell off the list, looped to the head, or left the pool
        if cur in links:
            if cur in visited or links[cur][0] != before:
                return None
            visited.add(cur)
            out.append(cur)
            before, cur = cur, links[cur][1]
        elif was_queued(cur):
            p = _position(prev, cur)
            if (prev[p - 1] if p else HEAD) != before:
                return None
            i = bisect_right(dpos, p)
            q = dpos[i] if i < len(dpos) else len(prev)
            runs.append((p, q))
            out.extend(prev[p:q])
            before = prev[q - 1]
            cur = prev[q] if q < len(prev) else TAIL
        else:
            return None
        if len(out) > num_blocks:
            return None
    if tail_prev != before:
        return None
    runs.sort()
    left: list = []
    at = 0
    for p, q in runs:
        if p < at:
            return None  # two runs overlap: a block would be walked twice
        left.extend(prev[at:p])
        at = q
    left.extend(prev[at:])
    return out, visited, [b for b in left if b not in visited]


class LiveObservation:
    """The observation of the last step, kept up to date from deltas: the same fields
    as ``Observation`` (mutable), plus running counts that the incremental checks read
    instead of walking the pool. ``materialize()`` gives the frozen Observation."""

    def __init__(self, obs: Observation) -> None:
        self.blocks = list(obs.blocks)
        self.queue = list(obs.queue)
        self.index = dict(obs.index)
        self.free_count = obs.free_count
        self.null_block = obs.null_block
        self.requests = dict(obs.requests)
        usable = obs.usable_ids()
        self.usable_start = usable.start
        self.zero = sum(1 for b in usable if obs.blocks[b].ref == 0)      # usable blocks with ref 0

    def is_queued(self, b: int) -> bool:
        return self.blocks[b].queued

    def usable(self, b: int) -> bool:
        return self.usable_start <= b < len(self.blocks)

    def materialize(self) -> Observation:
        return Observation(blocks=tuple(self.blocks), queue=tuple(self.queue), index=dict(self.index),
                           free_count=self.free_count, null_block=self.null_block, requests=dict(self.requests))
