"""A paged KV pool with prefix caching, grown a chunk at a time. A block is hashed (and put
in the index) in the call that allocates room for its last token; freed blocks stay cached
until reused; reusing one drops its old entry; the prompt's last token is never a hit."""
from collections import deque

NO_HASH = -1


def cdiv(a, b):
    return -(-a // b)


class Block:
    def __init__(self, block_id):
        self.block_id = block_id
        self.ref_count = 0
        self.hash = NO_HASH
        self.token_ids = []


class BlockManager:
    kvspec_traits = {"free_evicts": False, "null_block": "none", "prefix_caching": "on"}

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids = deque(range(num_blocks))
        self.used_block_ids = set()
        self.hash_to_block_id = {}

    @staticmethod
    def chain(prev, tokens):
        return hash((prev, tuple(tokens))) & ((1 << 62) - 1)

    def _hits(self, seq):
        """The cached blocks of the prompt's leading full blocks (never its last token)."""
        hits, prev = [], NO_HASH
        for i in range((len(seq) - 1) // self.block_size):
            tokens = seq.block(i)
            h = self.chain(prev, tokens)
            b = self.hash_to_block_id.get(h)
            if b is None or self.blocks[b].token_ids != tokens:
                break
            hits.append(b)
            prev = h
        return hits

    def can_allocate(self, seq, num_tokens: int) -> bool:
        if seq.block_table:
            need = cdiv(seq.num_cached_tokens + num_tokens, self.block_size) - len(seq.block_table)
            return need <= len(self.free_block_ids)
        hits = self._hits(seq)
        end = min(len(hits) * self.block_size + num_tokens, len(seq))
        need = cdiv(end, self.block_size) - len(hits)
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        return need + revived <= len(self.free_block_ids)

    def _take(self, block_id):
        b = self.blocks[block_id]
        if b.hash != NO_HASH and self.hash_to_block_id.get(b.hash) == block_id:
            del self.hash_to_block_id[b.hash]
        b.ref_count, b.hash, b.token_ids = 1, NO_HASH, []
        self.free_block_ids.remove(block_id)
        self.used_block_ids.add(block_id)
        return b

    def _hash_full(self, seq, upto):
        """Hash the blocks that the first ``upto`` tokens fill."""
        for i in range(upto // self.block_size):
            b = self.blocks[seq.block_table[i]]
            if b.hash != NO_HASH:
                continue
            prev = self.blocks[seq.block_table[i - 1]].hash if i else NO_HASH
            tokens = seq.block(i)
            b.hash, b.token_ids = self.chain(prev, tokens), list(tokens)
            self.hash_to_block_id[b.hash] = b.block_id

    def allocate_and_hash(self, seq, num_new_tokens: int):
        """Admission: the prefix hit, then room for ``num_new_tokens`` more, hashed as they fill."""
        assert not seq.block_table, "admission of a sequence that holds blocks"
        hits = self._hits(seq)
        for b in hits:
            if self.blocks[b].ref_count == 0:
                h, tokens = self.blocks[b].hash, self.blocks[b].token_ids
                self._take(b)
                self.blocks[b].hash, self.blocks[b].token_ids = h, tokens
                self.hash_to_block_id[h] = b
            else:
                self.blocks[b].ref_count += 1
            seq.block_table.append(b)
        seq.num_cached_tokens = len(hits) * self.block_size
        end = min(seq.num_cached_tokens + num_new_tokens, len(seq))
        while len(seq.block_table) < cdiv(end, self.block_size):
            seq.block_table.append(self._take(self.free_block_ids[0]).block_id)
        self._hash_full(seq, end)

    def allocate_incremental(self, seq, chunk: int):
        """Room for the next ``chunk`` tokens of a running sequence (a prompt chunk or a decode token)."""
        end = seq.num_cached_tokens + chunk
        while len(seq.block_table) < cdiv(end, self.block_size):
            seq.block_table.append(self._take(self.free_block_ids[0]).block_id)
        self._hash_full(seq, end)

    def deallocate(self, seq):
        for block_id in reversed(seq.block_table):
            b = self.blocks[block_id]
            b.ref_count -= 1
            if b.ref_count == 0:
                self.used_block_ids.remove(block_id)
                self.free_block_ids.append(block_id)
        seq.block_table.clear()
        seq.num_cached_tokens = 0
