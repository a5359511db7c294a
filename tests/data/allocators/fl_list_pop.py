"""A free list kept as a Python list, popped from the end; vLLM-v0-style names."""


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int = 16):
        self.block_size = block_size
        self.free_blocks = list(range(num_blocks - 1, -1, -1))
        self.allocated = set()

    def get_num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def allocate(self, num_blocks: int) -> list:
        if num_blocks > len(self.free_blocks):
            raise MemoryError(f"out of blocks: {num_blocks} asked, {len(self.free_blocks)} free")
        out = [self.free_blocks.pop() for _ in range(num_blocks)]
        self.allocated.update(out)
        return out

    def free(self, block_ids: list) -> None:
        for b in block_ids:
            if b not in self.allocated:
                raise ValueError(f"block {b} is not allocated")
            self.allocated.remove(b)
            self.free_blocks.append(b)
