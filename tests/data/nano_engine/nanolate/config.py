"""What a real config would load from a model directory; the scheduler reads a few fields."""
from dataclasses import dataclass


@dataclass
class Config:
    model: str
    max_num_seqs: int = 4
    max_num_batched_tokens: int = 64
    num_kvcache_blocks: int = -1
    kvcache_block_size: int = 256
    eos: int = -1

    def __post_init__(self):
        raise RuntimeError("needs a model directory")
