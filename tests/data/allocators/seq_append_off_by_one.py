"""A sequence allocator that counts tokens before checking for a new block.

BUG: append_token increments the length first and then opens a block when the new length
is a multiple of the block size: the token that starts a new block gets no block, and a
block is opened one token late (the table does not cover the sequence's tokens)."""


class LateBlockAllocator:
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.free_ids = list(range(num_blocks))
        self.tables: dict = {}
        self.lens: dict = {}

    def get_num_free_blocks(self) -> int:
        return len(self.free_ids)

    def allocate_sequence(self, seq_id, n_tokens: int):
        need = -(-n_tokens // self.block_size)
        if need > len(self.free_ids):
            return None
        self.tables[seq_id] = [self.free_ids.pop(0) for _ in range(need)]
        self.lens[seq_id] = n_tokens
        return self.tables[seq_id]

    def append_token(self, seq_id):
        self.lens[seq_id] += 1
        if self.lens[seq_id] % self.block_size == 0:  # BUG: should test the length before the token
            if not self.free_ids:
                self.lens[seq_id] -= 1
                return None
            self.tables[seq_id].append(self.free_ids.pop(0))
        return True

    def free_sequence(self, seq_id) -> None:
        self.free_ids.extend(self.tables.pop(seq_id))
        del self.lens[seq_id]

    def get_block_table(self, seq_id):
        return self.tables[seq_id]
