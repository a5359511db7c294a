"""FreeKVCacheBlockQueue: the free list, whose order is the eviction policy."""
from __future__ import annotations

from typing import Sequence

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

    Contracts (PEP 316; CrossHair checks them, tests/test_crosshair.py):

    inv: self.num_free_blocks == len(self.get_all_free_blocks())
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        """
        pre: len(set(map(id, blocks))) == len(blocks)
        pre: all(b.prev_free_block is None and b.next_free_block is None for b in blocks)
        post: self.get_all_free_blocks() == blocks
        """
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
        """
        pre: self.num_free_blocks > 0
        post: __return__ is __old__.self.get_all_free_blocks()[0] or __return__.block_id == __old__.self.get_all_free_blocks()[0].block_id
        post: self.num_free_blocks == __old__.self.num_free_blocks - 1
        post: __return__.prev_free_block is None and __return__.next_free_block is None
        """
        first = self.head.next_free_block
        if first is self.tail or first is None:
            raise IndexError("pop from an empty free queue")
        self.remove(first)
        return first

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Pop ``n`` blocks from the front; the caller has checked that enough are free.

        pre: 0 <= n <= self.num_free_blocks
        post: [b.block_id for b in __return__] == [b.block_id for b in __old__.self.get_all_free_blocks()[:n]]
        post: [b.block_id for b in self.get_all_free_blocks()] == [b.block_id for b in __old__.self.get_all_free_blocks()[n:]]
        post: all(b.prev_free_block is None and b.next_free_block is None for b in __return__)
        """
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
        """Unlink ``block`` from wherever it is, in O(1).

        pre: any(b is block for b in self.get_all_free_blocks())
        post: [b.block_id for b in self.get_all_free_blocks()] == [b.block_id for b in __old__.self.get_all_free_blocks() if b.block_id != block.block_id]
        post: block.prev_free_block is None and block.next_free_block is None
        """
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise RuntimeError(f"block {block.block_id} is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """
        pre: block.prev_free_block is None and block.next_free_block is None
        pre: block is not self.head and block is not self.tail
        post: [b.block_id for b in self.get_all_free_blocks()] == [b.block_id for b in __old__.self.get_all_free_blocks()] + [block.block_id]
        """
        last = self.tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self.tail
        self.tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Append ``blocks`` in order (the first of them is evicted first).

        pre: len(set(map(id, blocks))) == len(blocks)
        pre: all(b.prev_free_block is None and b.next_free_block is None for b in blocks)
        pre: all(b is not self.head and b is not self.tail for b in blocks)
        post: [b.block_id for b in self.get_all_free_blocks()] == [b.block_id for b in __old__.self.get_all_free_blocks()] + [b.block_id for b in blocks]
        """
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
