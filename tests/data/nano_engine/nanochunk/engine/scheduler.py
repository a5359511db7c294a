"""Running sequences first (a decode token, or their next prompt chunk), then waiting ones,
within ``chunk_size`` prompt tokens per step; the newest running sequence is preempted when
the pool is full."""
from collections import deque

from nanochunk.config import Config
from nanochunk.engine.block_manager import BlockManager
from nanochunk.engine.sequence import Sequence


class Scheduler:
    def __init__(self, config: Config):
        self.max_num_seqs = config.max_num_seqs
        self.chunk_size = config.chunk_size
        self.eos = config.eos
        self.block_manager = BlockManager(config.num_kvcache_blocks, config.kvcache_block_size)
        self.waiting = deque()
        self.running = deque()

    def is_finished(self):
        return not self.waiting and not self.running

    def add(self, seq: Sequence):
        self.waiting.append(seq)

    def _todo(self, seq, budget):
        """(tokens to compute now, whether they are a prompt chunk, which the budget pays for)."""
        left = len(seq) - seq.num_cached_tokens
        return (1, False) if left == 1 else (min(left, budget), True)

    def schedule(self):
        batch, budget = [], self.chunk_size
        for seq in list(self.running):
            if seq not in self.running:
                continue  # preempted below
            n, chunk = self._todo(seq, budget)
            if n == 0:
                continue
            while not self.block_manager.can_allocate(seq, n):
                victim = self.running[-1]
                self.preempt(victim)
                if victim is seq:
                    break
            else:
                self.block_manager.allocate(seq, n)
                seq.num_scheduled_tokens = n
                budget -= n if chunk else 0
                batch.append(seq)
        while self.waiting and len(batch) < self.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            n, chunk = self._todo(seq, budget)
            if not self.block_manager.can_allocate(seq, n):
                break
            self.block_manager.allocate(seq, n)
            seq.num_scheduled_tokens = n
            budget -= n if chunk else 0
            self.running.append(self.waiting.popleft())
            batch.append(seq)
        return batch, True

    def preempt(self, seq: Sequence):
        self.block_manager.deallocate(seq)
        self.running.remove(seq)
        self.waiting.appendleft(seq)

    def postprocess(self, seqs, token_ids, is_prefill):
        for seq, token in zip(seqs, token_ids):
            seq.num_cached_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            if seq.num_cached_tokens < len(seq):
                continue  # a prompt chunk: nothing sampled yet
            seq.append_token(token)
            if token == self.eos or len(seq) - seq.num_prompt_tokens == seq.max_tokens:
                self.block_manager.deallocate(seq)
                self.running.remove(seq)
