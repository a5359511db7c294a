"""Blocks for a scheduler that counts tokens itself: it asks get_token_layout(seq) what a
waiting prompt would hit, then can_allocate(number of tokens that need free blocks), sets
seq.num_new_tokens and calls allocate(seq); a running sequence gets can_append(seq, n)
and may_append(seq) for its seq.num_new_tokens new tokens. Freed blocks keep their hash
until reused; reusing one drops its index entry; the prompt's last block is never a hit."""
from collections import deque

from nanolayout.engine.sequence import Sequence  # noqa: F401  (the Sequence its scheduler passes)

NONE = -1


def chain(prev, tokens):
    return hash((prev, tuple(tokens))) & ((1 << 61) - 1)


class Block:
    def __init__(self, block_id):
        self.block_id = block_id
        self.ref_count = 0
        self.hash = NONE
        self.token_ids = []


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block_id = {}
        self.free_block_ids = deque(range(num_blocks))
        self.used_block_ids = set()

    def _take(self, block_id):
        b = self.blocks[block_id]
        if self.hash_to_block_id.get(b.hash) == block_id:
            del self.hash_to_block_id[b.hash]
        b.ref_count, b.hash, b.token_ids = 1, NONE, []
        self.free_block_ids.remove(block_id)
        self.used_block_ids.add(block_id)
        return b

    def _hits(self, seq):
        """The blocks a prompt hits, in order (never its last block)."""
        out, prev = [], NONE
        for i in range(seq.num_blocks - 1):
            tokens = seq.block(i)
            h = chain(prev, tokens)
            b = self.hash_to_block_id.get(h)
            if b is None or self.blocks[b].token_ids != tokens:
                break
            out.append((b, h, tokens))
            prev = h
        return out

    def get_token_layout(self, seq):
        hits = self._hits(seq)
        in_used = sum(self.block_size for b, _, _ in hits if b in self.used_block_ids)
        in_free = len(hits) * self.block_size - in_used
        return in_used, in_free, len(seq) - len(hits) * self.block_size

    def can_allocate(self, num_tokens: int) -> bool:
        return len(self.free_block_ids) >= -(-num_tokens // self.block_size)

    def allocate(self, seq):
        assert not seq.block_table
        prev = NONE
        for b, h, tokens in self._hits(seq):
            blk = self.blocks[b]
            if blk.ref_count == 0:
                self._take(b)
                blk.hash, blk.token_ids = h, list(tokens)
                self.hash_to_block_id[h] = b
            else:
                blk.ref_count += 1
            seq.block_table.append(b)
            seq.num_cached_tokens += self.block_size
            prev = h
        self._grow(seq, prev)

    def _grow(self, seq, prev):
        """Blocks for positions up to num_cached_tokens + num_new_tokens; hash the full ones."""
        end = seq.num_cached_tokens + seq.num_new_tokens
        for i in range(len(seq.block_table) * self.block_size, end, self.block_size):
            seq.block_table.append(self._take(self.free_block_ids[0]).block_id)
        first = seq.num_cached_tokens // self.block_size
        for i in range(first, end // self.block_size):
            blk = self.blocks[seq.block_table[i]]
            if i > 0:
                prev = self.blocks[seq.block_table[i - 1]].hash
            if blk.hash == NONE:
                blk.token_ids = seq.block(i)
                blk.hash = chain(prev if i > 0 else NONE, blk.token_ids)
                self.hash_to_block_id[blk.hash] = blk.block_id

    def deallocate(self, seq):
        for b in reversed(seq.block_table):
            blk = self.blocks[b]
            blk.ref_count -= 1
            if blk.ref_count == 0:
                self.used_block_ids.remove(b)
                self.free_block_ids.append(b)
        seq.block_table.clear()
        seq.num_cached_tokens = 0
        seq.num_new_tokens = 0

    def can_append(self, seq, num_new_tokens: int) -> bool:
        end = seq.num_cached_tokens + num_new_tokens
        return len(self.free_block_ids) >= -(-end // self.block_size) - len(seq.block_table)

    def may_append(self, seq):
        self._grow(seq, NONE)
