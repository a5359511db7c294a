"""A sequence-keyed allocator whose copy-on-write is explicit (issue 31, the shape of vLLM
v0's BlockSpaceManager descendants): ``fork_sequence(src, dst)`` shares every block, and
the engine calls ``copy_on_write(seq_id, block_idx) -> (src, dst)`` before writing into a
block another sequence holds; ``allocate_token(seq_id)`` never copies by itself; the
admission check ``can_allocate(num_blocks)`` counts blocks. Correct."""


class ExplicitCowManager:
    def __init__(self, num_blocks, block_size=16):
        self.block_size = block_size
        self.ref = [0] * num_blocks
        self.free_blocks = list(range(num_blocks))
        self.tables = {}
        self.lengths = {}

    def get_num_free_blocks(self):
        return len(self.free_blocks)

    def can_allocate(self, num_blocks):
        return len(self.free_blocks) >= num_blocks

    def _take(self):
        if not self.free_blocks:
            raise RuntimeError("out of blocks")
        b = self.free_blocks.pop(0)
        self.ref[b] = 1
        return b

    def _drop(self, b):
        self.ref[b] -= 1
        if self.ref[b] == 0:
            self.free_blocks.append(b)

    def allocate_sequence(self, seq_id, num_tokens):
        n = -(-num_tokens // self.block_size)
        if n > len(self.free_blocks):
            raise RuntimeError("out of blocks")
        self.tables[seq_id] = [self._take() for _ in range(n)]
        self.lengths[seq_id] = num_tokens

    def allocate_token(self, seq_id):
        """One more token; a new block when the last one is full (no copy here)."""
        if self.lengths[seq_id] % self.block_size == 0:
            self.tables[seq_id].append(self._take())
        self.lengths[seq_id] += 1

    def copy_on_write(self, seq_id, block_idx):
        table = self.tables[seq_id]
        src = table[block_idx]
        if self.ref[src] == 1:
            return src, src
        dst = self._take()
        self.ref[src] -= 1
        table[block_idx] = dst
        return src, dst

    def fork_sequence(self, src_seq_id, dst_seq_id):
        for b in self.tables[src_seq_id]:
            self.ref[b] += 1
        self.tables[dst_seq_id] = list(self.tables[src_seq_id])
        self.lengths[dst_seq_id] = self.lengths[src_seq_id]

    def free_sequence(self, seq_id):
        for b in self.tables.pop(seq_id, []):
            self._drop(b)
        self.lengths.pop(seq_id, None)

    def get_block_table(self, seq_id):
        return list(self.tables.get(seq_id, []))
