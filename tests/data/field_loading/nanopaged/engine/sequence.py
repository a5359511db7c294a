"""A request; the scheduler sets the block and page sizes on the class from the config."""
from enum import Enum


class SequenceStatus(Enum):
    WAITING = 1
    RUNNING = 2
    FINISHED = 3


class Sequence:
    block_size = 256
    page_size = 32

    def __init__(self, token_ids, max_tokens=16):
        self.status = SequenceStatus.WAITING
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.num_cached_tokens = 0
        self.block_table = []
        self.max_tokens = max_tokens

    def __len__(self):
        return len(self.token_ids)

    @property
    def num_blocks(self):
        return -(-len(self.token_ids) // self.block_size)

    @property
    def num_pages(self):
        return -(-len(self.token_ids) // self.page_size)

    def block(self, i):
        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]

    def append_token(self, token_id):
        self.token_ids.append(token_id)
