from dataclasses import dataclass


@dataclass
class Config:
    model: str
    max_num_seqs: int = 4
    max_num_batched_tokens: int = 4096
    max_model_len: int = 4096
    kvcache_block_size: int = 256
    num_kvcache_blocks: int = -1
    eos: int = -1

    def __post_init__(self):
        raise RuntimeError("needs a model directory")
