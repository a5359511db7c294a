from dataclasses import dataclass


@dataclass
class Config:
    model: str
    max_num_seqs: int = 4
    max_num_batched_tokens: int = 4096
    kvcache_block_size: int = 256
    page_size: int = 32
    num_kvcache_blocks: int = -1
    eos: int = -1

    def __post_init__(self):
        assert self.kvcache_block_size % 256 == 0 and self.kvcache_block_size % self.page_size == 0
        raise RuntimeError("needs a model directory")
