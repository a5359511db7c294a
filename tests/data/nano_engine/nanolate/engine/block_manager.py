"""A paged KV pool with prefix caching whose hashes are published after the forward pass:
``allocate`` takes the cached prefix ``can_allocate`` counted and fresh blocks for the rest,
``commit_hashes`` (called by the scheduler's postprocess) hashes the blocks the step filled.
Freed blocks stay cached until reused; reusing one drops its old entry."""
from collections import deque

NO_HASH = -1


class Block:
    def __init__(self, block_id):
        self.block_id = block_id
        self.ref_count = 0
        self.hash = NO_HASH
        self.token_ids = []


class BlockManager:
    kvspec_traits = {"free_evicts": False, "null_block": "none", "prefix_caching": "on"}

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids = deque(range(num_blocks))
        self.used_block_ids = set()
        self.hash_to_block_id = {}

    @staticmethod
    def chain(prev, tokens):
        return hash((prev, tuple(tokens))) & ((1 << 62) - 1)

    def _hits(self, seq):
        hits, prev = [], NO_HASH
        for i in range((len(seq) - 1) // self.block_size):
            tokens = seq.block(i)
            h = self.chain(prev, tokens)
            b = self.hash_to_block_id.get(h)
            if b is None or self.blocks[b].token_ids != tokens:
                break
            hits.append(b)
            prev = h
        return hits

    def can_allocate(self, seq) -> int:
        """The number of cached blocks the prompt starts with, or -1 when it does not fit."""
        hits = self._hits(seq)
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        need = seq.num_blocks - len(hits) + revived
        return len(hits) if need <= len(self.free_block_ids) else -1

    def _take(self, block_id):
        b = self.blocks[block_id]
        if b.hash != NO_HASH and self.hash_to_block_id.get(b.hash) == block_id:
            del self.hash_to_block_id[b.hash]
        b.ref_count, b.hash, b.token_ids = 1, NO_HASH, []
        self.free_block_ids.remove(block_id)
        self.used_block_ids.add(block_id)
        return b

    def allocate(self, seq, num_cached_blocks: int):
        assert not seq.block_table, "allocate of a sequence that holds blocks"
        for b in self._hits(seq)[:num_cached_blocks]:
            block = self.blocks[b]
            if block.ref_count == 0:
                h, tokens = block.hash, block.token_ids
                self._take(b)
                block.hash, block.token_ids = h, tokens
                self.hash_to_block_id[h] = b
            else:
                block.ref_count += 1
            seq.block_table.append(b)
        seq.num_cached_tokens = num_cached_blocks * self.block_size
        while len(seq.block_table) < seq.num_blocks:
            seq.block_table.append(self._take(self.free_block_ids[0]).block_id)

    def commit_hashes(self, seq):
        """Publish the hashes of the blocks the sequence's computed tokens fill."""
        for i in range(len(seq) // self.block_size):
            b = self.blocks[seq.block_table[i]]
            if b.hash != NO_HASH:
                continue
            prev = self.blocks[seq.block_table[i - 1]].hash if i else NO_HASH
            tokens = seq.block(i)
            b.hash, b.token_ids = self.chain(prev, tokens), list(tokens)
            self.hash_to_block_id[b.hash] = b.block_id

    def can_append(self, seq) -> bool:
        return len(seq) % self.block_size != 1 or len(self.free_block_ids) > 0

    def may_append(self, seq):
        if len(seq) % self.block_size == 1:
            seq.block_table.append(self._take(self.free_block_ids[0]).block_id)

    def deallocate(self, seq):
        for block_id in reversed(seq.block_table):
            b = self.blocks[block_id]
            b.ref_count -= 1
            if b.ref_count == 0:
                self.used_block_ids.remove(block_id)
                self.free_block_ids.append(block_id)
        seq.block_table.clear()
        seq.num_cached_tokens = 0
