"""FreeKVCacheBlockQueue: order, O(1) middle removal, sentinels, counters."""
import pytest
from hypothesis import given, strategies as st

from kvspec.impl import FreeKVCacheBlockQueue, KVCacheBlock


def blocks(n):
    return [KVCacheBlock(i) for i in range(n)]


def ids(q):
    return [b.block_id for b in q.get_all_free_blocks()]


def test_initial_order_and_count():
    q = FreeKVCacheBlockQueue(blocks(5))
    assert ids(q) == [0, 1, 2, 3, 4]
    assert q.num_free_blocks == 5


def test_sentinels_stay_out_of_the_walk_and_link_the_ends():
    bs = blocks(3)
    q = FreeKVCacheBlockQueue(bs)
    assert q.head.next_free_block is bs[0] and bs[0].prev_free_block is q.head
    assert q.tail.prev_free_block is bs[2] and bs[2].next_free_block is q.tail
    for _ in range(3):
        q.popleft()
    assert q.head.next_free_block is q.tail and q.tail.prev_free_block is q.head
    with pytest.raises(IndexError):
        q.popleft()


def test_remove_from_the_middle_unlinks_only_that_block():
    bs = blocks(5)
    q = FreeKVCacheBlockQueue(bs)
    q.remove(bs[2])
    assert ids(q) == [0, 1, 3, 4]
    assert bs[1].next_free_block is bs[3] and bs[3].prev_free_block is bs[1]
    assert bs[2].prev_free_block is None and bs[2].next_free_block is None
    assert q.num_free_blocks == 4


def test_remove_touches_only_its_neighbours():
    # O(1): removing a middle block reads and writes its two neighbours' links and
    # nothing else, so every other block's links are untouched.
    bs = blocks(50)
    q = FreeKVCacheBlockQueue(bs)
    before = {b.block_id: (b.prev_free_block, b.next_free_block) for b in bs}
    q.remove(bs[25])
    changed = [b.block_id for b in bs if (b.prev_free_block, b.next_free_block) != before[b.block_id]]
    assert changed == [24, 25, 26]


def test_remove_of_a_block_not_in_the_queue_raises():
    bs = blocks(3)
    q = FreeKVCacheBlockQueue(bs)
    q.remove(bs[1])
    with pytest.raises(RuntimeError):
        q.remove(bs[1])


def test_popleft_n_takes_the_front_in_order_and_relinks():
    bs = blocks(6)
    q = FreeKVCacheBlockQueue(bs)
    out = q.popleft_n(4)
    assert [b.block_id for b in out] == [0, 1, 2, 3]
    assert ids(q) == [4, 5] and q.num_free_blocks == 2
    assert q.head.next_free_block is bs[4] and bs[4].prev_free_block is q.head
    assert all(b.prev_free_block is None and b.next_free_block is None for b in out)
    with pytest.raises(IndexError):
        q.popleft_n(3)
    assert ids(q) == [4, 5] and q.num_free_blocks == 2  # a refused pop changes nothing


def test_append_and_append_n_go_to_the_tail_in_order():
    bs = blocks(6)
    q = FreeKVCacheBlockQueue(bs[:2])
    q.append(bs[4])
    q.append_n([bs[3], bs[5]])
    assert ids(q) == [0, 1, 4, 3, 5] and q.num_free_blocks == 5
    q.append_n([])
    assert ids(q) == [0, 1, 4, 3, 5] and q.num_free_blocks == 5


@given(st.lists(st.tuples(st.sampled_from(["pop", "remove", "append"]), st.integers(0, 7)), max_size=40))
def test_queue_matches_a_list_model(ops):
    bs = blocks(8)
    q = FreeKVCacheBlockQueue(bs)
    model = list(range(8))
    for kind, i in ops:
        if kind == "pop" and model:
            assert q.popleft().block_id == model.pop(0)
        elif kind == "remove" and i in model:
            q.remove(bs[i])
            model.remove(i)
        elif kind == "append" and i not in model:
            q.append(bs[i])
            model.append(i)
        assert ids(q) == model and q.num_free_blocks == len(model)
        # Links agree with the walk in both directions.
        back, cur = [], q.tail.prev_free_block
        while cur is not q.head:
            back.append(cur.block_id)
            cur = cur.prev_free_block
        assert back[::-1] == model
