"""One request; ``num_cached_tokens`` counts the tokens whose KV is computed so far."""
from itertools import count


class Sequence:
    block_size = 256
    ids = count()

    def __init__(self, token_ids, max_tokens: int = 16):
        self.seq_id = next(Sequence.ids)
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.num_cached_tokens = 0
        self.num_scheduled_tokens = 0
        self.block_table = []
        self.max_tokens = max_tokens

    def __len__(self):
        return len(self.token_ids)

    @property
    def num_blocks(self):
        return -(-len(self.token_ids) // self.block_size)

    def append_token(self, token_id):
        self.token_ids.append(token_id)
