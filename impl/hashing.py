"""Parent-chained block hashes: the property that makes the cache a *prefix* cache.

``hash(block_i) = H(hash(block_{i-1}), tokens_i, extra_keys)``: a hit on block i
guarantees that every token before it matched too, which is what attention needs
(the KV at position p depends on every token up to p).

The first block's parent is ``NONE_HASH``, a constant derived from a seed, never
``hash(None)``: a predictable root would let one tenant precompute another's block
hashes (vLLM #12621).
"""
from __future__ import annotations

import hashlib
import os
import struct
from typing import Callable, Optional, Sequence

import xxhash

from .block import BlockHash

HashFn = Callable[[bytes], bytes]


def sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def xxhash128(data: bytes) -> bytes:
    """Fast non-cryptographic option (xxh3, 128 bits)."""
    return xxhash.xxh3_128_digest(data)


HASH_FUNCTIONS: dict[str, HashFn] = {"sha256": sha256, "xxhash": xxhash128}

NONE_HASH: BlockHash = b""


def init_none_hash(hash_fn: HashFn = sha256, seed: Optional[int] = None) -> BlockHash:
    """Set the root parent hash. Default seed: PYTHONHASHSEED if set, else random."""
    global NONE_HASH
    if seed is None:
        env = os.environ.get("PYTHONHASHSEED")
        seed_bytes = env.encode() if env else os.urandom(32)
    else:
        seed_bytes = str(seed).encode()
    NONE_HASH = hash_fn(b"kvspec-none-hash:" + seed_bytes)
    return NONE_HASH


init_none_hash()


def _encode(parent: bytes, token_ids: Sequence[int], extra_keys: Optional[tuple]) -> bytes:
    # Length-prefixed fields, so (parent, tokens, extras) is recoverable from the bytes
    # and two different triples cannot encode to the same input.
    tokens = struct.pack(f"<{len(token_ids)}q", *token_ids)
    extra = repr(extra_keys).encode() if extra_keys is not None else b""
    return b"".join(struct.pack("<I", len(x)) + x for x in (parent, tokens, extra))


def hash_block_tokens(
    hash_fn: HashFn,
    parent_block_hash: Optional[BlockHash],
    curr_block_token_ids: Sequence[int],
    extra_keys: Optional[tuple] = None,
) -> BlockHash:
    """Hash one full block, chained to its parent's hash."""
    parent = parent_block_hash if parent_block_hash is not None else NONE_HASH
    return hash_fn(_encode(parent, curr_block_token_ids, extra_keys))


def hash_request_tokens(
    hash_fn: HashFn, block_size: int, token_ids: Sequence[int], extra_keys: Optional[tuple] = None
) -> list[BlockHash]:
    """Hashes of every full block of ``token_ids`` (a trailing partial block gets none)."""
    hashes: list[BlockHash] = []
    parent: Optional[BlockHash] = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(hash_fn, parent, token_ids[start:start + block_size], extra_keys)
        hashes.append(parent)
    return hashes
