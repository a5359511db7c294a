"""Prefill first (FIFO, within the token budget and the pool), else one decode token for
each running sequence, preempting the newest running ones when the pool is full. The batch
is a list of (sequence, tokens this step computes for it)."""
from collections import deque

from nanoshapes.engine.block_manager import BlockManager
from nanoshapes.engine.sequence import Sequence, SequenceStatus


class Scheduler:
    def __init__(self, max_num_sequences: int, max_num_batched_tokens: int, num_pages: int, block_size: int,
                 eos: int):
        self.max_num_sequences = max_num_sequences
        self.max_num_batched_tokens = max_num_batched_tokens
        self.eos = eos
        self.block_manager = BlockManager(num_pages, block_size)
        self.waiting = deque()
        self.running = deque()

    def is_finished(self):
        return not self.waiting and not self.running

    def add_request(self, seq: Sequence):
        self.waiting.append(seq)

    def schedule(self) -> list[tuple[Sequence, int]]:
        batch, tokens = [], 0
        while self.waiting and len(batch) < self.max_num_sequences:
            seq = self.waiting[0]
            if tokens + len(seq) > self.max_num_batched_tokens or not self.block_manager.can_allocate(seq):
                break
            self.block_manager.allocate(seq)
            n = len(seq) - seq.num_cached_tokens
            tokens += n
            seq.status = SequenceStatus.RUNNING
            self.running.append(self.waiting.popleft())
            batch.append((seq, n))
        if batch:
            return batch
        keep = deque()
        while self.running and len(batch) < self.max_num_sequences:
            seq = self.running.popleft()
            while not self.block_manager.can_append(seq):
                if self.running:
                    self.preempt(self.running.pop())
                else:
                    self.preempt(seq)
                    break
            else:
                self.block_manager.may_append(seq)
                batch.append((seq, 1))
        keep.extend(seq for seq, _ in batch)
        self.running.extendleft(reversed(keep))
        return batch

    def preempt(self, seq: Sequence):
        seq.status = SequenceStatus.WAITING
        self.block_manager.deallocate(seq)
        self.waiting.appendleft(seq)

    def postprocess(self, batch: list[tuple[Sequence, int]], token_ids: list[int]):
        for (seq, _), token in zip(batch, token_ids):
            seq.append_token(token)
            if (not seq.ignore_eos and token == self.eos) or seq.num_completion_tokens == seq.max_tokens:
                seq.status = SequenceStatus.FINISHED
                self.block_manager.deallocate(seq)
                self.running.remove(seq)
