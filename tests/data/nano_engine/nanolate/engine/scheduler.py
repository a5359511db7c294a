"""Prefill first (FIFO, within the token budget and the pool), else one decode token for each
running sequence, preempting the newest running ones when the pool is full. The blocks a step
filled are published in ``postprocess``, after the forward pass."""
from collections import deque

from nanolate.config import Config
from nanolate.engine.block_manager import BlockManager
from nanolate.engine.sequence import Sequence, SequenceStatus


class Scheduler:
    def __init__(self, config: Config):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.eos = config.eos
        self.block_manager = BlockManager(config.num_kvcache_blocks, config.kvcache_block_size)
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
            if tokens + len(seq) > self.max_num_batched_tokens:
                break
            num_cached_blocks = self.block_manager.can_allocate(seq)
            if num_cached_blocks < 0:
                break
            self.block_manager.allocate(seq, num_cached_blocks)
            tokens += len(seq) - seq.num_cached_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(self.waiting.popleft())
            batch.append(seq)
        if batch:
            return batch, True
        keep = deque()
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
        keep.extend(batch)
        self.running.extendleft(reversed(keep))
        return batch, False

    def preempt(self, seq: Sequence):
        seq.status = SequenceStatus.WAITING
        self.block_manager.deallocate(seq)
        self.waiting.appendleft(seq)

    def postprocess(self, seqs, token_ids, is_prefill):
        for seq, token in zip(seqs, token_ids):
            self.block_manager.commit_hashes(seq)  # the forward pass computed every token of seq
            seq.append_token(token)
            if (not seq.ignore_eos and token == self.eos) or seq.num_completion_tokens == seq.max_tokens:
                seq.status = SequenceStatus.FINISHED
                self.block_manager.deallocate(seq)
                self.running.remove(seq)
