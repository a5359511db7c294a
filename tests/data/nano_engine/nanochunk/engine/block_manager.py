"""Blocks for a sequence's computed tokens plus the ones the step computes."""
from collections import deque

from nanochunk.engine.sequence import Sequence


class Block:
    def __init__(self, block_id):
        self.block_id = block_id
        self.ref_count = 0


class BlockManager:
    kvspec_traits = {"null_block": "none", "prefix_caching": "off"}  # declared for kvspec

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids = deque(range(num_blocks))

    def _needed(self, seq: Sequence, num_tokens: int) -> int:
        return -(-(seq.num_cached_tokens + num_tokens) // self.block_size) - len(seq.block_table)

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self._needed(seq, num_tokens) <= len(self.free_block_ids)

    def allocate(self, seq: Sequence, num_tokens: int):
        for _ in range(self._needed(seq, num_tokens)):
            block_id = self.free_block_ids.popleft()
            self.blocks[block_id].ref_count = 1
            seq.block_table.append(block_id)

    def deallocate(self, seq: Sequence):
        for block_id in reversed(seq.block_table):
            self.blocks[block_id].ref_count = 0
            self.free_block_ids.append(block_id)
        seq.block_table.clear()
        seq.num_cached_tokens = 0
