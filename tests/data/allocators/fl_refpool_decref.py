"""A ref-counted pool: allocate() takes one block at ref 1, allocate_many(count) all or
nothing, incref adds a holder, decref drops one and frees the block at zero (the shape of
a pool that prefix hits and forks share)."""
from collections import deque


class RefPool:
    def __init__(self, num_blocks: int) -> None:
        self._refs = [0] * num_blocks
        self._free: deque = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise MemoryError("no free block")
        b = self._free.popleft()
        self._refs[b] = 1
        return b

    def allocate_many(self, count: int) -> list:
        if count < 0 or count > len(self._free):
            raise MemoryError(f"{count} blocks asked, {len(self._free)} free")
        return [self.allocate() for _ in range(count)]

    def incref(self, block_id: int) -> None:
        if self._refs[block_id] == 0:
            raise ValueError(f"block {block_id} is free")
        self._refs[block_id] += 1

    def decref(self, block_id: int) -> bool:
        if self._refs[block_id] == 0:
            raise ValueError(f"block {block_id} is already free")
        self._refs[block_id] -= 1
        if self._refs[block_id] == 0:
            self._free.append(block_id)
            return True
        return False

    def decref_many(self, block_ids: list) -> int:
        return sum(self.decref(b) for b in block_ids)
