"""A free list with ref counts for shared (copy-on-write) blocks.

BUG: free() puts a block back on the free list whenever it is freed, even while another
holder still shares it (it tests the count before decrementing): a shared block is handed
out again while still in use."""


class SharedBlockPool:
    def __init__(self, num_blocks: int):
        self.ref_counts = [0] * num_blocks
        self.free_ids = list(range(num_blocks))

    def get_num_free_blocks(self) -> int:
        return len(self.free_ids)

    def allocate(self, n: int) -> list:
        if n > len(self.free_ids):
            raise MemoryError("out of blocks")
        ids, self.free_ids = self.free_ids[:n], self.free_ids[n:]
        for b in ids:
            self.ref_counts[b] = 1
        return ids

    def incref(self, block_ids: list) -> None:
        for b in block_ids:
            self.ref_counts[b] += 1

    def free(self, block_ids: list) -> None:
        for b in block_ids:
            if self.ref_counts[b] > 0:  # BUG: should append only when the count reaches 0
                self.free_ids.append(b)
            self.ref_counts[b] -= 1
