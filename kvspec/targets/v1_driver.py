"""The shared driver for vLLM-v1-shaped allocators (kvspec's ``impl`` and upstream vLLM):
the pool-level driver, reading a ``BlockPool`` into an ``Observation``, and change
tracking for incremental observation. The impl and vllm adapters are thin layers on it.
"""
from __future__ import annotations

import dataclasses
from abc import abstractmethod
from typing import Any, Optional

from kvspec.spec.observation import FOREIGN, HEAD, TAIL, BlockState, Observation, ObservationDelta
from kvspec.spec.ops import Alloc, Cache, CachePartial, Free, FreeForeign, Lookup, Op, Reset, Touch
from kvspec.targets.base import Driver


class V1PoolDriver(Driver):
    """Pool-level driver for a vLLM-v1-shaped ``BlockPool`` (``self.pool``, with
    ``blocks``, ``get_new_blocks``, ``free_blocks``, ``touch``, ``reset_prefix_cache``).
    The pools differ only in how a label becomes a cached hash and how a lookup is
    asked, so subclasses supply those three calls."""

    pool: Any

    def _blocks(self, ids):
        return [self.pool.blocks[i] for i in ids]

    @abstractmethod
    def _cache(self, ids: tuple[int, ...], labels: tuple[str, ...]) -> Any:
        """cache_full_blocks on the blocks ``ids`` under the hashes of ``labels``."""

    @abstractmethod
    def _lookup(self, label: str) -> Any:
        """The block id get_cached_block returns for ``label``'s hash, or None."""

    @abstractmethod
    def _foreign_block(self) -> Any:
        """One block handed out by another, fresh pool of the same kind."""

    def apply(self, op: Op) -> Any:
        p = self.pool
        if isinstance(op, Alloc):
            return tuple(b.block_id for b in p.get_new_blocks(op.n))
        if isinstance(op, Free):
            return p.free_blocks(self._blocks(op.blocks))
        if isinstance(op, Touch):
            return p.touch(self._blocks(op.blocks))
        if isinstance(op, (Cache, CachePartial)):
            return self._cache(op.blocks, op.hashes)
        if isinstance(op, FreeForeign):
            return p.free_blocks([self._foreign_block()])
        if isinstance(op, Lookup):
            return self._lookup(op.hash)
        if isinstance(op, Reset):
            return p.reset_prefix_cache()
        raise TypeError(f"{op!r} is not a pool-level op")


def observe_pool(pool: Any, requests: Optional[dict] = None) -> Observation:
    """Read a vLLM-v1-shaped BlockPool (blocks, free_block_queue, index) into an Observation.

    Shared by every target whose pool follows that design (impl, and vLLM itself).
    The queue is walked from the head sentinel and every link is checked on the way.
    A free list that is not a linked list (a ``deque`` or list of blocks or of block ids,
    an ``OrderedDict`` keyed by them, possibly lazily cleaned with a companion set: see
    ``kvspec.targets.names.read_free_list``) is read in its order instead.
    """
    q = pool.free_block_queue
    head = getattr(q, "head", None) or getattr(q, "fake_free_list_head", None)
    limit = len(pool.blocks) + 1
    if head is None and not hasattr(q, "free_list_head"):
        queue, problems = _plain_free_list(pool, q)
    elif head is None:  # vLLM before 0.10.0: no sentinels
        queue, problems = _walk_open_list(q, limit)
    else:
        tail = getattr(q, "tail", None) or getattr(q, "fake_free_list_tail")
        queue, problems = [], []
        push = queue.append
        prev, cur = head, head.next_free_block
        walked = 0   # (a count, not len(queue) per link: this walk runs after every step)
        while cur is not None and cur is not tail and walked <= limit:
            if cur.prev_free_block is not prev:
                problems.append(f"block {cur.block_id}'s prev link does not point at the block before it")
            push(cur.block_id)
            walked += 1
            prev, cur = cur, cur.next_free_block
        if cur is None:
            problems.append("the walk fell off the list before reaching the tail sentinel")
        elif walked > limit:
            problems.append("the walk does not end: the links form a cycle")
        elif tail.prev_free_block is not prev:
            problems.append("the tail sentinel's prev link does not point at the last block")
    # One pass over the blocks: each block's shared BlockState (see _block_state: looked
    # up inline here, the call made only on a miss), and I1's other half: a block out of
    # the queue keeps no links into it.
    queued = set(queue)
    states = []
    add = states.append
    shared = _BLOCK_STATES.get
    linked = None
    for b in pool.blocks:
        q_ = b.block_id in queued
        ref, h = b.ref_cnt, b.block_hash
        try:
            st = shared((ref, h, q_))
        except TypeError:   # an unhashable hash value
            st = None
        if st is None or st.ref.__class__ is not ref.__class__:
            st = _block_state(ref, h, q_)
        add(st)
        if not q_ and linked is None:
            i = b.block_id
            try:
                out_linked = b.prev_free_block is not None or b.next_free_block is not None
            except AttributeError:   # a block class without link attributes
                out_linked = getattr(b, "prev_free_block", None) is not None \
                    or getattr(b, "next_free_block", None) is not None
            if out_linked:
                linked = i
    if linked is not None:
        problems.append(f"block {linked} is not in the free queue but still has prev/next links")
    blocks = tuple(states)
    index = {h: tuple(m.keys()) if isinstance(m, dict) else (m.block_id,)
             for h, m in _index_items(pool.cached_block_hash_to_block)}
    null = pool.null_block.block_id if getattr(pool, "null_block", None) is not None else None
    return _observation(blocks, tuple(queue), index, pool.get_num_free_blocks(), null, requests or {}, tuple(problems))


def _plain_free_list(pool: Any, q: Any) -> tuple[list, list]:
    """A free list held in a container: ids in its order, and the companion set's verdict
    where the pool cleans the list lazily (``free_block_queue_set`` or ``free_block_set``)."""
    from kvspec.targets.names import companion_set, read_free_list

    def block_id(e: Any) -> Any:
        return getattr(e, "block_id", e)

    truth = companion_set(pool, "free_block_queue")
    if truth is None:
        truth = companion_set(pool, "free_block_ids")
    if truth is not None:
        truth = {block_id(e) for e in truth}
    return read_free_list(q, truth, key=block_id)


def _walk_open_list(q: Any, limit: int) -> tuple[list, list]:
    """The free list of vLLM before 0.10.0: ``free_list_head``/``free_list_tail`` point at
    the end blocks (None when empty) and the end blocks' outer links are None."""
    queue: list = []
    problems: list = []
    prev, cur = None, q.free_list_head
    while cur is not None and len(queue) <= limit:
        if cur.prev_free_block is not prev:
            problems.append(f"block {cur.block_id}'s prev link does not point at the block before it")
        queue.append(cur.block_id)
        prev, cur = cur, cur.next_free_block
    if len(queue) > limit:
        problems.append("the walk does not end: the links form a cycle")
    elif q.free_list_tail is not prev:
        problems.append("free_list_tail does not point at the last block")
    return queue, problems


# Observations are built after every step, so building them is kept cheap: equal
# BlockStates (frozen) are shared, and an Observation (a frozen dataclass) gets its
# fields in one dict update instead of one ``object.__setattr__`` call per field. The
# objects are the same as the constructors' (tests/test_mc.py checks it).
_BLOCK_STATES: dict = {}


def _block_state(ref: Any, h: Any, queued: bool) -> BlockState:
    key = (ref, h, queued)
    try:
        st = _BLOCK_STATES.get(key)
    except TypeError:  # an unhashable hash value: no sharing
        return BlockState(ref, h, queued)
    if st is None or type(st.ref) is not type(ref):   # 1 == True == 1.0: keep the types apart
        if len(_BLOCK_STATES) > 65536:
            _BLOCK_STATES.clear()
        st = _BLOCK_STATES[key] = BlockState(ref, h, queued)
    return st


# Every field of Observation, in order. A field added to the class and not here turns the
# fast path off (it went unnoticed once: ``found`` made every observation of a search
# take the frozen constructor, a fifth more instructions per observation);
# tests/test_mc.py holds the two paths to the same objects and checks the path is on.
_OBS_FIELDS = ("blocks", "queue", "index", "free_count", "null_block", "requests", "queue_problems", "found")


_OBS_FAST = tuple(f.name for f in dataclasses.fields(Observation)) == _OBS_FIELDS and \
    not hasattr(Observation, "__post_init__") and not hasattr(Observation, "__slots__")


def _observation(blocks, queue, index, free_count, null, requests, problems) -> Observation:
    if not _OBS_FAST:  # the class changed shape: its own constructor
        return Observation(blocks=blocks, queue=queue, index=index, free_count=free_count, null_block=null,
                           requests=requests, queue_problems=problems)
    o = object.__new__(Observation)
    o.__dict__.update(blocks=blocks, queue=queue, index=index, free_count=free_count, null_block=null,
                      requests=requests, queue_problems=problems, found=())
    return o


def _index_items(index: Any):
    return index.items() if isinstance(index, dict) else index._cache.items()


# -- change tracking, for incremental observation --------------------------------------
# The checker needs to know every block an op *wrote*, including the ones a buggy op
# should not have touched. So the blocks themselves report writes: while a session
# tracks a pool, its blocks are switched to a subclass whose __setattr__ notes the block
# in ``pool._kvspec_dirty``, and the index dict is swapped for one that notes each key
# it hands out or changes. Nothing else changes: the subclass adds no slots, and both
# turn back into the plain types when pickled or copied (a model checker's fork), which
# leaves the copy untracked: the session sees that and observes it in full.
_TRACKED: dict = {}


def _tracked_class(base: type) -> Optional[type]:
    """The tracking subclass of a KVCacheBlock class (one per class, patched copies too)."""
    if base in _TRACKED:
        return _TRACKED[base]
    set_attr = base.__setattr__

    def __setattr__(self, name, value):
        set_attr(self, name, value)
        dirty = getattr(self.pool, "_kvspec_dirty", None)
        if dirty is not None:
            dirty.add(self)

    def __reduce_ex__(self, protocol):
        fn, args, *rest = object.__reduce_ex__(self, protocol)
        if args and args[0] is cls:
            args = (base,) + tuple(args[1:])
        return (fn, args, *rest)

    try:
        cls = type(f"Tracked{base.__name__}", (base,), {"__slots__": (), "__setattr__": __setattr__,
                                                         "__reduce_ex__": __reduce_ex__})
    except TypeError:
        cls = None
    _TRACKED[base] = cls
    return cls


class _TrackedIndex(dict):
    """The pool's hash index, noting every key whose entry an op may have read or changed
    (an entry is a mutable dict, so handing it out counts). Whole-index operations mark
    everything."""

    __slots__ = ("touched", "everything")

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.touched: set = set()
        self.everything = False

    def __reduce_ex__(self, protocol):
        return (dict, (dict.copy(self),))

    def get(self, k, default=None):
        self.touched.add(k)
        return dict.get(self, k, default)

    def __getitem__(self, k):
        self.touched.add(k)
        return dict.__getitem__(self, k)

    def __setitem__(self, k, v):
        self.touched.add(k)
        dict.__setitem__(self, k, v)

    def __delitem__(self, k):
        self.touched.add(k)
        dict.__delitem__(self, k)

    def __contains__(self, k):
        self.touched.add(k)
        return dict.__contains__(self, k)

    def setdefault(self, k, default=None):
        self.touched.add(k)
        return dict.setdefault(self, k, default)

    def pop(self, k, *default):
        self.touched.add(k)
        return dict.pop(self, k, *default)

    def _all(self):
        self.everything = True

    def popitem(self):
        self._all()
        return dict.popitem(self)

    def clear(self):
        self._all()
        dict.clear(self)

    def update(self, *a, **kw):
        self._all()
        dict.update(self, *a, **kw)

    def __ior__(self, other):
        self._all()
        dict.update(self, other)
        return self

    def copy(self):
        self._all()
        return dict.copy(self)

    def keys(self):
        self._all()
        return dict.keys(self)

    def values(self):
        self._all()
        return dict.values(self)

    def items(self):
        self._all()
        return dict.items(self)

    def __iter__(self):
        self._all()
        return dict.__iter__(self)


def _entry_ids(m: Any) -> tuple:
    return tuple(m.keys()) if isinstance(m, dict) else (m.block_id,)


class _PoolTracker:
    """What a driver checks before trusting its deltas: the structures it armed."""

    def __init__(self, pool: Any) -> None:
        q = pool.free_block_queue
        self.blocks, self.n, self.queue = pool.blocks, len(pool.blocks), q
        self.head = getattr(q, "head", None) or getattr(q, "fake_free_list_head")
        self.tail = getattr(q, "tail", None) or getattr(q, "fake_free_list_tail")
        self.index = pool.cached_block_hash_to_block

    def intact(self, pool: Any) -> bool:
        q = pool.free_block_queue
        return (pool.blocks is self.blocks and len(pool.blocks) == self.n and q is self.queue
                and (getattr(q, "head", None) or getattr(q, "fake_free_list_head")) is self.head
                and (getattr(q, "tail", None) or getattr(q, "fake_free_list_tail")) is self.tail
                and pool.cached_block_hash_to_block is self.index and isinstance(self.index, _TrackedIndex)
                and getattr(pool, "_kvspec_dirty", None) is not None)


def track_pool(pool: Any) -> Optional[_PoolTracker]:
    """Start noting what ``pool``'s ops write (see above); None if its shape does not allow it."""
    try:
        q = pool.free_block_queue
        if (getattr(q, "head", None) or getattr(q, "fake_free_list_head", None)) is None:
            return None  # not a linked list with sentinels (a deque, say): observed in full
        blocks = pool.blocks
        cls = _tracked_class(type(blocks[0])) if blocks else None
        if cls is None or type(pool.cached_block_hash_to_block) not in (dict, _TrackedIndex) \
                or any(type(b) not in (cls, cls.__mro__[1]) or not hasattr(b, "pool") for b in blocks):
            return None
        for b in blocks:
            if type(b) is not cls:
                b.__class__ = cls
        if type(pool.cached_block_hash_to_block) is dict:
            pool.cached_block_hash_to_block = _TrackedIndex(pool.cached_block_hash_to_block)
        pool._kvspec_dirty = set()
        pool.cached_block_hash_to_block.touched = set()
        pool.cached_block_hash_to_block.everything = False
        return _PoolTracker(pool)
    except (AttributeError, TypeError, IndexError):
        return None


def pool_delta(pool: Any, tracker: Optional[_PoolTracker], requests: Optional[dict] = None) -> Optional[ObservationDelta]:
    """What changed in ``pool`` since the tracker was armed or last asked; None when the
    pool is no longer what was armed (then observe it in full and arm again)."""
    if tracker is None or not tracker.intact(pool):
        return None
    written, pool._kvspec_dirty = pool._kvspec_dirty, set()
    index = tracker.index
    touched, everything = index.touched, index.everything
    index.touched, index.everything = set(), False
    blocks, n, head, tail = tracker.blocks, tracker.n, tracker.head, tracker.tail

    def link(o: Any) -> Optional[int]:
        if o is None:
            return None
        if o is head:
            return HEAD
        if o is tail:
            return TAIL
        i = getattr(o, "block_id", None)
        return i if type(i) is int and 0 <= i < n and blocks[i] is o else FOREIGN

    changed = {}
    for o in written:
        i = o.block_id
        if type(i) is int and 0 <= i < n and blocks[i] is o:
            changed[i] = (o.ref_cnt, o.block_hash, link(o.prev_free_block), link(o.next_free_block))
    if everything:
        entries = {h: _entry_ids(m) for h, m in dict.items(index)}
    else:
        entries = {}
        for h in touched:
            m = dict.get(index, h)
            entries[h] = None if m is None else _entry_ids(m)
    return ObservationDelta(blocks=changed, head_next=link(head.next_free_block), tail_prev=link(tail.prev_free_block),
                            free_count=pool.get_num_free_blocks(), index=entries, index_complete=everything,
                            requests=requests or {})


class _Deltas:
    """Incremental observation for the impl drivers: ``track_changes()`` arms it (the
    session calls it after each full observation), ``observe_delta()`` reads it."""

    _tracker: Optional[_PoolTracker] = None

    def _tracked_pool(self) -> Any:
        raise NotImplementedError

    def _requests(self) -> dict:
        return {}

    def track_changes(self) -> bool:
        self._tracker = track_pool(self._tracked_pool())
        return self._tracker is not None

    def observe_delta(self) -> Optional[ObservationDelta]:
        return pool_delta(self._tracked_pool(), self._tracker, self._requests())

    def __getstate__(self):
        state = dict(self.__dict__)
        state.pop("_tracker", None)  # a copy starts untracked (its blocks unpickle as plain blocks)
        return state
