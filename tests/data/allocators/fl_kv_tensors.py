"""An allocator that owns the KV tensors, (layers, blocks, block_size, heads, head_dim) each,
on the device it is given (CUDA by default); blocks come off the end of a free list and
free(block_idx) takes one index."""
import torch


class PagedKVStore:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_heads: int, head_dim: int,
                 device="cuda"):
        shape = (num_layers, num_blocks, block_size, num_heads, head_dim)
        self.k_cache = torch.zeros(shape, device=device)
        self.v_cache = torch.zeros(shape, device=device)
        self.free_blocks = list(range(num_blocks))[::-1]

    def allocate(self) -> int:
        if not self.free_blocks:
            raise MemoryError("out of KV blocks")
        return self.free_blocks.pop()

    def free(self, block_idx: int) -> None:
        self.free_blocks.append(block_idx)
