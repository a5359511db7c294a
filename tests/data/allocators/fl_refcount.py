"""A free list with ref counts: blocks shared by forked sequences (incref) go back to the free
list when their last holder frees them."""


class RefCountedAllocator:
    def __init__(self, num_blocks: int):
        self.ref_counts = [0] * num_blocks
        self.free_ids = list(range(num_blocks))

    def get_num_free_blocks(self) -> int:
        return len(self.free_ids)

    def allocate(self, n: int) -> list:
        if n < 0 or n > len(self.free_ids):
            raise MemoryError("out of blocks")
        ids, self.free_ids = self.free_ids[:n], self.free_ids[n:]
        for b in ids:
            self.ref_counts[b] = 1
        return ids

    def incref(self, block_ids: list) -> None:
        for b in block_ids:
            if self.ref_counts[b] == 0:
                raise ValueError(f"block {b} is free")
            self.ref_counts[b] += 1

    def free(self, block_ids: list) -> None:
        for b in block_ids:
            if self.ref_counts[b] == 0:
                raise ValueError(f"double free of block {b}")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free_ids.append(b)
