"""A paged KV pool with prefix caching (no declared policies). Freed blocks stay cached until reused; reusing a
block drops its old index entry; the prompt's last block is never a hit (one token is
always computed)."""
from collections import deque

from nanoshapes.engine.sequence import Sequence

NO_HASH = -1


class Block:
    def __init__(self, block_id):
        self.block_id = block_id
        self.ref_count = 0
        self.hash = NO_HASH
        self.token_ids = []


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids = deque(range(num_blocks))
        self.used_block_ids = set()
        self.hash_to_block_id = {}

    @staticmethod
    def chain(prev, tokens):
        return hash((prev, tuple(tokens))) & ((1 << 62) - 1)

    def _take(self, block_id):
        b = self.blocks[block_id]
        if b.hash != NO_HASH and self.hash_to_block_id.get(b.hash) == block_id:
            del self.hash_to_block_id[b.hash]
        b.ref_count, b.hash, b.token_ids = 1, NO_HASH, []
        self.free_block_ids.remove(block_id)
        self.used_block_ids.add(block_id)
        return b

    def _register(self, b, h, tokens):
        b.hash, b.token_ids = h, list(tokens)
        self.hash_to_block_id[h] = b.block_id

    def can_allocate(self, seq: Sequence) -> bool:
        return len(self.free_block_ids) >= seq.num_blocks

    def allocate(self, seq: Sequence):
        assert not seq.block_table, "allocate of a sequence that holds blocks"
        prev, hitting = NO_HASH, True
        for i in range(seq.num_blocks):
            tokens = seq.block(i)
            full = len(tokens) == self.block_size
            h = self.chain(prev, tokens) if full else NO_HASH
            found = self.hash_to_block_id.get(h) if full and (i + 1) * self.block_size < len(seq) else None
            hitting = hitting and found is not None and self.blocks[found].token_ids == tokens
            if hitting:
                b = self.blocks[found]
                if b.ref_count == 0:
                    self._take(found)
                    self._register(b, h, tokens)
                else:
                    b.ref_count += 1
                seq.num_cached_tokens += self.block_size
            else:
                b = self._take(self.free_block_ids[0])
                if full:
                    self._register(b, h, tokens)
            seq.block_table.append(b.block_id)
            prev = h

    def deallocate(self, seq: Sequence):
        for block_id in reversed(seq.block_table):
            b = self.blocks[block_id]
            b.ref_count -= 1
            if b.ref_count == 0:
                self.used_block_ids.remove(block_id)
                self.free_block_ids.append(block_id)
        seq.block_table.clear()
        seq.num_cached_tokens = 0

    def can_append(self, seq: Sequence) -> bool:
        return len(seq) % self.block_size != 1 or len(self.free_block_ids) > 0

    def may_append(self, seq: Sequence):
        table: list[int] = seq.block_table
        n = len(seq) % self.block_size
        if n == 1:
            table.append(self._take(self.free_block_ids[0]).block_id)
        elif n == 0:
            prev = self.blocks[table[-2]].hash if len(table) > 1 else NO_HASH
            last = self.blocks[table[-1]]
            tokens = seq.block(seq.num_blocks - 1)
            self._register(last, self.chain(prev, tokens), tokens)
