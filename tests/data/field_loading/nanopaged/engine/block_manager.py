"""Blocks of block_size tokens, each split into pages of page_size tokens (the attention
kernel's unit); the scheduler reports the pages a sequence has written after each step
(note_pages). nano-vllm's first API otherwise; a reused block drops its index entry."""
from collections import deque

from nanopaged.engine.sequence import Sequence

NONE = -1


def chain(prev, tokens):
    return hash((prev, tuple(tokens))) & ((1 << 61) - 1)


class Block:
    def __init__(self, block_id):
        self.block_id = block_id
        self.ref_count = 0
        self.hash = NONE
        self.token_ids = []
        self.pages_written = 0


class BlockManager:
    kvspec_traits = {"admit_all_blocks": True}  # declared: admission counts every block of the prompt

    def __init__(self, num_blocks: int, block_size: int, page_size: int | None = None):
        self.block_size = block_size
        self.page_size = block_size if page_size is None else page_size
        assert self.block_size % self.page_size == 0
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block_id = {}
        self.free_block_ids = deque(range(num_blocks))
        self.used_block_ids = set()

    def _take(self, block_id):
        b = self.blocks[block_id]
        if self.hash_to_block_id.get(b.hash) == block_id:
            del self.hash_to_block_id[b.hash]
        b.ref_count, b.hash, b.token_ids, b.pages_written = 1, NONE, [], 0
        self.free_block_ids.remove(block_id)
        self.used_block_ids.add(block_id)
        return b

    def _index(self, b, h, tokens):
        b.hash, b.token_ids = h, list(tokens)
        self.hash_to_block_id[h] = b.block_id

    def can_allocate(self, seq: Sequence) -> bool:
        return len(self.free_block_ids) >= seq.num_blocks

    def allocate(self, seq: Sequence):
        prev, hitting = NONE, True
        for i in range(seq.num_blocks):
            tokens = seq.block(i)
            full = len(tokens) == self.block_size
            h = chain(prev, tokens) if full else NONE
            found = self.hash_to_block_id.get(h) if full and i < seq.num_blocks - 1 else None
            hitting = hitting and found is not None and self.blocks[found].token_ids == tokens
            if hitting:
                b = self.blocks[found]
                if b.ref_count == 0:
                    self._take(found)
                    self._index(b, h, tokens)
                else:
                    b.ref_count += 1
                seq.num_cached_tokens += self.block_size
            else:
                b = self._take(self.free_block_ids[0])
                if full:
                    self._index(b, h, tokens)
            seq.block_table.append(b.block_id)
            prev = h

    def note_pages(self, seq: Sequence):
        pages_per_block = self.block_size // self.page_size
        for i, b in enumerate(seq.block_table):
            blk = self.blocks[b]
            blk.pages_written = max(0, min(pages_per_block, seq.num_pages - i * pages_per_block))

    def deallocate(self, seq: Sequence):
        for b in reversed(seq.block_table):
            blk = self.blocks[b]
            blk.ref_count -= 1
            if blk.ref_count == 0:
                self.used_block_ids.remove(b)
                self.free_block_ids.append(b)
        seq.block_table.clear()
        seq.num_cached_tokens = 0

    def can_append(self, seq: Sequence) -> bool:
        return len(seq) % self.block_size != 1 or len(self.free_block_ids) > 0

    def may_append(self, seq: Sequence):
        n = len(seq) % self.block_size
        if n == 1 or self.block_size == 1:
            seq.block_table.append(self._take(self.free_block_ids[0]).block_id)
        if n == 0:
            prev = self.blocks[seq.block_table[-2]].hash if len(seq.block_table) > 1 else NONE
            self._index(self.blocks[seq.block_table[-1]], chain(prev, seq.block(seq.num_blocks - 1)),
                        seq.block(seq.num_blocks - 1))
