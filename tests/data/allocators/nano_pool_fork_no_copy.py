"""A nano-vllm-shaped manager without can_append (issue 31): ``can_allocate(seq,
num_tokens=None)`` / ``allocate(seq, num_tokens=None)`` (decode is a one-token allocate),
``append_slot(seq)``, ``fork(parent, child)`` sharing every block with copy-on-write of a
shared partial last block, ``free(seq)``; its state lives in a ref-counted pool it owns and
in its own Sequence (prompt and output kept apart, ``num_computed_tokens``,
``reset_for_recompute``).

BUG: a write into a forked sequence's shared partial last block does not copy it first
(allocate skips the copy-on-write), so the child overwrites the parent's KV."""
from collections import deque
from dataclasses import dataclass, field
from typing import Optional


class Pool:
    def __init__(self, num_blocks):
        self.num_blocks = num_blocks
        self._refs = [0] * num_blocks
        self._free = deque(range(num_blocks))

    @property
    def num_free(self):
        return len(self._free)

    def allocate_many(self, n):
        if n > len(self._free):
            raise MemoryError(f"{n} blocks asked, {len(self._free)} free")
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self._refs[b] = 1
        return out

    def incref(self, b):
        self._refs[b] += 1

    def decref_many(self, ids):
        for b in ids:
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)


@dataclass
class Sequence:
    prompt_token_ids: list
    output_token_ids: list = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: Optional[list] = None
    tokens_held: int = 0  # tokens the table has room reserved for

    def __len__(self):
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def token_ids(self):
        return self.prompt_token_ids + self.output_token_ids

    def append_token(self, token_id):
        self.output_token_ids.append(token_id)

    def reset_for_recompute(self):
        self.num_computed_tokens = 0


class PoolBlockManager:
    def __init__(self, num_blocks, block_size=16):
        self.block_size = block_size
        self.pool = Pool(num_blocks)

    def _needed(self, seq, n):
        have = len(seq.block_table or []) * self.block_size
        need = -(-max(0, seq.tokens_held + n - have) // self.block_size)
        if n and self._shared_partial(seq):
            need += 1  # the copy of the shared last block
        return need

    def _shared_partial(self, seq):
        t = seq.block_table
        return bool(t) and seq.tokens_held % self.block_size != 0 and self.pool._refs[t[-1]] > 1

    def can_allocate(self, seq, num_tokens=None):
        n = len(seq) - seq.num_computed_tokens if num_tokens is None else num_tokens
        return self._needed(seq, n) <= self.pool.num_free

    def allocate(self, seq, num_tokens=None):
        n = len(seq) - seq.num_computed_tokens if num_tokens is None else num_tokens
        if seq.block_table is None:
            seq.block_table = []
        have = len(seq.block_table) * self.block_size
        seq.block_table += self.pool.allocate_many(-(-max(0, seq.tokens_held + n - have) // self.block_size))
        seq.tokens_held += n

    def _copy_last(self, seq):
        fresh = self.pool.allocate_many(1)[0]
        old = seq.block_table[-1]
        seq.block_table[-1] = fresh  # (the KV copy old -> fresh would go here)
        self.pool.decref_many([old])

    def append_slot(self, seq):
        self.allocate(seq, 1)

    def fork(self, parent, child):
        for b in parent.block_table:
            self.pool.incref(b)
        child.block_table = list(parent.block_table)
        child.tokens_held = parent.tokens_held

    def free(self, seq):
        if seq.block_table is None:
            return
        table, seq.block_table, seq.tokens_held = seq.block_table, None, 0
        self.pool.decref_many(table)
