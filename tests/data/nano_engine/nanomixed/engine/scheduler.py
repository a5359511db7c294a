"""Mixed batches: every running sequence gets its decode token or its next prompt chunk, then
waiting ones are admitted, within ``chunk_size`` prompt tokens per step; the newest running
sequence is preempted when the pool is full. ``schedule()`` returns a ``ScheduledBatch``."""
from collections import deque
from dataclasses import dataclass, field

from nanomixed.config import Config
from nanomixed.engine.block_manager import BlockManager
from nanomixed.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    sequences: list = field(default_factory=list)
    num_prefill_tokens: int = 0


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
        left = len(seq) - seq.num_cached_tokens
        return (1, False) if left == 1 else (min(left, budget), True)

    def schedule(self) -> ScheduledBatch:
        out, budget = ScheduledBatch(), self.chunk_size
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
                self.block_manager.allocate_incremental(seq, n)
                seq.num_scheduled_tokens = n
                budget -= n if chunk else 0
                out.num_prefill_tokens += n if chunk else 0
                out.sequences.append(seq)
        while self.waiting and len(out.sequences) < self.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            n, chunk = self._todo(seq, budget)
            if not self.block_manager.can_allocate(seq, n):
                break
            self.block_manager.allocate_and_hash(seq, n)
            n = min(n, len(seq) - seq.num_cached_tokens)
            seq.num_scheduled_tokens = n
            budget -= n
            out.num_prefill_tokens += n
            seq.status = SequenceStatus.RUNNING
            self.running.append(self.waiting.popleft())
            out.sequences.append(seq)
        return out

    def preempt(self, seq: Sequence):
        seq.status = SequenceStatus.WAITING
        self.running.remove(seq)
        self.block_manager.deallocate(seq)
        self.waiting.appendleft(seq)

    def postprocess(self, batch: ScheduledBatch, token_ids):
        for seq, token in zip(batch.sequences, token_ids):
            seq.num_cached_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            if seq.num_cached_tokens < len(seq):
                continue  # a prompt chunk: nothing sampled yet
            seq.append_token(token)
            if (not seq.ignore_eos and token == self.eos) or seq.num_completion_tokens == seq.max_tokens:
                seq.status = SequenceStatus.FINISHED
                self.block_manager.deallocate(seq)
                self.running.remove(seq)
