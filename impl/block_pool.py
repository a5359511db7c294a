"""BlockPool: owns every block, the free queue and the prefix-cache index."""
from __future__ import annotations

from typing import Iterable, Optional, Sequence

from .block import BlockHash, KVCacheBlock
from .errors import (
    DoubleFreeError,
    ForeignBlockError,
    HashAlreadySetError,
    InvalidCountError,
    KVCacheError,
    NullBlockError,
    OutOfBlocksError,
    PartialBlockError,
)
from .free_queue import FreeKVCacheBlockQueue


class BlockPool:
    """The allocator.

    Invariants it keeps (kvspec's catalogue ids in brackets):

    * block 0 is the null block: a placeholder for "no block here", never handed
      out, queued, hashed or counted as free [NULL_BLOCK];
    * a non-null block is in the free queue iff its ref_cnt is 0 [I1];
    * a cached block with ref_cnt 0 stays in the queue *and* the index, so the cache
      costs no memory: ``get_new_blocks`` evicts it lazily when it pops it, and
      ``touch`` revives it on a hit [I4];
    * the index never deduplicates held blocks: two blocks may share a hash [I2];
    * free order is eviction order: ``free_blocks`` appends in the caller's order.

    Every misuse raises a ``KVCacheError`` subclass before any state changes.
    """

    # The policies kvspec checks this pool against: declared, never read off the code
    # (see kvspec.targets.policies). Freed blocks go to the back, hashed or not.
    kvspec_traits = {
        "prefix_caching": "both", "free_order": "lru_tail_first", "unhashed_free_first": False,
        "whole_prompt_hits": False, "null_block": 0,
        # one class per kind where a call can misuse only one way; KVCacheError for the rest
        "misuse_errors": {"bad_count": InvalidCountError, "over_alloc": OutOfBlocksError,
                          "double_free": DoubleFreeError, "free_unheld": DoubleFreeError,
                          "null_block": NullBlockError, "foreign_free": ForeignBlockError, "*": KVCacheError},
    }

    def __init__(self, num_gpu_blocks: int, enable_caching: bool = True) -> None:
        if not isinstance(num_gpu_blocks, int) or num_gpu_blocks < 1:
            raise InvalidCountError(f"num_gpu_blocks must be an int >= 1, got {num_gpu_blocks!r}")
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i, pool=self) for i in range(num_gpu_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # hash -> {block_id: block}; several blocks may hold the same content.
        self.cached_block_hash_to_block: dict[BlockHash, dict[int, KVCacheBlock]] = {}
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True

    # -- checks shared by the mutators: they run before anything is changed -------
    def _check_own(self, block: KVCacheBlock, what: str) -> None:
        if not isinstance(block, KVCacheBlock) or block.pool is not self:
            raise ForeignBlockError(f"cannot {what} {block!r}: it does not belong to this pool")
        if block.is_null:
            raise NullBlockError(f"cannot {what} the null block")

    # -- queries ----------------------------------------------------------------
    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        usable = self.num_gpu_blocks - 1
        return 1.0 - self.get_num_free_blocks() / usable if usable else 0.0

    def get_cached_block(self, block_hash: BlockHash) -> Optional[KVCacheBlock]:
        """Any block holding ``block_hash``'s content, or None."""
        entry = self.cached_block_hash_to_block.get(block_hash)
        return next(iter(entry.values())) if entry else None

    # -- allocation -------------------------------------------------------------
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop ``num_blocks`` from the front of the free queue, evicting cached ones."""
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 0:
            raise InvalidCountError(f"num_blocks must be a non-negative int, got {num_blocks!r}")
        if num_blocks > self.get_num_free_blocks():
            raise OutOfBlocksError(f"cannot get {num_blocks} blocks: only {self.get_num_free_blocks()} free")
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            if self.enable_caching:
                self._maybe_evict_cached_block(block)
            block.ref_cnt = 1
        return blocks

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        """Drop ``block`` from the index before its memory is reused."""
        block_hash = block.block_hash
        if block_hash is None:
            return False
        entry = self.cached_block_hash_to_block.get(block_hash)
        if entry is not None:
            entry.pop(block.block_id, None)
            if not entry:
                del self.cached_block_hash_to_block[block_hash]
        block.reset_hash()
        return True

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Add a holder to each block; a free (cached) block is revived from the queue."""
        for block in blocks:
            self._check_own(block, "touch")
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one holder from each block. The first block is evicted first."""
        blocks = list(ordered_blocks)
        drops: dict[int, int] = {}
        for block in blocks:
            self._check_own(block, "free")
            drops[block.block_id] = drops.get(block.block_id, 0) + 1
            if drops[block.block_id] > block.ref_cnt:
                raise DoubleFreeError(
                    f"block {block.block_id} freed {drops[block.block_id]} time(s) but held {block.ref_cnt} time(s)"
                )
        released = []
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                released.append(block)
        self.free_block_queue.append_n(released)

    # -- prefix cache -----------------------------------------------------------
    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
    ) -> None:
        """Register ``blocks[num_cached_blocks:num_full_blocks]`` under their hashes.

        ``block_hashes[i]`` is the chained hash of the i-th full block of the request;
        a block without one is partial, and caching it is refused (I3).
        """
        if not self.enable_caching or num_full_blocks <= num_cached_blocks:
            return
        if num_cached_blocks < 0 or num_full_blocks > len(blocks):
            raise InvalidCountError(
                f"block range [{num_cached_blocks}, {num_full_blocks}) is outside a table of {len(blocks)}"
            )
        if num_full_blocks > len(block_hashes):
            raise PartialBlockError(
                f"block {blocks[len(block_hashes)].block_id} is not full (only {len(block_hashes)} full-block hashes)"
            )
        new = blocks[num_cached_blocks:num_full_blocks]
        for block in new:
            self._check_own(block, "cache")
            if block.block_hash is not None:
                raise HashAlreadySetError(f"block {block.block_id} is already cached")
        if len({b.block_id for b in new}) != len(new):
            raise HashAlreadySetError("the same block appears twice in one cache_full_blocks call")
        for i, block in enumerate(new, start=num_cached_blocks):
            block.block_hash = block_hashes[i]
            self.cached_block_hash_to_block.setdefault(block_hashes[i], {})[block.block_id] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is held."""
        if self.get_num_free_blocks() != self.num_gpu_blocks - 1:
            return False
        self.cached_block_hash_to_block.clear()
        for block in self.blocks:
            block.reset_hash()
        return True
