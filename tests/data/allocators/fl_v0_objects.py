"""vLLM-v0-shaped: the allocator hands out block objects (block_number, ref_count) one at a
time, built as BlockAllocator(device, block_size, num_blocks)."""


class PhysicalBlock:
    def __init__(self, block_number: int, block_size: int):
        self.block_number = block_number
        self.block_size = block_size
        self.ref_count = 0


class BlockAllocator:
    def __init__(self, device, block_size: int, num_blocks: int):
        self.device = device
        self.free_blocks = [PhysicalBlock(i, block_size) for i in range(num_blocks)]

    def allocate(self) -> PhysicalBlock:
        if not self.free_blocks:
            raise ValueError("Out of memory! No free blocks are available.")
        block = self.free_blocks.pop()
        block.ref_count = 1
        return block

    def free(self, block: PhysicalBlock) -> None:
        if block.ref_count == 0:
            raise ValueError(f"Double free! {block.block_number} is already freed.")
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_blocks.append(block)

    def get_num_free_blocks(self) -> int:
        return len(self.free_blocks)
