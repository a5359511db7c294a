"""A block allocator with an API of its own, as small engines write them: a free list
with ``allocate(n) -> ids``, ``free(ids)`` and ``num_free()``. kvspec checks it with
nothing declared (``kvspec check --target examples/free_list_allocator.py:FreeListAllocator``).

``EagerFreeListAllocator`` has a bug seen in the wild: its capacity check is written with
``>=`` where ``>`` is meant, so it refuses a request for exactly the blocks that are free
(the last free block can never be handed out)."""
from collections import deque


class FreeListAllocator:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.free_ids = deque(range(num_blocks))
        self.held: set[int] = set()

    def num_free(self) -> int:
        return len(self.free_ids)

    def allocate(self, n: int):
        if n < 0 or n > len(self.free_ids):
            return None  # refused: nothing changes
        ids = [self.free_ids.popleft() for _ in range(n)]
        self.held.update(ids)
        return ids

    def free(self, ids) -> None:
        ids = list(ids)
        if len(set(ids)) != len(ids) or not all(b in self.held for b in ids):
            raise ValueError(f"free of blocks not held: {ids}")
        for b in ids:
            self.held.remove(b)
            self.free_ids.append(b)


class EagerFreeListAllocator(FreeListAllocator):
    def allocate(self, n: int):
        if n < 0 or n >= len(self.free_ids):  # BUG: >= refuses n == the free count
            return None
        ids = [self.free_ids.popleft() for _ in range(n)]
        self.held.update(ids)
        return ids
