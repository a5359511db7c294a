"""kvspec's reference paged KV-cache allocator, after vLLM v1's design.

``KVCacheBlock`` (metadata of one block), ``FreeKVCacheBlockQueue`` (the free list,
whose order is the eviction policy), ``BlockPool`` (allocation, sharing, the
prefix-cache index), ``hash_block_tokens`` (the parent-chained block hash) and
``KVCacheManager`` (per-request tables). ``HybridKVCacheManager`` adds KV-cache groups
(full, sliding window, chunked local) over one pool, chunked prefill, draft slots,
extra keys, connector tokens and the max_model_len cap. Misuse raises a ``KVCacheError`` subclass
from ``kvspec.impl.errors`` and leaves the state unchanged.
"""
from .block import BlockHash, KVCacheBlock
from .block_pool import BlockPool
from .errors import (
    DoubleFreeError,
    ForeignBlockError,
    HashAlreadySetError,
    InvalidCountError,
    KVCacheError,
    NullBlockError,
    OutOfBlocksError,
    PartialBlockError,
    RequestStateError,
    UnknownRequestError,
)
from .free_queue import FreeKVCacheBlockQueue
from .hashing import HASH_FUNCTIONS, hash_block_tokens, hash_request_tokens, init_none_hash
from .kv_cache_manager import KVCacheManager, Request
from .extra_keys import ExtraKeys, KeyedRequest, parse_extra
from .hybrid_manager import HybridKVCacheManager
from .kv_cache_groups import KVGroupSpec, parse_kv_groups

__all__ = [
    "BlockHash", "KVCacheBlock", "BlockPool", "FreeKVCacheBlockQueue", "KVCacheManager", "Request",
    "hash_block_tokens", "hash_request_tokens", "init_none_hash", "HASH_FUNCTIONS",
    "KVCacheError", "DoubleFreeError", "ForeignBlockError", "HashAlreadySetError", "InvalidCountError",
    "NullBlockError", "OutOfBlocksError", "PartialBlockError", "RequestStateError", "UnknownRequestError",
    "HybridKVCacheManager", "KVGroupSpec", "parse_kv_groups", "ExtraKeys", "KeyedRequest", "parse_extra",
]
