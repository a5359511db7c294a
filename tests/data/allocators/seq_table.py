"""A sequence-keyed allocator: the table per sequence, blocks added as tokens arrive."""


class SequenceBlockAllocator:
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.free_ids = list(range(num_blocks))
        self.tables: dict = {}
        self.lengths: dict = {}

    def get_num_free_blocks(self) -> int:
        return len(self.free_ids)

    def allocate_sequence(self, seq_id, num_tokens: int) -> list:
        need = -(-num_tokens // self.block_size)
        if need > len(self.free_ids):
            raise MemoryError("not enough KV blocks")
        self.tables[seq_id] = [self.free_ids.pop(0) for _ in range(need)]
        self.lengths[seq_id] = num_tokens
        return self.tables[seq_id]

    def append_token(self, seq_id) -> bool:
        n = self.lengths[seq_id]
        if n % self.block_size == 0:
            if not self.free_ids:
                return False
            self.tables[seq_id].append(self.free_ids.pop(0))
        self.lengths[seq_id] = n + 1
        return True

    def free_sequence(self, seq_id) -> None:
        self.free_ids.extend(self.tables.pop(seq_id))
        del self.lengths[seq_id]

    def get_block_table(self, seq_id) -> list:
        return list(self.tables[seq_id])
