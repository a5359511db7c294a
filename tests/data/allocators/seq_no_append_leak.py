"""BUG: free returns all but the last block of a request of more than one block (a
slice off by one), so it leaks. A sequence-keyed allocator without decode growth: allocate(request_id, num_tokens)
takes every block a request needs at once, free(request_id) returns them; the table is a
dict attribute."""


class OneShotBlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.free_blocks = list(range(num_blocks))
        self.allocated_blocks: dict = {}

    def allocate(self, request_id: str, num_tokens: int) -> list:
        need = (num_tokens + self.block_size - 1) // self.block_size
        if need > len(self.free_blocks):
            raise RuntimeError(f"OOM: {need} blocks needed, {len(self.free_blocks)} free")
        self.allocated_blocks[request_id] = [self.free_blocks.pop(0) for _ in range(need)]
        return self.allocated_blocks[request_id]

    def free(self, request_id: str) -> None:
        blocks = self.allocated_blocks.pop(request_id, [])
        self.free_blocks.extend(blocks[:-1] if len(blocks) > 1 else blocks)  # BUG: drops the last one

    def get_num_free_blocks(self) -> int:
        return len(self.free_blocks)
