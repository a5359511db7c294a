"""examples/my_block_manager.py with nano-vllm's admission policy, for kvspec's README.

    kvspec check --target examples/my_block_manager_strict.py:BlockManager

The policy (on purpose, as nano-vllm's boolean ``can_allocate``): a prompt is admitted
only when ALL its blocks are free, its cached ones included. kvspec checks against vLLM's
admission unless told otherwise, finds the difference, hints the declaration that
accepts it, and searches on under that assumption.

The API is nano-vllm's: ``can_allocate``/``allocate`` at prefill, ``can_append``/
``may_append`` at each decode step, ``deallocate`` at preemption and finish, all on
Sequence objects (kvspec brings a Sequence when the module has none). The policy is
vLLM's: a freed block keeps its content cached, at the tail of ``free_block_ids``,
until allocation reuses it; a prefix hit revives it. Prefix hashes are chained with
sha256, and a hit never covers the whole prompt (the last token is always computed).
"""
from collections import deque
import hashlib


class Block:
    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash = -1          # -1: not full, or not cached
        self.token_ids: list[int] = []


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block_id: dict[int, int] = {}
        self.free_block_ids: deque[int] = deque(range(num_blocks))  # front: reused first
        self.used_block_ids: set[int] = set()

    @staticmethod
    def compute_hash(token_ids: list[int], prefix: int = -1) -> int:
        h = hashlib.sha256(prefix.to_bytes(9, "little", signed=True))
        h.update(b"".join(t.to_bytes(8, "little", signed=True) for t in token_ids))
        return int.from_bytes(h.digest()[:8], "little")

    # -- helpers -------------------------------------------------------------------------
    def _hits(self, seq) -> list[int]:
        """The cached prefix: full blocks only, never the whole prompt, stop at a miss."""
        hits, h = [], -1
        for i in range((len(seq) - 1) // self.block_size):
            h = self.compute_hash(seq.block(i), h)
            block_id = self.hash_to_block_id.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def _take_free_block(self) -> int:
        block_id = self.free_block_ids.popleft()
        block = self.blocks[block_id]
        if block.hash != -1 and self.hash_to_block_id.get(block.hash) == block_id:
            del self.hash_to_block_id[block.hash]  # evict: its content is about to be overwritten
        block.hash, block.token_ids, block.ref_count = -1, [], 1
        self.used_block_ids.add(block_id)
        return block_id

    def _cache(self, block_id: int, token_ids: list[int], prefix: int) -> None:
        block = self.blocks[block_id]
        block.hash, block.token_ids = self.compute_hash(token_ids, prefix), list(token_ids)
        self.hash_to_block_id[block.hash] = block_id  # one block per hash: the latest wins

    # -- prefill -------------------------------------------------------------------------
    def can_allocate(self, seq) -> bool:
        return len(self.free_block_ids) >= seq.num_blocks  # every block, cached ones too (the policy)

    def allocate(self, seq) -> None:
        assert not seq.block_table
        hits = self._hits(seq)
        for block_id in hits:  # revive or share the hits first, so allocation cannot evict them
            block = self.blocks[block_id]
            if block.ref_count == 0:
                self.free_block_ids.remove(block_id)
                self.used_block_ids.add(block_id)
            block.ref_count += 1
            seq.block_table.append(block_id)
        seq.num_cached_tokens = len(hits) * self.block_size
        prefix = self.blocks[hits[-1]].hash if hits else -1
        for i in range(len(hits), seq.num_blocks):
            block_id = self._take_free_block()
            seq.block_table.append(block_id)
            token_ids = seq.block(i)
            if len(token_ids) == self.block_size:
                self._cache(block_id, token_ids, prefix)
                prefix = self.blocks[block_id].hash

    # -- decode --------------------------------------------------------------------------
    def can_append(self, seq) -> bool:
        return len(self.free_block_ids) >= (len(seq) % self.block_size == 1)

    def may_append(self, seq) -> None:
        """Called after the new token was appended to ``seq``."""
        table = seq.block_table
        if len(seq) % self.block_size == 1:  # the token opens a new block
            table.append(self._take_free_block())
        elif len(seq) % self.block_size == 0:  # the token fills the last block: cache it
            prefix = self.blocks[table[-2]].hash if len(table) > 1 else -1
            self._cache(table[-1], seq.block(len(table) - 1), prefix)

    # -- preemption and finish -----------------------------------------------------------
    def deallocate(self, seq) -> None:
        for block_id in reversed(seq.block_table):  # tail first: the prefix stays cached longest
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.used_block_ids.remove(block_id)
                self.free_block_ids.append(block_id)
        seq.num_cached_tokens = 0
        seq.block_table.clear()
