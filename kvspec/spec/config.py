"""The configuration an allocator is built with for one run (part of every repro)."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Config:
    level: str = "pool"        # "pool" or "cache"
    num_blocks: int = 8        # including the null block where the target has one
    block_size: int = 2        # tokens per block (cache level)
    caching: bool = True       # prefix caching on

    def to_dict(self) -> dict:
        return asdict(self)
