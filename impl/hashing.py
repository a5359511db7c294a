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
    """Length-prefixed fields, so (parent, tokens, extras) is recoverable from the bytes
    and two different triples cannot encode to the same input.

    pre: all(-2**63 <= t < 2**63 for t in token_ids)
    post: _decode(__return__) == (parent, list(token_ids), _extra_bytes(extra_keys))
    """
    tokens = struct.pack(f"<{len(token_ids)}q", *token_ids)
    extra = _extra_bytes(extra_keys)
    return b"".join(struct.pack("<I", len(x)) + x for x in (parent, tokens, extra))


def _extra_bytes(extra_keys: Optional[tuple]) -> bytes:
    return repr(extra_keys).encode() if extra_keys is not None else b""


def _decode(data: bytes) -> Optional[tuple[bytes, list[int], bytes]]:
    """The inverse of ``_encode`` (for its contract and for tests); None if malformed."""
    fields = []
    pos = 0
    for _ in range(3):
        if pos + 4 > len(data):
            return None
        (n,) = struct.unpack("<I", data[pos:pos + 4])
        if pos + 4 + n > len(data):
            return None
        fields.append(data[pos + 4:pos + 4 + n])
        pos += 4 + n
    parent, tokens, extra = fields
    if pos != len(data) or len(tokens) % 8:
        return None
    return parent, list(struct.unpack(f"<{len(tokens) // 8}q", tokens)), extra


def block_hash_input(
    parent_block_hash: Optional[BlockHash],
    curr_block_token_ids: Sequence[int],
    extra_keys: Optional[tuple] = None,
) -> bytes:
    """The bytes a block's hash is computed over: its parent's hash (NONE_HASH for
    the first block), its tokens and the extra keys, all recoverable.

    Token ids are int64, as in a tensor.

    pre: all(-2**63 <= t < 2**63 for t in curr_block_token_ids)
    post: _decode(__return__) == (NONE_HASH if parent_block_hash is None else parent_block_hash, list(curr_block_token_ids), _extra_bytes(extra_keys))
    """
    parent = parent_block_hash if parent_block_hash is not None else NONE_HASH
    return _encode(parent, curr_block_token_ids, extra_keys)


def hash_block_tokens(
    hash_fn: HashFn,
    parent_block_hash: Optional[BlockHash],
    curr_block_token_ids: Sequence[int],
    extra_keys: Optional[tuple] = None,
) -> BlockHash:
    """Hash one full block, chained to its parent's hash."""
    return hash_fn(block_hash_input(parent_block_hash, curr_block_token_ids, extra_keys))


def hash_request_tokens(
    hash_fn: HashFn, block_size: int, token_ids: Sequence[int], extra_keys: Optional[tuple] = None
) -> list[BlockHash]:
    """Hashes of every full block of ``token_ids`` (a trailing partial block gets none).

    pre: block_size >= 1
    pre: all(-2**63 <= t < 2**63 for t in token_ids)
    post: len(__return__) == len(token_ids) // block_size
    """
    hashes: list[BlockHash] = []
    parent: Optional[BlockHash] = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(hash_fn, parent, token_ids[start:start + block_size], extra_keys)
        hashes.append(parent)
    return hashes
