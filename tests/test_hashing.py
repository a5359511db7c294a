"""Parent-chained block hashes."""
import hashlib

from hypothesis import given, strategies as st

from kvspec.impl import HASH_FUNCTIONS, hash_block_tokens, hash_request_tokens
from kvspec.impl import hashing

tokens = st.lists(st.integers(0, 50), min_size=2, max_size=2)


@given(tokens, tokens, tokens)
def test_same_block_after_different_parents_hashes_differently(a, b, c):
    for fn in HASH_FUNCTIONS.values():
        ab = hash_request_tokens(fn, 2, a + c)
        bc = hash_request_tokens(fn, 2, b + c)
        assert (ab[1] == bc[1]) == (a == b)


@given(st.lists(st.integers(0, 9), max_size=12), st.integers(1, 4))
def test_request_hashes_cover_exactly_the_full_blocks(toks, bs):
    fn = HASH_FUNCTIONS["sha256"]
    hs = hash_request_tokens(fn, bs, toks)
    assert len(hs) == len(toks) // bs
    parent = None
    for i, h in enumerate(hs):
        assert h == hash_block_tokens(fn, parent, toks[i * bs:(i + 1) * bs])
        parent = h


def test_extra_keys_change_the_hash():
    fn = HASH_FUNCTIONS["xxhash"]
    assert hash_block_tokens(fn, None, [1, 2]) != hash_block_tokens(fn, None, [1, 2], ("lora", 7))


def test_root_parent_is_a_seeded_constant_not_hash_of_none():
    fn = HASH_FUNCTIONS["sha256"]
    saved = hashing.NONE_HASH
    try:
        a = hashing.init_none_hash(fn, seed=1)
        b = hashing.init_none_hash(fn, seed=2)
        assert a != b and a == hashing.init_none_hash(fn, seed=1)
        assert a != hashlib.sha256(repr(None).encode()).digest()
        # The first block's hash depends on the root.
        h1 = hash_block_tokens(fn, None, [1, 2])
        hashing.init_none_hash(fn, seed=2)
        assert hash_block_tokens(fn, None, [1, 2]) != h1
    finally:
        hashing.NONE_HASH = saved


def test_encoding_separates_token_boundaries():
    fn = HASH_FUNCTIONS["sha256"]
    assert hash_block_tokens(fn, None, [1, 23]) != hash_block_tokens(fn, None, [12, 3])
    assert hash_block_tokens(fn, None, [256]) != hash_block_tokens(fn, None, [0, 1])
