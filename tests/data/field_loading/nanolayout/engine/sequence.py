"""A request: its tokens, the tokens whose KV is computed (num_cached_tokens), the tokens
the current step computes (num_new_tokens, set by the scheduler) and its block table."""
from itertools import count


class Sequence:
    block_size = 256
    ids = count()

    def __init__(self, token_ids, max_tokens=16):
        self.seq_id = next(Sequence.ids)
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.num_cached_tokens = 0
        self.num_new_tokens = 0
        self.block_table = []
        self.max_tokens = max_tokens
        self.finished = False

    def __len__(self):
        return len(self.token_ids)

    def __getitem__(self, key):
        return self.token_ids[key]

    @property
    def num_blocks(self):
        return -(-len(self.token_ids) // self.block_size)

    def block(self, i):
        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]

    def append_token(self, token_id):
        self.token_ids.append(token_id)
