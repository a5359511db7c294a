"""KVCacheBlock: the metadata of one physical KV-cache block.

The KV tensors themselves live in one big device buffer indexed by ``block_id``; this
object only says who uses the block and what content it is known to hold.
"""
from __future__ import annotations

from typing import Optional

from .errors import HashAlreadySetError

BlockHash = bytes


class KVCacheBlock:
    """One block's metadata.

    * ``block_id`` never changes: kernels compute physical addresses from it (I2).
    * ``ref_cnt`` counts holders; a block is in the free queue iff it is 0 (I1).
    * ``block_hash`` is set once, when the block is full and cached (I3), and cleared
      only when the block is evicted for reuse or the prefix cache is reset.
    * ``prev_free_block``/``next_free_block`` belong to FreeKVCacheBlockQueue alone.
    """

    __slots__ = ("block_id", "ref_cnt", "_block_hash", "prev_free_block", "next_free_block", "is_null", "pool")

    def __init__(self, block_id: int, pool: object = None) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self._block_hash: Optional[BlockHash] = None
        self.prev_free_block: Optional[KVCacheBlock] = None
        self.next_free_block: Optional[KVCacheBlock] = None
        self.is_null = False
        self.pool = pool  # the owning BlockPool, so a foreign block can be recognised

    @property
    def block_hash(self) -> Optional[BlockHash]:
        return self._block_hash

    @block_hash.setter
    def block_hash(self, value: BlockHash) -> None:
        if self._block_hash is not None:
            raise HashAlreadySetError(f"block {self.block_id} already has a hash")
        self._block_hash = value

    def reset_hash(self) -> None:
        self._block_hash = None

    def __repr__(self) -> str:
        h = self._block_hash.hex()[:8] if self._block_hash else None
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"
