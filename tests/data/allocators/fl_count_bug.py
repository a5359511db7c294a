"""A free list that keeps its free count in a counter.

BUG: free() adds the batch size once per block freed, so after freeing two blocks at once
the count says four came back (the reported free count lies)."""
from collections import deque


class KVBlockAllocator:
    def __init__(self, num_blocks: int):
        self.free_ids = deque(range(num_blocks))
        self.num_free_blocks = num_blocks

    def allocate(self, n: int):
        if n > self.num_free_blocks:
            return None
        self.num_free_blocks -= n
        return [self.free_ids.popleft() for _ in range(n)]

    def free(self, ids) -> None:
        for b in ids:
            self.free_ids.append(b)
            self.num_free_blocks += len(ids)  # BUG: should be += 1
