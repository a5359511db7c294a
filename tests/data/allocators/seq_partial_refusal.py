"""Blocks taken one at a time while admitting a sequence.

BUG: when the pool runs out part way through allocate_sequence, the blocks already taken
are not given back: the refusal changes the state (they leak)."""


class GreedySeqAllocator:
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.free_ids = list(range(num_blocks))
        self.tables: dict = {}
        self.lens: dict = {}

    def get_num_free_blocks(self) -> int:
        return len(self.free_ids)

    def allocate_sequence(self, seq_id, n_tokens: int) -> None:
        table = self.tables.setdefault(seq_id, [])
        for _ in range(-(-n_tokens // self.block_size)):
            if not self.free_ids:
                raise MemoryError("out of blocks")  # BUG: the blocks in table stay taken
            table.append(self.free_ids.pop(0))
        self.lens[seq_id] = n_tokens

    def append_token(self, seq_id) -> None:
        if self.lens[seq_id] % self.block_size == 0:
            if not self.free_ids:
                raise MemoryError("out of blocks")
            self.tables[seq_id].append(self.free_ids.pop(0))
        self.lens[seq_id] += 1

    def free_sequence(self, seq_id) -> None:
        self.free_ids.extend(self.tables.pop(seq_id, []))
        self.lens.pop(seq_id, None)

    def get_block_table(self, seq_id):
        return self.tables[seq_id]
