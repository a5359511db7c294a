"""A Sequence for nano-vllm-style block managers whose module brings none.

A nano-vllm BlockManager reads a request through a small surface: its tokens
(``len(seq)``, ``seq.block(i)``, ``seq.num_blocks``), its ``block_table`` and its
``num_cached_tokens``; newer managers also read ``num_scheduled_tokens``. This class
provides that surface and nothing else (no sampling parameters, no status).
"""
from __future__ import annotations

from typing import Iterable


class Sequence:
    block_size: int = 16  # the driver sets it on each instance to the manager's block size

    def __init__(self, token_ids: Iterable[int], block_size: int | None = None) -> None:
        self.token_ids: list[int] = list(token_ids)
        if not self.token_ids:
            raise ValueError("a sequence needs at least one token")
        if block_size is not None:
            self.block_size = block_size
        self.num_prompt_tokens = len(self.token_ids)
        self.num_cached_tokens = 0     # KV already in the table (the prefix hit, right after allocate)
        self.num_scheduled_tokens = 0  # tokens the current step computes (newer managers' hash_blocks)
        self.block_table: list[int] = []

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    def __len__(self) -> int:
        return len(self.token_ids)

    def __getitem__(self, key):
        return self.token_ids[key]

    @property
    def num_blocks(self) -> int:
        return -(-len(self.token_ids) // self.block_size)

    @property
    def num_cached_blocks(self) -> int:
        return self.num_cached_tokens // self.block_size

    @property
    def last_block_num_tokens(self) -> int:
        return len(self.token_ids) - (self.num_blocks - 1) * self.block_size

    def block(self, i: int) -> list[int]:
        """The tokens of logical block ``i`` (the last one may be partial)."""
        if not 0 <= i < self.num_blocks:
            raise IndexError(f"block {i} of a sequence with {self.num_blocks} blocks")
        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def pop_token(self) -> int:
        """Undo ``append_token`` (the driver's refused decode step)."""
        return self.token_ids.pop()
