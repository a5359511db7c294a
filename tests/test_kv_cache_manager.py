"""KVCacheManager semantics the spec relies on, on concrete scenarios."""
from kvspec import impl
from kvspec.targets.v1_driver import observe_pool


def admit(m, rid, prompt):
    r = m.make_request(rid, prompt)
    hits, n = m.get_computed_blocks(r)
    new = m.allocate_slots(r, r.num_tokens - n, n, hits)
    if new is not None:
        r.num_computed_tokens = r.num_tokens
    return r, n, new


def test_full_prompt_cached_still_computes_the_last_token():
    m = impl.KVCacheManager(8, 2)
    r1, _, _ = admit(m, "r1", [1, 2, 3, 4])
    m.free(r1)
    r2 = m.make_request("r2", [1, 2, 3, 4])
    hits, n = m.get_computed_blocks(r2)
    assert n == 2 and len(hits) == 1  # (4 - 1) // 2 blocks at most


def test_lookup_stops_at_the_first_miss():
    m = impl.KVCacheManager(10, 2)
    r1, _, _ = admit(m, "r1", [1, 2, 3, 4, 5, 6, 7])
    m.free(r1)
    r2 = m.make_request("r2", [1, 2, 9, 9, 5, 6, 7])  # block 1 differs, block 2's tokens equal
    hits, n = m.get_computed_blocks(r2)
    assert n == 2 and [b.block_id for b in hits] == [m.block_pool.get_cached_block(r1.block_hashes[0]).block_id]


def test_refused_allocation_changes_nothing_and_does_not_keep_hits():
    m = impl.KVCacheManager(5, 2)  # 4 usable blocks
    r1, _, _ = admit(m, "r1", [1, 2, 3, 4, 5])
    m.free(r1)
    before = observe_pool(m.block_pool)
    r2, n, new = admit(m, "r2", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11])  # needs 6 blocks
    assert new is None and n == 4
    assert observe_pool(m.block_pool) == before and "r2" not in m.req_to_blocks


def test_hits_are_touched_before_new_blocks_are_popped():
    # Pool of 3 usable blocks; r1's two cached blocks are free and at the queue front.
    m = impl.KVCacheManager(4, 2)
    r1, _, _ = admit(m, "r1", [1, 2, 3, 4])
    m.free(r1)
    r2, n, new = admit(m, "r2", [1, 2, 3, 4, 5, 6])
    table = m.get_block_ids("r2")
    assert n == 4 and len(set(table)) == 3
    assert table[:2] == [b.block_id for b in m.block_pool.blocks if b.block_hash in r1.block_hashes]


def test_free_releases_tail_first():
    m = impl.KVCacheManager(8, 2)
    r1, _, _ = admit(m, "r1", [1, 2, 3, 4, 5, 6])
    table = m.get_block_ids("r1")
    m.free(r1)
    queue = [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()]
    assert queue[-3:] == table[::-1]


def test_identical_content_gets_two_blocks_and_both_are_indexed():
    m = impl.KVCacheManager(8, 2)
    admit(m, "r1", [1, 2, 3])
    r2 = m.make_request("r2", [1, 2, 3])
    # r2 skips the lookup: same content, computed again into its own block.
    assert m.allocate_slots(r2, 3) is not None
    a, b = m.get_block_ids("r1")[0], m.get_block_ids("r2")[0]
    assert a != b
    entry = m.block_pool.cached_block_hash_to_block[r2.block_hashes[0]]
    assert set(entry) == {a, b}


def test_decode_caches_a_block_once_it_fills():
    m = impl.KVCacheManager(8, 2)
    r, _, _ = admit(m, "r1", [1, 2, 3])
    last = m.block_pool.blocks[m.get_block_ids("r1")[-1]]
    assert last.block_hash is None
    r.append_output_token_ids(4)
    assert m.allocate_slots(r, r.num_tokens - r.num_computed_tokens) is not None
    assert last.block_hash == r.block_hashes[1]
