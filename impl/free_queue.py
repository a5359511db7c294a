"""FreeKVCacheBlockQueue: the free list, whose order is the eviction policy."""
from __future__ import annotations

from typing import Iterable

from .block import KVCacheBlock


class FreeKVCacheBlockQueue:
    """An intrusive doubly linked list of the blocks with ref_cnt 0.

    Why not ``collections.deque``: a prefix-cache hit revives a free block that sits
    anywhere in the queue, and ``remove`` must take it out in O(1). The links live on
    the blocks themselves, so no operation allocates a Python object.

    Order: ``popleft`` takes the front, so the front is evicted first. Callers append
    in eviction-priority order (least recently used first; a request's tail blocks
    before its prefix blocks), which makes the queue LRU with tail-first ties.

    Two sentinels (``head`` and ``tail``) remove every first/last special case.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self.head = KVCacheBlock(-1)
        self.tail = KVCacheBlock(-1)
        prev = self.head
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = self.tail
        self.tail.prev_free_block = prev

    def popleft(self) -> KVCacheBlock:
        first = self.head.next_free_block
        if first is self.tail or first is None:
            raise IndexError("pop from an empty free queue")
        self.remove(first)
        return first

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Pop ``n`` blocks from the front; the caller has checked that enough are free."""
        if n > self.num_free_blocks:
            raise IndexError(f"cannot pop {n} blocks from a queue of {self.num_free_blocks}")
        out: list[KVCacheBlock] = []
        cur = self.head.next_free_block
        for _ in range(n):
            assert cur is not None
            out.append(cur)
            nxt = cur.next_free_block
            cur.prev_free_block = cur.next_free_block = None
            cur = nxt
        # Relink once after the walk, and only then change the counter.
        self.head.next_free_block = cur
        assert cur is not None
        cur.prev_free_block = self.head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` from wherever it is, in O(1)."""
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise RuntimeError(f"block {block.block_id} is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self.tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self.tail
        self.tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        last = self.tail.prev_free_block
        assert last is not None
        n = 0
        for block in blocks:
            last.next_free_block = block
            block.prev_free_block = last
            last = block
            n += 1
        last.next_free_block = self.tail
        self.tail.prev_free_block = last
        self.num_free_blocks += n

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """The queue, front first (a walk of the links; for inspection and tests)."""
        out = []
        cur = self.head.next_free_block
        while cur is not None and cur is not self.tail:
            out.append(cur)
            cur = cur.next_free_block
        return out
