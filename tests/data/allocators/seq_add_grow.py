"""Sequences added empty, then grown: add_sequence(seq_id), append_tokens(seq_id, n=1),
free_sequence(seq_id), a tables dict and a free_blocks property."""
from dataclasses import dataclass, field


class OutOfBlocks(Exception):
    pass


@dataclass
class BlockAllocator:
    n_blocks: int
    block_size: int
    _free: list = field(init=False)
    tables: dict = field(default_factory=dict)
    lengths: dict = field(default_factory=dict)

    def __post_init__(self):
        self._free = list(range(self.n_blocks))[::-1]

    @property
    def free_blocks(self):
        return len(self._free)

    def add_sequence(self, seq_id):
        self.tables[seq_id] = []
        self.lengths[seq_id] = 0

    def append_tokens(self, seq_id, n=1):
        for _ in range(n):
            if self.lengths[seq_id] == len(self.tables[seq_id]) * self.block_size:
                if not self._free:
                    raise OutOfBlocks(seq_id)
                self.tables[seq_id].append(self._free.pop())
            self.lengths[seq_id] += 1

    def free_sequence(self, seq_id):
        self._free.extend(reversed(self.tables.pop(seq_id)))
        del self.lengths[seq_id]
