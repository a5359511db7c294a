"""Prefill first, else one decode token per running sequence (preempting the newest when
blocks run out); after each step the pages written are reported to the block manager."""
from collections import deque

from nanopaged.config import Config
from nanopaged.engine.block_manager import BlockManager
from nanopaged.engine.sequence import Sequence, SequenceStatus


class Scheduler:
    def __init__(self, config: Config):
        Sequence.block_size = config.kvcache_block_size
        Sequence.page_size = config.page_size
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.eos = config.eos
        self.block_manager = BlockManager(config.num_kvcache_blocks, config.kvcache_block_size, config.page_size)
        self.waiting = deque()
        self.running = deque()

    def is_finished(self):
        return not self.waiting and not self.running

    def add(self, seq: Sequence):
        self.waiting.append(seq)

    def schedule(self):
        batch, tokens = [], 0
        while self.waiting and len(batch) < self.max_num_seqs:
            seq = self.waiting[0]
            if tokens + len(seq) > self.max_num_batched_tokens or not self.block_manager.can_allocate(seq):
                break
            self.block_manager.allocate(seq)
            tokens += len(seq) - seq.num_cached_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(self.waiting.popleft())
            batch.append(seq)
        if batch:
            return batch, True
        while self.running and len(batch) < self.max_num_seqs:
            seq = self.running.popleft()
            while not self.block_manager.can_append(seq):
                if self.running:
                    self.preempt(self.running.pop())
                else:
                    self.preempt(seq)
                    break
            else:
                self.block_manager.may_append(seq)
                batch.append(seq)
        self.running.extendleft(reversed(batch))
        return batch, False

    def preempt(self, seq: Sequence):
        seq.status = SequenceStatus.WAITING
        self.block_manager.deallocate(seq)
        self.waiting.appendleft(seq)

    def postprocess(self, seqs, token_ids):
        for seq, token in zip(seqs, token_ids):
            self.block_manager.note_pages(seq)
            seq.append_token(token)
            if token == self.eos or len(seq) - seq.num_prompt_tokens >= seq.max_tokens:
                seq.status = SequenceStatus.FINISHED
                self.block_manager.deallocate(seq)
                self.running.remove(seq)
