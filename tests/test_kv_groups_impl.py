"""impl's KV-cache groups: hits per group and agreed, window freeing, chunked prefill,
draft slots, extra keys, connector tokens and the max_model_len cap."""
from __future__ import annotations

import pytest

from kvspec.impl import InvalidCountError, KVCacheManager
from kvspec.impl.extra_keys import ExtraKeys, MMInput, parse_extra
from kvspec.impl.hybrid_manager import HybridKVCacheManager
from kvspec.impl.kv_cache_groups import KVGroupSpec, find_agreed_hit, find_group_hit, parse_kv_groups


def admit(m, rid, prompt, extra=None, chunk=None, external=0):
    r = m.make_request(rid, prompt, extra)
    hits, n = m.get_computed_blocks(r)
    ext = min(external, len(prompt) - 1 - n)
    new = len(prompt) - n - ext if chunk is None else min(chunk, len(prompt) - n - ext)
    out = m.allocate_slots(r, new, n, hits, num_external_computed_tokens=ext)
    if out is not None:
        r.num_computed_tokens = n + ext + new
    return r, n, out


def test_parse_kv_groups():
    assert parse_kv_groups("full,swa:4, chunked:8") == [KVGroupSpec("full"), KVGroupSpec("swa", 4),
                                                         KVGroupSpec("chunked", 8)]
    for bad in ("", "swa", "swa:0", "full:3", "sliding:4", "mamba"):
        with pytest.raises(ValueError):
            parse_kv_groups(bad)


def test_skipped_tokens():
    swa, ch = KVGroupSpec("swa", 4), KVGroupSpec("chunked", 8)
    assert [swa.num_skipped_tokens(n) for n in (0, 3, 4, 7)] == [0, 0, 1, 4]
    assert [ch.num_skipped_tokens(n) for n in (7, 8, 13)] == [0, 8, 8]
    assert KVGroupSpec("full").num_skipped_tokens(100) == 0


def test_swa_hit_needs_only_the_window():
    null = "N"
    cached = {3: "b3", 4: "b4"}  # blocks 0..2 evicted, 3 and 4 cached
    look = cached.get
    # W=4, bs=2: the hit at 5 blocks needs blocks 3 and 4 only.
    assert find_group_hit(KVGroupSpec("swa", 4), look, 10, 2, null) == [null, null, null, "b3", "b4"]
    assert find_group_hit(KVGroupSpec("full"), look, 10, 2, null) == []
    # Only block 4 cached: no run of 2, and no run from block 0.
    assert find_group_hit(KVGroupSpec("swa", 4), {4: "b4"}.get, 10, 2, null) == []


def test_agreed_hit_is_cut_for_every_group():
    null = "N"
    full = {i: f"f{i}" for i in range(3)}.get           # full group: 3 blocks cached
    swa = {i: f"s{i}" for i in (0, 1, 4)}.get           # swa: blocks 0, 1, 4
    blocks, n = find_agreed_hit([KVGroupSpec("full"), KVGroupSpec("swa", 4)], [full, swa], 10, 2, null)
    # full offers 6 tokens; swa at 6 needs blocks 1,2 (2 missing) -> 4 needs 0,1 -> agreed 4
    assert n == 4
    assert blocks[0] == ["f0", "f1"] and blocks[1] == ["s0", "s1"]


def test_window_blocks_are_freed_and_nulled():
    m = HybridKVCacheManager(20, 2, "full,swa:4")
    r, _, out = admit(m, "a", list(range(1, 11)))
    assert out is not None
    free = m.block_pool.get_num_free_blocks()
    r.append_output_token_ids(99)
    assert m.allocate_slots(r, 1) is not None
    full_t, swa_t = m.get_block_ids("a")
    # 10 computed: the next query reads positions 7..10, so blocks 0..2 (positions 0..5) go.
    assert swa_t[:3] == [0, 0, 0] and 0 not in swa_t[3:] and 0 not in full_t
    assert m.block_pool.get_num_free_blocks() == free - 2 + 3


def test_second_request_hits_through_the_window():
    m = HybridKVCacheManager(20, 2, "full,swa:4")
    r, _, _ = admit(m, "a", list(range(1, 11)))
    r.append_output_token_ids(99)
    m.allocate_slots(r, 1)
    r.num_computed_tokens = 11
    _, n, out = admit(m, "b", list(range(1, 11)) + [5])
    assert n == 10 and out is not None
    full_t, swa_t = m.get_block_ids("b")
    assert full_t[:5] == m.get_block_ids("a")[0][:5]
    assert swa_t[:3] == [0, 0, 0]


def test_chunked_prefill_allocates_in_parts():
    m = HybridKVCacheManager(20, 2, "full")
    r, _, out = admit(m, "a", list(range(1, 10)), chunk=3)
    assert out is not None and r.num_computed_tokens == 3
    assert len(m.get_block_ids("a")[0]) == 2
    assert m.block_pool.blocks[m.get_block_ids("a")[0][0]].block_hash is not None
    assert m.block_pool.blocks[m.get_block_ids("a")[0][1]].block_hash is None   # holds 1 of 2
    assert m.allocate_slots(r, 4) is not None
    r.num_computed_tokens = 7
    assert len(m.get_block_ids("a")[0]) == 4


def test_draft_tokens_get_slots_but_are_never_cached():
    m = HybridKVCacheManager(20, 2, "full")
    r, _, _ = admit(m, "a", [1, 2, 3])
    r.append_output_token_ids(4)               # 4 tokens, 3 computed
    assert m.allocate_slots(r, 1 + 3) is not None   # the token and 3 drafts: 7 slots
    r.num_computed_tokens = 7
    table = m.get_block_ids("a")[0]
    assert len(table) == 4
    hashed = [m.block_pool.blocks[b].block_hash is not None for b in table]
    assert hashed == [True, True, False, False]
    # rollback: 1 draft accepted, 2 rejected
    r.append_output_token_ids(7)
    r.num_computed_tokens = 5
    r.append_output_token_ids(8)
    assert m.allocate_slots(r, 1) is not None
    assert [m.block_pool.blocks[b].block_hash is not None for b in m.get_block_ids("a")[0]] == [True, True, True, False]


def test_lookahead_slots():
    m = HybridKVCacheManager(20, 2, "full")
    r, _, _ = admit(m, "a", [1, 2, 3])
    r.append_output_token_ids(4)
    assert m.allocate_slots(r, 1, num_lookahead_tokens=2) is not None
    assert len(m.get_block_ids("a")[0]) == 3


def test_extra_keys_keep_requests_apart():
    m = HybridKVCacheManager(20, 2, "full")
    admit(m, "a", [1, 2, 3, 4, 5])
    for extra in ("lora:A", "salt:s", "mm:X@0"):
        _, n, _ = admit(m, f"b-{extra}", [1, 2, 3, 4, 5], extra=extra)
        assert n == 0, extra
    # a multimodal input in block 2 leaves blocks 0 and 1 shareable
    _, n, _ = admit(m, "c", [1, 2, 3, 4, 5], extra="mm:X@4")
    assert n == 4


def test_extra_key_rules():
    e = parse_extra("lora:A;salt:s;mm:X@3+2")
    assert e == ExtraKeys("A", "s", (MMInput("X", 3, 2),), "A")   # the path is the name when left out
    lora = ("lora", "A", "A")
    assert e.block_extra_keys(0, 2) == (lora, ("salt", "s"))
    assert e.block_extra_keys(1, 2) == (lora, ("mm", "X", 3))
    assert e.block_extra_keys(2, 2) == (lora, ("mm", "X", 3))
    assert e.block_extra_keys(3, 2) == (lora,)
    # one name for two adapters: the path tells them apart; multimodal items in offset order
    assert parse_extra("lora:A@B").block_extra_keys(0, 2) == (("lora", "A", "B"),)
    assert parse_extra("mm:X@2;mm:X@0").mm == (MMInput("X", 0), MMInput("X", 2))
    for bad in ("lora:", "lora:@B", "mm:X", "mm:X@a", "foo:1"):
        with pytest.raises(ValueError):
            parse_extra(bad)


def test_external_tokens_take_blocks_but_are_no_hit():
    m = HybridKVCacheManager(20, 2, "full,swa:2")
    r, n, out = admit(m, "a", list(range(1, 10)), external=6)
    assert n == 0 and out is not None and r.num_computed_tokens == 9
    full_t, swa_t = m.get_block_ids("a")
    assert len(full_t) == 5 and 0 not in full_t
    # swa:2 at 6 computed: positions 0..4 are behind the window, blocks 0, 1 never allocated
    assert swa_t[:2] == [0, 0]
    with pytest.raises(InvalidCountError):
        m.allocate_slots(m.make_request("b", [1, 2]), 1, num_external_computed_tokens=-1)
    assert "b" not in m.req_to_blocks


def test_max_model_len_caps_every_table():
    m = HybridKVCacheManager(20, 2, "full,swa:4", max_model_len=5)
    assert m.max_blocks_per_request == 3
    r, _, out = admit(m, "a", [1, 2, 3, 4])
    assert out is not None
    r.append_output_token_ids(5)
    assert m.allocate_slots(r, 1, num_lookahead_tokens=4) is None       # drafts past the cap
    assert m.allocate_slots(r, 1) is not None
    r.num_computed_tokens = 5
    assert all(len(t) <= 3 for t in m.get_block_ids("a"))
    r.append_output_token_ids(6)
    free = m.block_pool.get_num_free_blocks()
    assert m.allocate_slots(r, 1) is None                               # past max_model_len
    assert m.block_pool.get_num_free_blocks() == free
    _, _, out = admit(m, "b", list(range(1, 8)))
    assert out is None and "b" not in m.req_to_blocks


def test_refusal_and_misuse_leave_state_unchanged():
    m = HybridKVCacheManager(6, 2, "full,swa:4")
    admit(m, "a", [1, 2, 3, 4])
    before = (m.block_pool.get_num_free_blocks(), m.get_block_ids("a"))
    _, _, out = admit(m, "b", [5, 6, 7, 8, 9, 10])
    assert out is None and "b" not in m.req_to_blocks
    with pytest.raises(InvalidCountError):
        m.allocate_slots(m.make_request("c", [1]), -1)
    assert (m.block_pool.get_num_free_blocks(), m.get_block_ids("a")) == before


def test_free_releases_every_group():
    m = HybridKVCacheManager(20, 2, "full,swa:4,chunked:4")
    r, _, _ = admit(m, "a", list(range(1, 12)))
    m.free(r)
    assert m.block_pool.get_num_free_blocks() == 19


def test_single_full_group_matches_the_old_manager():
    """Same prompts, same decisions, same block ids as KVCacheManager."""
    old, new = KVCacheManager(10, 2), HybridKVCacheManager(10, 2, "full")
    for rid, prompt in (("a", [1, 2, 3, 4, 5]), ("b", [1, 2, 3, 4, 9]), ("c", list(range(20, 29)))):
        ro = old.make_request(rid, prompt)
        ho, no = old.get_computed_blocks(ro)
        oo = old.allocate_slots(ro, len(prompt) - no, no, ho)
        rn, nn, on = admit(new, rid, prompt)
        assert no == nn and (oo is None) == (on is None)
        assert old.get_block_ids(rid) == new.get_block_ids(rid)[0]


def test_spec_tokens_in_the_request_are_not_cached_until_verified():
    m = HybridKVCacheManager(20, 2, "full,swa:3")
    r, _, _ = admit(m, "a", [1, 2, 3])
    r.append_output_token_ids(4)
    r.append_spec_tokens([5, 6, 7])
    assert r.num_verified_tokens == 4 and len(r.block_hashes) == 3
    assert m.allocate_slots(r, 1, num_lookahead_tokens=3) is not None
    r.num_computed_tokens = 7
    hashed = [m.block_pool.blocks[b].block_hash is not None for b in m.get_block_ids("a")[0]]
    assert hashed == [True, True, False, False]
    assert r.verify(1) == 2 and r.all_token_ids == [1, 2, 3, 4, 5] and len(r.block_hashes) == 2
    with pytest.raises(InvalidCountError):
        r.verify(1)
