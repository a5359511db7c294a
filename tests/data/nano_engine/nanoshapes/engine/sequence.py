"""One request: its tokens and where their KV lives (block_table)."""
from enum import Enum
from itertools import count

from nanoshapes.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = 1
    RUNNING = 2
    FINISHED = 3


class Sequence:
    block_size = 256
    ids = count()

    def __init__(self, token_ids, sampling_params=SamplingParams()):
        self.seq_id = next(Sequence.ids)
        self.status = SequenceStatus.WAITING
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.num_cached_tokens = 0
        self.block_table = []
        self.max_tokens = sampling_params.max_tokens
        self.ignore_eos = sampling_params.ignore_eos

    def __len__(self):
        return len(self.token_ids)

    @property
    def num_completion_tokens(self):
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_blocks(self):
        return -(-len(self.token_ids) // self.block_size)

    def block(self, i):
        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]

    def append_token(self, token_id):
        self.token_ids.append(token_id)
