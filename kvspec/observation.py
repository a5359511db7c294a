"""The one normalized observation every target adapter produces.

An adapter reads its allocator's internals into this shape after every step; the
invariant catalogue, the model checker's state key and the report's block views
all read it and nothing else.
"""
from __future__ import annotations

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

    def usable_ids(self) -> range:
        return range(1 if self.null_block == 0 else 0, len(self.blocks))

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
