"""A request; its block size comes from the global config."""
from nanoglobal.config import get_config


class Sequence:
    def __init__(self, token_ids):
        self.block_size = get_config().kvcache_block_size
        self.token_ids = list(token_ids)
        self.num_cached_tokens = 0
        self.block_table = []

    def __len__(self):
        return len(self.token_ids)

    @property
    def num_blocks(self):
        return -(-len(self.token_ids) // self.block_size)

    def block(self, i):
        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]

    def append_token(self, token_id):
        self.token_ids.append(token_id)
