"""BUG: the copy keeps the shared block's holder: the old block is never dropped, so it
leaks once every sequence is freed. Copy-on-write: fork(parent, child) shares every block (one holder more each); append_slot
returns the copy (src, dst) when the last block is shared and partial, so the writer owns a
fresh block before it writes; free drops one holder per block."""
from typing import Optional


class CowManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.free_blocks = list(range(num_blocks))
        self.ref_counts = [0] * num_blocks
        self.tables: dict = {}
        self.lengths: dict = {}

    def get_num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def _take(self) -> int:
        b = self.free_blocks.pop()
        self.ref_counts[b] = 1
        return b

    def _drop(self, b: int) -> None:
        self.ref_counts[b] -= 1
        if self.ref_counts[b] == 0:
            self.free_blocks.append(b)

    def allocate(self, seq_id: int, num_tokens: int) -> None:
        need = -(-num_tokens // self.block_size)
        if need > len(self.free_blocks):
            raise MemoryError("out of KV blocks")
        self.tables[seq_id] = [self._take() for _ in range(need)]
        self.lengths[seq_id] = num_tokens

    def append_slot(self, seq_id: int) -> Optional[tuple]:
        table, n = self.tables[seq_id], self.lengths[seq_id]
        if n % self.block_size == 0:  # the last block is full: a new one
            if not self.free_blocks:
                raise MemoryError("out of KV blocks")
            table.append(self._take())
            self.lengths[seq_id] = n + 1
            return None
        last = table[-1]
        if self.ref_counts[last] > 1:  # shared: copy before the write
            if not self.free_blocks:
                raise MemoryError("out of KV blocks")
            new = self._take()
            table[-1] = new
            self.lengths[seq_id] = n + 1
            return (last, new)
        self.lengths[seq_id] = n + 1
        return None

    def fork(self, parent_id: int, child_id: int) -> None:
        self.tables[child_id] = list(self.tables[parent_id])
        self.lengths[child_id] = self.lengths[parent_id]
        for b in self.tables[child_id]:
            self.ref_counts[b] += 1

    def free(self, seq_id: int) -> None:
        for b in self.tables.pop(seq_id):
            self._drop(b)
        del self.lengths[seq_id]

    def get_block_table(self, seq_id: int) -> list:
        return list(self.tables[seq_id])
