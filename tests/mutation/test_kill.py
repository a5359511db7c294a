"""The killing suite's small unit checks (mutation testing of impl: tools/mutate.py).

What kvspec's stateful machines do not observe: usage, the hash encoding's inverse,
the block repr. Run first in the killing suite (they take milliseconds, so a mutant
they kill costs no machine time); the machines are in test_machines.py, run last.
Without ``KVSPEC_IMPL_DIR``/``KVSPEC_MUTANT`` they run on the real impl and must pass;
with either (see conftest.py) they run on the mutant, and a failure kills it."""
from kvspec import impl


def test_usage_reports_the_held_fraction():
    pool = impl.BlockPool(5)
    assert pool.get_usage() == 0.0
    blocks = pool.get_new_blocks(2)
    assert pool.get_usage() == 0.5
    pool.free_blocks(blocks)
    assert pool.get_usage() == 0.0
    assert impl.BlockPool(1).get_usage() == 0.0
    m = impl.KVCacheManager(5, 2)
    assert m.usage == 0.0


def test_hash_input_encoding_round_trips():
    from kvspec.impl import hashing

    for parent, tokens, extra in ((b"", [], None), (b"p" * 32, [1, -2, 2**63 - 1], ("x", 1)), (b"q", [0], ())):
        data = hashing._encode(parent, tokens, extra)
        assert hashing._decode(data) == (parent, tokens, hashing._extra_bytes(extra))
        assert hashing._decode(data + b"!") is None and hashing._decode(data[:-1] if data else b"x") is None
    assert hashing.block_hash_input(None, [5]) == hashing._encode(hashing.NONE_HASH, [5], None)


def test_block_repr_names_id_ref_and_hash():
    b = impl.KVCacheBlock(3)
    assert repr(b) == "KVCacheBlock(id=3, ref=0, hash=None)"
    b.block_hash = bytes.fromhex("0123456789")
    assert repr(b) == "KVCacheBlock(id=3, ref=0, hash=01234567)"


def test_extra_keys_enter_the_hash_input_and_none_adds_nothing():
    from kvspec.impl import hashing

    fn = impl.HASH_FUNCTIONS["sha256"]
    assert hashing._extra_bytes(None) == b""
    assert hashing._extra_bytes(("lora", 7)) != hashing._extra_bytes(("lora", 8))
    assert hash_of(fn, ("lora", 7)) != hash_of(fn, ("lora", 8)) != hash_of(fn, None)


def hash_of(fn, extra):
    return impl.hash_block_tokens(fn, None, [1, 2], extra)


def test_request_block_hashes_are_the_chained_hashes_of_its_full_blocks():
    # Request extends its hashes as tokens arrive; they must equal hash_request_tokens
    # over all its tokens (what a caller comparing against the hash function sees).
    from kvspec.impl.kv_cache_manager import Request

    fn = impl.HASH_FUNCTIONS["sha256"]
    for bs in (1, 2, 3):
        r = Request("r", [5, 6, 7, 8, 9], bs, fn)
        assert r.block_hashes == impl.hash_request_tokens(fn, bs, r.all_token_ids)
        for t in (10, 11, 12, 13):
            r.append_output_token_ids(t)
            assert r.block_hashes == impl.hash_request_tokens(fn, bs, r.all_token_ids)
            assert r.num_tokens == len(r.all_token_ids)


# -- argument validation and the hash encoding's edges: each check below kills mutants
#    of impl that the stateful machines cannot see (they only make valid calls, and
#    misuse calls of the documented kinds), found by tools/mutate.py.
import pytest  # noqa: E402

from kvspec.impl import hashing  # noqa: E402


def test_usage_on_an_even_pool():
    pool = impl.BlockPool(4)
    pool.get_new_blocks(1)
    assert pool.get_usage() == pytest.approx(1 / 3)


@pytest.mark.parametrize("bad", [0, -1, 2.0, "3", None])
def test_pool_and_manager_sizes_are_validated(bad):
    with pytest.raises(impl.InvalidCountError):
        impl.BlockPool(bad)
    with pytest.raises(impl.InvalidCountError):
        impl.KVCacheManager(5, bad)


@pytest.mark.parametrize("bad", [True, 1.5, -1, "1"])
def test_get_new_blocks_rejects_non_int_counts(bad):
    pool = impl.BlockPool(4)
    with pytest.raises(impl.InvalidCountError):
        pool.get_new_blocks(bad)
    assert pool.get_num_free_blocks() == 3


def _pool_with_blocks():
    pool = impl.BlockPool(6)
    return pool, pool.get_new_blocks(3)


def test_cache_full_blocks_range_edges():
    pool, blocks = _pool_with_blocks()
    # an empty range is a no-op, whatever the hashes (even too few of them)
    pool.cache_full_blocks(blocks, [b"h0"], 3, 2)
    pool.cache_full_blocks(blocks, [b"h0"], 2, 2)
    assert all(b.block_hash is None for b in blocks) and not pool.cached_block_hash_to_block
    for c, f in ((-1, 1), (0, 4)):  # outside the table
        with pytest.raises(impl.InvalidCountError):
            pool.cache_full_blocks(blocks, [b"h0", b"h1", b"h2", b"h3"], c, f)
    assert all(b.block_hash is None for b in blocks)
    pool.cache_full_blocks(blocks, [b"h0", b"h1"], 0, 2)
    assert [b.block_hash for b in blocks] == [b"h0", b"h1", None]


def test_cache_full_blocks_without_caching_is_a_no_op():
    pool = impl.BlockPool(6, enable_caching=False)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [b"h0", b"h1"], 0, 2)
    assert [b.block_hash for b in blocks] == [None, None] and not pool.cached_block_hash_to_block


def test_cache_full_blocks_checks_every_block_before_changing_anything():
    pool, blocks = _pool_with_blocks()
    other = impl.BlockPool(4).get_new_blocks(1)[0]
    for table, err in (([blocks[0], other], impl.ForeignBlockError),
                       ([blocks[0], pool.null_block], impl.NullBlockError),
                       ([blocks[0], blocks[0]], impl.HashAlreadySetError)):
        with pytest.raises(err):
            pool.cache_full_blocks(table, [b"h0", b"h1"], 0, 2)
        assert blocks[0].block_hash is None and not pool.cached_block_hash_to_block
    pool.cache_full_blocks([blocks[1]], [b"h1"], 0, 1)
    with pytest.raises(impl.HashAlreadySetError):  # a hashed block after a fresh one
        pool.cache_full_blocks([blocks[0], blocks[1]], [b"h0", b"h1"], 0, 2)
    assert blocks[0].block_hash is None and list(pool.cached_block_hash_to_block) == [b"h1"]


def test_allocate_slots_counts():
    m = impl.KVCacheManager(6, 2)
    r = m.make_request("r", [1, 2, 3])
    for args in ((-1,), (1, -1)):
        with pytest.raises(impl.InvalidCountError):
            m.allocate_slots(r, *args)
    assert m.get_block_ids("r") == []
    assert len(m.allocate_slots(r, 3)) == 2
    r.num_computed_tokens = 3
    assert m.allocate_slots(r, 0) == []  # no new tokens: nothing to allocate, not an error
    assert len(m.get_block_ids("r")) == 2


def test_no_hits_when_caching_is_off():
    m = impl.KVCacheManager(6, 2, enable_caching=False)
    r = m.make_request("r", [1, 2, 3])
    assert m.get_computed_blocks(r) == ([], 0)


ENCODINGS = [(b"", [], None), (b"abcd", [7], None), (b"p" * 5, [1, 2, 3, 4, 5, 6, 7], ("lora", 12)),
             (b"q" * 32, list(range(40)), ("x",)), (b"r" * 6, [-1], ()), (b"s" * 12, [2**62], ("abcdefgh",))]


@pytest.mark.parametrize("parent, tokens, extra", ENCODINGS)
def test_decode_inverts_encode_and_rejects_every_truncation(parent, tokens, extra):
    data = hashing._encode(parent, tokens, extra)
    assert hashing._decode(data) == (parent, tokens, hashing._extra_bytes(extra))
    for k in range(len(data)):
        assert hashing._decode(data[:k]) is None, k
    assert hashing._decode(data + b"\0") is None


def test_decode_rejects_a_token_field_that_is_not_whole_int64s():
    import struct

    def field(x):
        return struct.pack("<I", len(x)) + x
    for n in (1, 7, 9, 15):
        assert hashing._decode(field(b"") + field(b"\1" * n) + field(b"")) is None


def test_a_pool_past_the_small_int_cache():
    # counts above 256 are distinct int objects: an `is` comparison of them would be wrong
    pool = impl.BlockPool(300)
    blocks = pool.get_new_blocks(299)
    pool.cache_full_blocks(blocks, [bytes([i % 256, i // 256]) for i in range(299)], 0, 299)
    assert len(pool.cached_block_hash_to_block) == 299
    assert pool.reset_prefix_cache() is False
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True and not pool.cached_block_hash_to_block
