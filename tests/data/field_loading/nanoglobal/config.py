"""The engine calls init_config(model, ...) once; everything else reads get_config()."""
import os
from dataclasses import dataclass


@dataclass
class Config:
    model: str
    max_num_seqs: int = 4
    kvcache_block_size: int = 256
    num_kvcache_blocks: int = -1

    def __post_init__(self):
        if not os.path.isdir(self.model):
            raise ValueError(f"{self.model} is not a model directory")


_config = None


def init_config(model: str, **kwargs) -> Config:
    global _config
    _config = Config(model, **kwargs)
    return _config


def get_config() -> Config:
    if _config is None:
        raise RuntimeError("the config is not set: call init_config(model) first")
    return _config
