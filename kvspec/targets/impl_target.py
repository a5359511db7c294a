"""Adapter for kvspec's own allocator (``kvspec.impl``), at both levels."""
from __future__ import annotations

import dataclasses
import hashlib
import types
import weakref
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Optional

from ..config import Config
from ..observation import FOREIGN, HEAD, TAIL, BlockState, Observation, ObservationDelta, RequestState
from ..ops import Admit, Alloc, Cache, CachePartial, Finish, Free, FreeForeign, Lookup, Op, Preempt, Reset, Step, Touch
from .base import Driver, Target, Traits, V1PoolDriver


def label_hash(label: str) -> bytes:
    """The target hash standing for a pool-level hash label."""
    return hashlib.sha256(b"kvspec-label:" + label.encode()).digest()


def observe_pool(pool: Any, requests: Optional[dict] = None) -> Observation:
    """Read a vLLM-v1-shaped BlockPool (blocks, free_block_queue, index) into an Observation.

    Shared by every target whose pool follows that design (impl, and vLLM itself).
    The queue is walked from the head sentinel and every link is checked on the way.
    """
    q = pool.free_block_queue
    head = getattr(q, "head", None) or getattr(q, "fake_free_list_head")
    tail = getattr(q, "tail", None) or getattr(q, "fake_free_list_tail")
    queue, problems = [], []
    prev, cur = head, head.next_free_block
    limit = len(pool.blocks) + 1
    while cur is not None and cur is not tail and len(queue) <= limit:
        if cur.prev_free_block is not prev:
            problems.append(f"block {cur.block_id}'s prev link does not point at the block before it")
        queue.append(cur.block_id)
        prev, cur = cur, cur.next_free_block
    if cur is None:
        problems.append("the walk fell off the list before reaching the tail sentinel")
    elif len(queue) > limit:
        problems.append("the walk does not end: the links form a cycle")
    elif tail.prev_free_block is not prev:
        problems.append("the tail sentinel's prev link does not point at the last block")
    queued = set(queue)
    blocks = tuple([_block_state(b.ref_cnt, b.block_hash, b.block_id in queued) for b in pool.blocks])
    index = {h: tuple(m.keys()) if isinstance(m, dict) else (m.block_id,)
             for h, m in _index_items(pool.cached_block_hash_to_block)}
    null = pool.null_block.block_id if getattr(pool, "null_block", None) is not None else None
    return _observation(blocks, tuple(queue), index, pool.get_num_free_blocks(), null, requests or {}, tuple(problems))


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


_OBS_FIELDS = ("blocks", "queue", "index", "free_count", "null_block", "requests", "queue_problems")


_OBS_FAST = tuple(f.name for f in dataclasses.fields(Observation)) == _OBS_FIELDS and \
    not hasattr(Observation, "__post_init__") and not hasattr(Observation, "__slots__")


def _observation(blocks, queue, index, free_count, null, requests, problems) -> Observation:
    if not _OBS_FAST:  # the class changed shape: its own constructor
        return Observation(blocks=blocks, queue=queue, index=index, free_count=free_count, null_block=null,
                           requests=requests, queue_problems=problems)
    o = object.__new__(Observation)
    o.__dict__.update(blocks=blocks, queue=queue, index=index, free_count=free_count, null_block=null,
                      requests=requests, queue_problems=problems)
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


# -- snapshot and restore in place, for the model checker's forks ----------------------
# ``kvspec mc`` tries every op from every state, so it puts one live allocator back into
# a saved state about twenty times per state found. Unpickling the object graph for each
# of those is most of a transition's cost. ``GraphSnapshot`` saves instead the mutable
# values of a fixed set of objects (the driver, the pool, the free queue and its two
# sentinels, every block; at cache level the manager too) and puts them back into those
# very objects: slot values (the queue links are references to the same blocks) with
# generated straight-line code, ``__dict__`` contents, and fresh copies of every list,
# dict and set reachable from them (the index, the tables, the requests).
#
# It is generic over the objects' layout, so a patched copy of the allocator (a bug of
# the corpus) is saved as faithfully as the original: every slot and every attribute of
# every object is saved, whatever it is called. Where a state holds anything this scheme
# cannot put back exactly (an object outside the set that is not a plain value, the same
# list reachable twice, an unset slot, an object whose class changed, a foreign block
# linked into the queue), ``capture`` returns None and the caller forks that state the
# slow way (pickle). Functions, classes and modules are shared, as pickle shares them.
_ATOMS = frozenset({int, float, bool, complex, str, bytes, type(None), type(Ellipsis), range, type,
                    types.FunctionType, types.BuiltinFunctionType, types.ModuleType})


class _Unsupported(Exception):
    pass


def _is_atom(v: Any) -> bool:
    t = type(v)
    if t in _ATOMS:
        return True
    if t is tuple or t is frozenset:
        for x in v:
            if not _is_atom(x):
                return False
        return True
    return False


def _slot_names(cls: type) -> Optional[tuple[str, ...]]:
    """The slots of a class without a ``__dict__`` (None if its instances have one)."""
    names: list[str] = []
    for c in reversed(cls.__mro__[:-1]):
        sl = c.__dict__.get("__slots__")
        if sl is None:
            return None  # a class in the chain without __slots__: instances have a __dict__
        for n in ((sl,) if isinstance(sl, str) else sl):
            if n == "__dict__":
                return None
            if n != "__weakref__" and n not in names:
                names.append(n)
    return tuple(names)


def _thaw_list(p: tuple) -> list:
    return [x if f is None else f(x) for f, x in p]


def _thaw_dict(p: tuple) -> dict:
    return {k: (x if f is None else f(x)) for k, f, x in p}


def _thaw_obj(p: tuple) -> Any:
    cls, static, conts = p
    o = object.__new__(cls)
    d = o.__dict__
    d.update(static)
    for k, f, x in conts:
        d[k] = f(x)
    return o


def _plain_value_class(cls: type) -> bool:
    """Instances can be rebuilt from their ``__dict__`` alone."""
    return (_slot_names(cls) is None and cls.__new__ is object.__new__ and cls.__init__ is not object.__init__
            and not issubclass(cls, BaseException))


class GraphSnapshot:
    """Save and restore, in place, the state of every object reachable from ``roots``
    (see the comment above). ``ok`` is False when the graph holds something this cannot
    handle even at the start; ``capture()`` returns None for a state it cannot save."""

    SLOTS_UNROLL_MAX = 4096   # slot values set by one generated function up to this many

    def __init__(self, roots: list) -> None:
        self.ok = True
        self.objs: list = []
        self.ids: dict[int, int] = {}
        try:
            for r in roots:
                self._discover(r)
        except _Unsupported:
            self.ok = False
            return
        self.slotted: list = []   # (obj, class, attrgetter, number of slots)
        self.dicted: list = []    # (obj, class)
        for o in self.objs:
            cls = type(o)
            names = _slot_names(cls)
            if names is None:
                self.dicted.append((o, cls))
            elif names:
                import operator
                self.slotted.append((o, cls, operator.attrgetter(*names), names))
        self._set_slots = self._compile_slot_setter()

    # -- discovery: which objects keep their identity ------------------------------
    def _discover(self, root: Any) -> None:
        stack = [root]
        seen: set[int] = set()
        while stack:
            v = stack.pop()
            if _is_atom(v) or id(v) in seen:
                continue
            seen.add(id(v))
            t = type(v)
            if t is list or t is tuple or t is set or t is frozenset:
                stack.extend(v)
            elif t is dict:
                for k in v:
                    if not _is_atom(k):
                        raise _Unsupported(f"a dict key of type {type(k).__name__}")
                stack.extend(v.values())
            else:
                names = _slot_names(t)
                if names is None:
                    d = getattr(v, "__dict__", None)
                    if type(d) is not dict:
                        raise _Unsupported(f"an object of type {t.__name__}")
                    vals = list(d.values())
                else:
                    try:
                        vals = [getattr(v, n) for n in names]
                    except AttributeError:
                        raise _Unsupported(f"an unset slot of {t.__name__}") from None
                if t.__module__ in ("builtins", "threading", "_thread", "io", "_io"):
                    raise _Unsupported(f"an object of type {t.__name__}")
                self.ids[id(v)] = len(self.objs)
                self.objs.append(v)
                stack.extend(vals)

    def _compile_slot_setter(self) -> Callable[[tuple], None]:
        total = sum(len(n) for _, _, _, n in self.slotted)
        objs = [o for o, _, _, _ in self.slotted]
        classes = [c for _, c, _, _ in self.slotted]
        if not self.slotted:
            return lambda states: None
        if total > self.SLOTS_UNROLL_MAX:
            names_of = [n for _, _, _, n in self.slotted]

            def set_slots(states: tuple) -> None:
                for o, c, names, vals in zip(objs, classes, names_of, states):
                    if o.__class__ is not c:
                        o.__class__ = c
                    for n, v in zip(names, vals):
                        setattr(o, n, v)
            return set_slots
        lines = ["def set_slots(states):"]
        lines.append("    " + ", ".join(f"s{i}" for i in range(len(objs))) + ", = states")
        for i, (_, _, _, names) in enumerate(self.slotted):
            lines.append(f"    if o{i}.__class__ is not c{i}: o{i}.__class__ = c{i}")
            lines.append("    " + ", ".join(f"o{i}.{n}" for n in names) + f", = s{i}")
        ns: dict = {f"o{i}": o for i, o in enumerate(objs)}
        ns.update({f"c{i}": c for i, c in enumerate(classes)})
        exec(compile("\n".join(lines), "<GraphSnapshot.set_slots>", "exec"), ns)
        return ns["set_slots"]

    # -- capture ---------------------------------------------------------------------
    def _plain(self, v: Any) -> bool:
        """Saved by reference: an atom, one of the objects restored in place, or a tuple
        or frozenset of those."""
        t = type(v)
        if t in _ATOMS:
            return True
        if t is tuple or t is frozenset:
            for x in v:
                if type(x) not in _ATOMS and not self._plain(x):
                    return False
            return True
        return id(v) in self.ids

    def _freeze(self, v: Any, seen: set) -> tuple:
        """(rebuild function, payload) for a container or a plain value object."""
        if id(v) in seen:
            raise _Unsupported("the same container reachable twice")
        seen.add(id(v))
        t = type(v)
        plain = self._plain
        if t is list:
            for x in v:
                if not plain(x):
                    return _thaw_list, tuple((None, x) if plain(x) else self._freeze(x, seen) for x in v)
            return list, tuple(v)
        if t is dict:
            for k, x in v.items():
                if type(k) not in _ATOMS and not _is_atom(k):
                    raise _Unsupported("a dict key that is not a plain value")
            for x in v.values():
                if not plain(x):
                    return _thaw_dict, tuple((k, None, x) if plain(x) else (k,) + self._freeze(x, seen)
                                             for k, x in v.items())
            return dict, tuple(v.items())
        if t is set:
            if all(_is_atom(x) for x in v):
                return set, tuple(v)
            raise _Unsupported("a set of objects")
        if t is not tuple and t is not frozenset and _plain_value_class(t):
            d = getattr(v, "__dict__", None)
            if type(d) is dict:
                static, conts = {}, []
                for k, x in d.items():
                    if plain(x):
                        static[k] = x
                    else:
                        conts.append((k,) + self._freeze(x, seen))
                return _thaw_obj, (t, static, tuple(conts))
        raise _Unsupported(f"a {t.__name__} that is neither plain nor restored in place")

    def capture(self) -> Optional[tuple]:
        """The state of every object, or None where it cannot be restored exactly."""
        try:
            plain, atoms, ids = self._plain, _ATOMS, self.ids
            slots = []
            for o, cls, get, names in self.slotted:
                if type(o) is not cls:
                    return None
                try:
                    vals = get(o)
                except AttributeError:
                    return None
                if len(names) == 1:
                    vals = (vals,)
                for x in vals:
                    if type(x) not in atoms and id(x) not in ids and not plain(x):
                        return None
                slots.append(vals)
            seen: set = set()
            dicts = []
            for o, cls in self.dicted:
                if type(o) is not cls:
                    return None
                static, conts = {}, []
                for k, x in o.__dict__.items():
                    if type(x) in atoms or id(x) in ids or plain(x):
                        static[k] = x
                    else:
                        conts.append((k,) + self._freeze(x, seen))
                dicts.append((static, tuple(conts)))
            return tuple(slots), tuple(dicts)
        except _Unsupported:
            return None

    def restore(self, state: tuple) -> None:
        slots, dicts = state
        self._set_slots(slots)
        for (o, cls), (static, conts) in zip(self.dicted, dicts):
            if o.__class__ is not cls:
                o.__class__ = cls
            d = o.__dict__
            d.clear()
            d.update(static)
            for k, f, x in conts:
                d[k] = f(x)


_GRAPHS: "weakref.WeakKeyDictionary[Any, GraphSnapshot]" = weakref.WeakKeyDictionary()


class _InPlaceSnapshots:
    """``snapshot()``/``restore(snap)`` for the impl drivers: save the allocator's state,
    and later put *this same driver* back into it (``restore`` returns ``self``). The
    snapshot is None where the state cannot be saved this way (see ``GraphSnapshot``)."""

    def snapshot(self) -> Optional[tuple]:
        g = _GRAPHS.get(self)
        if g is None:
            g = _GRAPHS[self] = GraphSnapshot([self])
        if not g.ok:
            return None
        snap = g.capture()
        return None if snap is None else (g, snap)

    def restore(self, snap: tuple) -> Any:
        g, state = snap
        if g is not _GRAPHS.get(self):
            raise ValueError("a snapshot is restored only into the driver that took it")
        g.restore(state)
        return self

    snapshot.in_place = True  # type: ignore[attr-defined]


class ImplPoolDriver(_InPlaceSnapshots, _Deltas, V1PoolDriver):
    def __init__(self, mod: ModuleType, config: Config) -> None:
        self.mod = mod
        self.pool = mod.BlockPool(config.num_blocks, enable_caching=config.caching)

    def _cache(self, ids, labels) -> None:
        return self.pool.cache_full_blocks(self._blocks(ids), [label_hash(h) for h in labels], 0, len(ids))

    def _lookup(self, label: str) -> Any:
        b = self.pool.get_cached_block(label_hash(label))
        return None if b is None else b.block_id

    def _foreign_block(self) -> Any:
        return self.mod.BlockPool(len(self.pool.blocks)).get_new_blocks(1)[0]

    def observe(self) -> Observation:
        return observe_pool(self.pool)

    def _tracked_pool(self) -> Any:
        return self.pool


class ImplCacheDriver(_InPlaceSnapshots, _Deltas, Driver):
    """Plays the scheduler: prefill = lookup + allocate_slots; decode = append + allocate."""

    def __init__(self, mod: ModuleType, config: Config) -> None:
        self.mgr = mod.KVCacheManager(config.num_blocks, config.block_size, enable_caching=config.caching)
        self.reqs: dict[str, Any] = {}
        self.running: set[str] = set()

    def apply(self, op: Op) -> Any:
        m = self.mgr
        if isinstance(op, Admit):
            req = self.reqs.get(op.req) if op.prompt is None else m.make_request(op.req, op.prompt)
            if req is None:
                raise KeyError(f"no waiting request {op.req}")
            self.reqs[op.req] = req
            hits, num_hit = m.get_computed_blocks(req)
            if m.allocate_slots(req, req.num_tokens - num_hit, num_hit, hits) is None:
                return None
            req.num_computed_tokens = req.num_tokens
            self.running.add(op.req)
            return num_hit
        if isinstance(op, Step):
            req = self.reqs[op.req]
            req.append_output_token_ids(op.token)
            if m.allocate_slots(req, req.num_tokens - req.num_computed_tokens) is None:
                return False
            req.num_computed_tokens = req.num_tokens
            return True
        if isinstance(op, (Preempt, Finish)):
            req = self.reqs.get(op.req) or m.make_request(op.req, [0])
            # A waiting request holds nothing: finishing it is bookkeeping only, while
            # preempting it (or anything unknown) reaches the manager, which must refuse.
            if op.req in self.running or isinstance(op, Preempt) or op.req not in self.reqs:
                m.free(req)
            self.running.discard(op.req)
            req.num_computed_tokens = 0
            if isinstance(op, Finish):
                self.reqs.pop(op.req, None)
            return None
        raise TypeError(f"{op!r} is not a cache-level op")

    def _requests(self) -> dict:
        return {rid: RequestState(tuple(self.mgr.get_block_ids(rid)), self.reqs[rid].num_computed_tokens)
                for rid in sorted(self.running)}

    def observe(self) -> Observation:
        return observe_pool(self.mgr.block_pool, self._requests())

    def _tracked_pool(self) -> Any:
        return self.mgr.block_pool


class ImplTarget(Target):
    def __init__(self, mod: Optional[ModuleType] = None, label: str = "impl") -> None:
        if mod is None:
            from .. import impl as mod  # type: ignore[no-redef]
        self.mod = mod
        self.name = label
        self.traits = Traits(null_block=True, unhashed_free_first=False, misuse_errors=(mod.KVCacheError,))

    def driver(self, config: Config) -> Driver:
        return ImplCacheDriver(self.mod, config) if config.level == "cache" else ImplPoolDriver(self.mod, config)

    @staticmethod
    def package_dir() -> Path:
        from .. import impl
        return Path(impl.__file__).parent
