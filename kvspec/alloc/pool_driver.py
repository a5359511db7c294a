"""The pool level on a free-list allocator: ``Alloc(n)`` -> ``allocate(n)`` (or n calls of
``allocate()``), ``Free(ids)`` -> ``free(ids)`` (or ``free(id)`` per id).

What the observation holds (``kvspec.spec.observation``): per block, its ref count (the
allocator's own ``ref_counts`` where it keeps one, else the number of times kvspec holds
it: handed out minus freed), whether it is in the allocator's free list (where kvspec
found one: ``shapes.FREE_FIELDS``; else: whether kvspec holds it), the free list in its
own order (a set: sorted) and the free count the allocator reports (``num_free()`` and
the like; else the free list's length). The pool model then checks what any block
allocator promises: handed-out ids distinct, free and not held (EVICTION_ORDER under
free order "any", ACCOUNTING), a free returns exactly what was held and the count is true
(ACCOUNTING, I1), nothing leaks (I1, NO_LEAK), a refusal changes nothing (ATOMIC_REJECT,
with --misuse). Where it owns KV tensors, each held block still reads what was written into
it when it was handed out (KV_INTEGRITY, ``kvspec.alloc.kv_tensors``).

A refusal is an exception, or a ``None``/``False``/empty return for a positive count:
kvspec raises ``Refused`` for the latter, so a refusal is one thing to the checks."""
from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Mapping

from kvspec.alloc.kv_tensors import KVShadow, find as find_kv
from kvspec.alloc.shapes import ID_FIELDS, AllocMap, is_object
from kvspec.spec.config import Config
from kvspec.spec.observation import BlockState, Observation
from kvspec.spec.ops import Alloc, Free, Op, Touch
from kvspec.targets.base import Driver, TargetError


class Refused(Exception):
    """The allocator refused by its return value (None, False, an empty list)."""


def block_id(x: Any) -> int:
    """An id as an int: an int, a numpy/torch scalar, or a block object's id field
    (vLLM v0's PhysicalTokenBlock.block_number)."""
    if hasattr(x, "tolist") and not hasattr(x, "__dict__"):
        x = x.tolist()
    if isinstance(x, int) and not isinstance(x, bool):
        return x
    for f in ID_FIELDS:
        v = getattr(x, f, None)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return int(x)


def as_ids(value: Any) -> list:
    """A returned id or collection of ids as a list of ints (numpy/torch values, block objects)."""
    if hasattr(value, "tolist") and not hasattr(value, "__dict__"):
        value = value.tolist()
    if isinstance(value, int) and not isinstance(value, bool) or is_object(value):
        return [block_id(value)]
    return [block_id(x) for x in value]


def items(value: Any) -> list:
    """The handed-out things themselves (ints or block objects), one per block."""
    if isinstance(value, int) or is_object(value):
        return [value]
    if hasattr(value, "tolist") and not hasattr(value, "__dict__"):
        return list(value.tolist())
    return list(value)


def refused(value: Any) -> bool:
    return value is None or value is False or (type(value) is int and value < 0)


def read_free(value: Any) -> list:
    """The free container's ids, next reused first (a set: sorted; a dict: its keys)."""
    if isinstance(value, (set, frozenset)):
        return sorted(as_ids(list(value)))
    if isinstance(value, Mapping):
        return as_ids(list(value.keys()))
    items = list(value)
    if items and all(type(x) is bool for x in items):  # a mask, True = free
        return [i for i, free in enumerate(items) if free]
    return as_ids(items)


class FreeListDriver(Driver):
    def __init__(self, make: Callable[[int, int], Any], amap: AllocMap, config: Config, reserved: frozenset) -> None:
        if config.level != "pool":
            raise TargetError("a free-list allocator is checked at the pool level: use --level pool")
        self.amap, self.n, self.reserved = amap, config.num_blocks, reserved
        self.alloc = make(config.num_blocks, config.block_size)
        self.kv = KVShadow(find_kv(self.alloc, config.num_blocks, config.block_size))  # KV tensors it owns
        self.holds: Counter = Counter()
        self.objs: dict = {}  # id -> the block object handed out, for allocators that hand out objects
        m = amap.methods
        self._allocate = getattr(self.alloc, m["allocate"])
        self._free = getattr(self.alloc, m["free"])
        self._can = getattr(self.alloc, m["can_allocate"]) if m.get("can_allocate") else None

    def apply(self, op: Op) -> Any:
        if isinstance(op, Alloc):
            return self._alloc(op.n)
        if isinstance(op, Free):
            if self.amap.per_id.get("free"):
                # kvspec's own split must not make a free half done: a block named more times than
                # it is held (a double free) is refused before any call; named as often as it is
                # held (ref counts), it is freed once per holder
                over = [b for b, k in Counter(op.blocks).items() if k > 1 and k > self.holds[b]]
                if over:
                    raise Refused(f"kvspec frees one id at a time ({self.amap.get('free')}(id)): a free naming "
                                  f"block {over[0]} more times than it is held is refused before any call")
                for b in op.blocks:
                    self._free(self.objs.get(b, b))
                    self._release(b)
            else:
                self._free([self.objs.get(b, b) for b in op.blocks])
                for b in op.blocks:
                    self._release(b)
            return None
        if isinstance(op, Touch) and self.amap.get("share"):  # one holder more for each (ref counts)
            share = getattr(self.alloc, self.amap.methods["share"])
            if self.amap.per_id.get("share"):
                for b in op.blocks:  # one holder more per occurrence, as a batch share gives
                    share(self.objs.get(b, b))
                    self.holds[b] += 1
            else:
                share([self.objs.get(b, b) for b in op.blocks])
                for b in op.blocks:
                    self.holds[b] += 1
            return None
        raise TypeError(f"{op!r} is not an op a free-list allocator has")

    def _alloc(self, n: int) -> tuple:
        if self._can is not None and not self._can(n):
            raise Refused(f"{self.amap.get('can_allocate')}({n}) returned False")
        if self.amap.per_id.get("allocate"):
            if n < 0:
                raise Refused(f"kvspec calls {self.amap.get('allocate')}() once per block: {n} calls is a refusal")
            if self.amap.get("num_free") or self.amap.get("free_ids"):
                # a caller of a one-block-at-a-time API asks the count first; kvspec's split
                # must not leave a refused allocation half done (nor reorder the free list)
                free = self._count(len(self._free_ids()))
                if n > free:
                    raise Refused(f"{n} blocks asked, {free} free: kvspec calls "
                                  f"{self.amap.get('allocate')}() once per block only when they fit")
            got: list = []
            for _ in range(n):
                try:
                    b = self._allocate()
                except Exception:
                    self._give_back(got)  # kvspec's split into single calls must not make a refusal half done
                    raise
                if refused(b):
                    self._give_back(got)
                    raise Refused(f"{self.amap.get('allocate')}() returned {b!r}")
                self._keep(b)
                got += as_ids(b)
        else:
            value = self._allocate(n)
            if refused(value):
                raise Refused(f"{self.amap.get('allocate')}({n}) returned {value!r}")
            got = as_ids(value)
            self._keep(value)
            if not got and n != 0:
                raise Refused(f"{self.amap.get('allocate')}({n}) returned no blocks")
        for b in got:
            self.holds[b] += 1
            if self.kv:
                self.kv.write(b, None, f"the Alloc({n}) that took it")
        return tuple(got)

    def _release(self, b: int) -> None:
        self.holds[b] -= 1
        if self.holds[b] <= 0 and self.kv:
            self.kv.forget(b)  # its KV is no one's now

    def _give_back(self, got: list) -> None:
        """Free what a one-at-a-time allocation took before it was refused, as a caller would."""
        for x in reversed(got):  # last taken, first back: a stack gets its order back
            x = self.objs.get(x, x)
            self._free(x if self.amap.per_id.get("free") else [x])

    def _keep(self, value: Any) -> None:
        for x in items(value):
            if is_object(x):
                self.objs[block_id(x)] = x

    def observe(self) -> Observation:
        problems = []
        queue = self._free_ids()
        bad = [b for b in queue if not (type(b) is int and 0 <= b < self.n)]
        problems += [f"the free list holds {b}, which is not a block id of this pool" for b in bad]
        queue = [b for b in queue if b not in bad]
        out_of_range = sorted(b for b, c in self.holds.items() if c and not 0 <= b < self.n)
        problems += [f"block {b} was handed out but is not a block id of this pool (0..{self.n - 1})"
                     for b in out_of_range]
        m, a = self.amap.methods, self.alloc
        refs = list(getattr(a, m["ref_counts"])) if m.get("ref_counts") else [self.holds[b] for b in range(self.n)]
        free_set = set(queue)
        count = self._count(len(queue))
        null = min(self.reserved) if self.reserved else None
        blocks = tuple(BlockState(int(refs[b]), None, b in free_set) for b in range(self.n))
        return Observation(blocks=blocks, queue=tuple(queue), index={}, free_count=count, null_block=null,
                           queue_problems=tuple(problems), found=tuple(self.kv.problems()) if self.kv else ())

    def _free_ids(self) -> list:
        if self.amap.get("free_ids"):
            return read_free(getattr(self.alloc, self.amap.methods["free_ids"]))
        return [b for b in range(self.n) if self.holds[b] <= 0 and b not in self.reserved]

    def _count(self, default: int) -> int:
        name = self.amap.get("num_free")
        if not name:
            return default
        v = getattr(self.alloc, name)
        v = v() if callable(v) else v
        return int(v)
