"""A sequence-keyed allocator that owns the KV cache, (num_blocks, block_size, heads,
head_dim) per K and V: a new block is cleared when a sequence takes it, and a sequence's
blocks are cleared when it is freed."""
import torch


class SeqKVCache:
    def __init__(self, num_blocks: int, block_size: int, num_heads: int = 2, head_dim: int = 4):
        self.block_size = block_size
        self.k_cache = torch.zeros(num_blocks, block_size, num_heads, head_dim)
        self.v_cache = torch.zeros(num_blocks, block_size, num_heads, head_dim)
        self.free_blocks = list(range(num_blocks))
        self.tables: dict = {}
        self.lengths: dict = {}

    def _take(self) -> int:
        b = self.free_blocks.pop()
        self.k_cache[b] = 0
        self.v_cache[b] = 0
        return b

    def allocate_sequence(self, seq_id, num_tokens: int) -> None:
        need = -(-num_tokens // self.block_size)
        if need > len(self.free_blocks):
            raise MemoryError("out of KV blocks")
        self.tables[seq_id] = [self._take() for _ in range(need)]
        self.lengths[seq_id] = num_tokens

    def append_token(self, seq_id) -> None:
        if self.lengths[seq_id] % self.block_size == 0:
            if not self.free_blocks:
                raise MemoryError("out of KV blocks")
            self.tables[seq_id].append(self._take())
        self.lengths[seq_id] += 1

    def free_sequence(self, seq_id) -> None:
        for b in self.tables.pop(seq_id):
            self.k_cache[b] = 0
            self.v_cache[b] = 0
            self.free_blocks.append(b)
        del self.lengths[seq_id]

    def get_block_table(self, seq_id) -> list:
        return list(self.tables[seq_id])
