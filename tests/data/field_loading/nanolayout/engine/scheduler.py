"""Running sequences first (one new token each, preempting the newest when blocks run out),
then waiting ones, each admitted by its token layout; after the forward the new tokens
are cached."""
from collections import deque

from nanolayout.config import Config
from nanolayout.engine.block_manager import BlockManager
from nanolayout.engine.sequence import Sequence


class Scheduler:
    def __init__(self, config: Config):
        self.max_num_seqs = config.max_num_seqs
        self.eos = config.eos
        self.block_manager = BlockManager(config.num_kvcache_blocks, config.kvcache_block_size)
        self.waiting = deque()
        self.running = deque()

    def is_finished(self):
        return not self.waiting and not self.running

    def add(self, seq: Sequence):
        self.waiting.append(seq)

    def schedule(self):
        batch, preempted, i = [], False, 0
        while i < len(self.running):
            seq = self.running[i]
            n = len(seq) - seq.num_cached_tokens
            while not self.block_manager.can_append(seq, n):
                victim = self.running.pop()
                self.block_manager.deallocate(victim)
                self.waiting.appendleft(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                seq.num_new_tokens = n
                self.block_manager.may_append(seq)
                batch.append(seq)
                i += 1
        while not preempted and self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            _, in_free, new = self.block_manager.get_token_layout(seq)
            if not self.block_manager.can_allocate(in_free + new):
                break
            seq.num_new_tokens = new
            self.block_manager.allocate(seq)
            self.running.append(self.waiting.popleft())
            batch.append(seq)
        return batch

    def postprocess(self, seqs, token_ids, logits_indices):
        """``logits_indices``: the indexes in ``seqs`` of the sequences that computed logits (one
        token each in ``token_ids``)."""
        for i, token in zip(logits_indices, token_ids):
            seq = seqs[i]
            seq.append_token(token)
            if token == self.eos or len(seq) - seq.num_prompt_tokens >= seq.max_tokens:
                seq.finished = True
                self.block_manager.deallocate(seq)
                self.running.remove(seq)
        for seq in seqs:
            if not seq.finished:
                seq.num_cached_tokens += seq.num_new_tokens
                seq.num_new_tokens = 0
