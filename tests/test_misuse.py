"""Every documented misuse raises its exception and leaves the observed state unchanged."""
import pytest

from kvspec import impl
from kvspec.targets.v1_driver import observe_pool


def pool_with_state():
    """A pool with held, cached-free and plain free blocks."""
    p = impl.BlockPool(8)
    a = p.get_new_blocks(3)
    p.cache_full_blocks(a, [b"h0", b"h1"], 0, 2)
    p.free_blocks([a[1]])       # block 2: cached, ref 0, queued
    p.touch([a[0]])             # block 1: ref 2
    return p, a


CASES = {
    "double free": (impl.DoubleFreeError, lambda p, a: p.free_blocks([a[2], a[2]])),
    "free of an unheld block": (impl.DoubleFreeError, lambda p, a: p.free_blocks([p.blocks[6]])),
    "free of the null block": (impl.NullBlockError, lambda p, a: p.free_blocks([p.null_block])),
    "touch of the null block": (impl.NullBlockError, lambda p, a: p.touch([p.null_block])),
    "negative count": (impl.InvalidCountError, lambda p, a: p.get_new_blocks(-1)),
    "too large a count": (impl.OutOfBlocksError, lambda p, a: p.get_new_blocks(p.get_num_free_blocks() + 1)),
    "caching a partial block": (impl.PartialBlockError, lambda p, a: p.cache_full_blocks(a, [b"x"], 0, 3)),
    "caching a hashed block": (impl.HashAlreadySetError, lambda p, a: p.cache_full_blocks(a, [b"x", b"y"], 0, 1)),
    "free of a foreign block": (impl.ForeignBlockError, lambda p, a: p.free_blocks([impl.BlockPool(4).get_new_blocks(1)[0]])),
    "touch of a foreign block": (impl.ForeignBlockError, lambda p, a: p.touch([impl.BlockPool(4).blocks[1]])),
    # A valid prefix before the bad block: nothing of it may be applied either.
    "free with a bad block last": (impl.DoubleFreeError, lambda p, a: p.free_blocks([a[0], a[2], p.blocks[7]])),
}


@pytest.mark.parametrize("name", CASES)
def test_misuse_raises_documented_error_and_changes_nothing(name):
    error, call = CASES[name]
    p, a = pool_with_state()
    before = observe_pool(p)
    with pytest.raises(error) as exc:
        call(p, a)
    assert isinstance(exc.value, impl.KVCacheError)
    assert observe_pool(p) == before


def test_manager_rejects_freeing_an_unknown_request_and_changes_nothing():
    m = impl.KVCacheManager(6, 2)
    r = m.make_request("r1", [1, 2, 3])
    hits, n = m.get_computed_blocks(r)
    assert m.allocate_slots(r, 3, n, hits) is not None
    before = (observe_pool(m.block_pool), dict(m.req_to_blocks))
    with pytest.raises(impl.UnknownRequestError):
        m.free(m.make_request("ghost", [1]))
    assert (observe_pool(m.block_pool), dict(m.req_to_blocks)) == before


def test_hash_is_set_once():
    b = impl.KVCacheBlock(1)
    b.block_hash = b"x"
    with pytest.raises(impl.HashAlreadySetError):
        b.block_hash = b"y"
    assert b.block_hash == b"x"
