"""Pool-level reference model: lists and dicts, no cleverness.

State: a ref count and an optional hash key per block, the free queue as a list
(front = evicted first), and the index as ``key -> [block ids]`` in insertion order
(several blocks may hold the same content: held blocks are never deduplicated).

Under ``free_order = "any"`` (a target that does not state an order) which free blocks
an allocation takes is the target's choice: the session hands the model a ``chooser``
that reads it off the target, and the model takes those blocks if they are free (else
the queue's head, so that a choice of a block that is not free stays visible).
"""
from __future__ import annotations

import copy
from typing import Hashable, Optional

from kvspec.spec.config import Config
from kvspec.spec.ops import Alloc, Cache, CachePartial, Free, FreeForeign, Lookup, Op, Reset, Touch


class PoolModel:
    def __init__(self, config: Config, traits) -> None:
        self.n = config.num_blocks
        self.caching = config.caching
        self.null = getattr(traits, "null_block_id", 0) if traits.null_block else None
        self.unhashed_first = traits.unhashed_free_first
        self.order = getattr(traits, "free_order", "lru_tail_first")  # see Traits.free_order
        self.noops = getattr(traits, "documented_noops", frozenset())
        self.free_evicts = getattr(traits, "free_evicts", False)
        self.latest_wins = getattr(traits, "index_latest_wins", False)
        self.first_wins = getattr(traits, "index_first_wins", False)  # one block per hash, the first keeps it
        self.lru_refresh = getattr(traits, "lru_refresh_on_lookup", False)
        self.ref = [0] * self.n
        self.hash: list[Optional[Hashable]] = [None] * self.n
        self.queue = [b for b in range(self.n) if b != self.null]
        self.index: dict[Hashable, list[int]] = {}
        # free_order "any": (n, where) -> the blocks the target took, or None; set by the
        # session around one step only (kvspec.check.session), never kept in a state
        self.chooser = None

    # -- queries ----------------------------------------------------------------
    def usable(self):
        if self.null is None or self.null == 0:
            return range(1 if self.null == 0 else 0, self.n)
        return [b for b in range(self.n) if b != self.null]

    def free_count(self) -> int:
        return len(self.queue)

    def held(self) -> list[int]:
        return [b for b in self.usable() if self.ref[b] > 0]

    def cached(self) -> list[int]:
        return [b for b in self.usable() if self.hash[b] is not None]

    def lookup(self, key: Hashable) -> Optional[int]:
        blocks = self.index.get(key)
        return blocks[0] if blocks else None

    def clone(self) -> "PoolModel":
        return copy.deepcopy(self)

    # -- misuse -----------------------------------------------------------------
    def misuse_reason(self, op: Op) -> Optional[str]:
        """Why ``op`` is a misuse in this state, or None if it is valid."""
        if isinstance(op, Alloc):
            if op.n < 0:
                return f"negative count {op.n}"
            if op.n > self.free_count():
                return f"count {op.n} exceeds the {self.free_count()} free blocks"
        elif isinstance(op, (Free, Touch, Cache, CachePartial)):
            what = type(op).__name__.lower()
            seen: dict[int, int] = {}
            for b in op.blocks:
                if b == self.null:
                    if "null_block" in self.noops and isinstance(op, (Free, Touch)):
                        continue
                    return f"{what} of the null block"
                if not 0 <= b < self.n:
                    return f"{what} of block {b}, which does not exist"
                seen[b] = seen.get(b, 0) + 1
                if isinstance(op, Free) and seen[b] > self.ref[b]:
                    return (f"double free of block {b}" if self.ref[b] else f"free of block {b}, which is not held")
                if isinstance(op, Touch) and self.ref[b] == 0 and self.hash[b] is None:
                    return f"touch of block {b}, which is neither held nor cached"
            if isinstance(op, CachePartial):
                return f"caching block {op.blocks[-1]}, which is not full"
            if isinstance(op, Cache):
                for b in op.blocks:
                    if self.ref[b] == 0:
                        return f"caching block {b}, which is not held"
                    if self.hash[b] is not None:
                        return f"caching block {b}, which already has a hash"
                if len(seen) != len(op.blocks):
                    return "caching the same block twice"
        elif isinstance(op, FreeForeign) and "foreign_free" not in self.noops:
            return f"free of block {op.block} of another pool"
        return None

    # -- transitions (valid ops only) ------------------------------------------
    def apply(self, op: Op):
        """Apply a valid op; return what the target should return."""
        if isinstance(op, Alloc):
            return tuple(self.alloc(op.n))
        if isinstance(op, Free):
            self.free(op.blocks)
        elif isinstance(op, Touch):
            self.touch(op.blocks)
        elif isinstance(op, Cache):
            for b, h in zip(op.blocks, op.hashes):
                self.cache(b, h)
        elif isinstance(op, Lookup):
            if not self.caching:
                return None
            found = self.lookup(op.hash)
            if self.lru_refresh and found is not None:
                self.refresh([found])
            return found
        elif isinstance(op, Reset):
            return self.reset()
        return None

    def alloc(self, n: int, where=None) -> list[int]:
        """Pop ``n`` free blocks: the queue's head, or under free order "any" the blocks
        the target took (``where``: (request, group, table position) at the cache level,
        None for a pool-level Alloc)."""
        picked = self._followed(n, where) if self.order == "any" and self.chooser is not None and n else None
        if picked is not None:
            taken = set(picked)
            out, self.queue = picked, [b for b in self.queue if b not in taken]
        else:
            out, self.queue = self.queue[:n], self.queue[n:]
        for b in out:
            self._evict(b)
            self.ref[b] = 1
        return out

    def _followed(self, n: int, where) -> Optional[list[int]]:
        try:
            got = self.chooser(n, where)
        except Exception:
            got = None
        if got is None or len(got) != n or len(set(got)) != n:
            return None
        free = set(self.queue)
        return list(got) if all(b in free for b in got) else None

    def _evict(self, b: int) -> None:
        key = self.hash[b]
        if key is not None:
            if b in self.index.get(key, ()):  # not there once replaced (index_latest_wins)
                self.index[key].remove(b)
                if not self.index[key]:
                    del self.index[key]
            self.hash[b] = None

    def free(self, blocks) -> None:
        released = []
        for b in blocks:
            if b == self.null:
                continue  # valid only where the target documents it as a no-op
            self.ref[b] -= 1
            if self.ref[b] == 0:
                # A free block is cached only while the index can hit it.
                if self.free_evicts or b not in self.index.get(self.hash[b], ()):
                    self._evict(b)
                released.append(b)
        if self.order == "mru":  # most recently freed first: this call's blocks lead, in its order
            self.queue = released + self.queue
        elif self.order == "sorted":  # the lowest free id is reused first
            self.queue = sorted(self.queue + released)
        else:  # lru_tail_first, fifo and any: to the back; unhashed ones to the front where declared
            front = [b for b in released if self.unhashed_first and self.hash[b] is None]
            back = [b for b in released if not (self.unhashed_first and self.hash[b] is None)]
            self.queue = front + self.queue + back

    def refresh(self, blocks) -> None:
        """An LRU cache's read (Traits.lru_refresh_on_lookup): each free block of
        ``blocks`` moves to the back of the queue, the MRU end, in that order. A new
        list, never an in-place change: the incremental check (kvspec.check.session)
        tells a changed queue by its identity or length."""
        moved = [b for b in dict.fromkeys(blocks) if self.ref[b] == 0 and b in self.queue]
        if moved:
            self.queue = [b for b in self.queue if b not in moved] + moved

    def touch(self, blocks) -> None:
        for b in blocks:
            if b == self.null:
                continue
            if self.ref[b] == 0:
                self.queue.remove(b)
            self.ref[b] += 1

    def cache(self, b: int, key: Hashable) -> None:
        if not self.caching:
            return
        self.hash[b] = key
        if self.first_wins and self.index.get(key):
            return  # the entry stays with the first block; this one carries its hash, unindexed
        if self.latest_wins:
            for old in self.index.get(key, ()):
                if self.ref[old] == 0:
                    self.hash[old] = None  # free and unreachable now: no longer cached
            self.index[key] = [b]
        else:
            self.index.setdefault(key, []).append(b)

    def reset(self) -> bool:
        if self.held():
            return False
        self.hash = [None] * self.n
        self.index = {}
        return True
