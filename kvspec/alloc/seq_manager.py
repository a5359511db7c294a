"""The cache level on a sequence-keyed allocator, through kvspec's nano-vllm driver: a
nano-vllm-style front (``can_allocate(seq)``, ``allocate(seq)``, ``can_append(seq)``,
``may_append(seq)``, ``deallocate(seq)``) over ``allocate_sequence(seq_id, n_tokens)``,
``append_token(seq_id)``, ``free_sequence(seq_id)`` and the table, with the observation
hook ``kvspec_observe`` (``kvspec.targets.names``). One driver, one observation: the
cache model then checks that a sequence's table covers its tokens and stays put (SLOTS,
I2), no block is in two tables (KV_INTEGRITY's shadow store, ACCOUNTING), admission is
refused only when too few blocks are free (NO_LEAK, ACCOUNTING), a refusal changes
nothing, and everything is free once nothing runs (NO_LEAK, I1).

Refusals. Where the allocator has no ``can_allocate`` (``can_append``), the front's
``can_allocate`` makes the allocation itself and reports whether it was refused (an
exception, or a ``None``/``False`` return); ``allocate`` then only reads the table.

Ref counts: the allocator's ``ref_counts`` list where it keeps one, else the number of
running sequences whose table holds the block. The free list: the allocator's own
(``shapes.FREE_FIELDS``), else the blocks nobody holds; the free count: its own
(``num_free()`` and the like), else the free list's length."""
from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import replace
from typing import Any, Callable, Optional

from kvspec.alloc.cow import ForkProbe
from kvspec.alloc.kv_tensors import KVShadow, find as find_kv
from kvspec.alloc.pool_driver import as_ids, read_free
from kvspec.alloc.shapes import AllocMap, returns_value
from kvspec.spec.config import Config
from kvspec.spec.observation import Observation
from kvspec.targets.base import Driver
from kvspec.targets.nano_driver import NanoDriver
from kvspec.targets.nanovllm_target import NanoTarget

_SEQ_ID = "kvspec_seq_id"  # the allocator's id for a Sequence, kept on the Sequence (deep copies keep it)


class SequenceFront:
    """Subclassed per allocator class (``front_class``): ``_amap``, ``_make`` set there."""
    _amap: AllocMap
    _make: Callable[[int, int], Any]

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.inner = self._make(num_blocks, block_size)
        own = getattr(self.inner, "block_size", None)
        self.block_size = own if isinstance(own, int) and not isinstance(own, bool) and own > 0 else block_size
        self.num_blocks = num_blocks
        self.live: dict[int, Any] = {}  # seq id -> the Sequence, while it holds blocks
        self.ids = itertools.count()
        self.pending: dict[int, bool] = {}  # seq id -> a decode token already given its slot by can_append
        m = self._amap.methods
        self._m = {k: (getattr(self.inner, v) if v and callable(getattr(self.inner, v, None)) else None)
                   for k, v in m.items()}
        # None is a refusal only from a method that returns something when it succeeds; a
        # copy-on-write append returns its copies, None where there are none
        self._none_refuses = {r: returns_value(type(self.inner), m.get(r)) for r in ("allocate_sequence", "append_token")}
        self.length: dict[int, int] = {}  # seq id -> the tokens the allocator was told of
        self.kv = KVShadow(find_kv(self.inner, num_blocks, self.block_size))  # the KV tensors it owns, if any
        self.written: dict[int, int] = {}  # seq id -> tokens whose KV kvspec wrote
        self.probe = None
        self.last_copies: list = []
        if self._m.get("fork") is not None:
            self._none_refuses["append_token"] = False
            self.probe = ForkProbe(self._m["fork"], self._probe_append, self._m["free_sequence"], self._table,
                                   self._free_count, self._refs, lambda v: self._refused("append_token", v),
                                   {r: m.get(r) for r in ("fork", "append_token", "free_sequence")},
                                   bool(m.get("copy_on_write"))
                                   or returns_value(type(self.inner), m.get("append_token")))
            self.probe_ids = itertools.count(1_000_000)  # the probe's children: never a front's seq id

    def _refused(self, role: str, value: Any) -> bool:
        return value is False or (value is None and self._none_refuses[role])

    # -- the nano-vllm front ----------------------------------------------------------------
    def _sid(self, seq: Any) -> int:
        if getattr(seq, _SEQ_ID, None) is None:
            setattr(seq, _SEQ_ID, next(self.ids))
        return getattr(seq, _SEQ_ID)

    def _table(self, sid: int) -> list:
        name = self._amap.get("block_table")
        f = self._m.get("block_table")
        if f is not None:
            value = f(sid)
        else:
            value = getattr(self.inner, name).get(sid, [])
        if hasattr(value, "block_ids"):  # a table object
            value = value.block_ids
        return as_ids(value) if value is not None else []

    def _admit(self, sid: int, n: int) -> bool:
        """The allocation of a new sequence of ``n`` tokens: False when refused. Added then
        grown (``add_then_grow``): a refused growth removes the sequence again, as its caller
        would (free_sequence)."""
        if not self._amap.per_id.get("add_then_grow"):
            ok = not self._refused("allocate_sequence", self._m["allocate_sequence"](sid, n))
        else:
            if self._refused("allocate_sequence", self._m["allocate_sequence"](sid)):
                return False
            try:
                ok = not self._refused("append_token", self._m["append_token"](sid, n))
            except Exception:
                ok = False
            if not ok:
                self._m["free_sequence"](sid)
        if ok:
            self.length[sid] = n
        return ok

    def can_allocate(self, seq: Any) -> bool:
        sid = self._sid(seq)
        can = self._m.get("can_allocate")
        if can is not None:
            if self._amap.per_id.get("can_allocate_blocks"):  # can_allocate(num_blocks)
                return bool(can(-(-len(seq) // self.block_size)))
            return bool(can(len(seq)))
        try:
            ok = self._admit(sid, len(seq))
        except Exception:
            ok = False
        if ok:
            self.live[sid] = seq
        return ok

    def allocate(self, seq: Any) -> None:
        sid = self._sid(seq)
        if sid not in self.live:  # asked by can_allocate, not yet made
            if not self._admit(sid, len(seq)):
                raise AssertionError(f"{self._amap.get('allocate_sequence')} refused after "
                                     f"{self._amap.get('can_allocate')} said it fits")
            self.live[sid] = seq
        seq.block_table = self._table(sid)
        seq.num_cached_tokens = 0
        self._write_kv(sid, seq.block_table)
        self._probe(sid)

    def can_append(self, seq: Any) -> bool:
        sid = self._sid(seq)
        can = self._m.get("can_append")
        if can is not None:
            return bool(can(sid))
        try:
            ok = not self._refused("append_token", self._append(sid))
        except Exception:
            ok = False
        if ok:
            self.length[sid] = self.length.get(sid, 0) + 1
        self.pending[sid] = ok
        return ok

    def may_append(self, seq: Any) -> None:
        sid = self._sid(seq)
        if not self.pending.pop(sid, False):
            if self._refused("append_token", self._append(sid)):
                raise AssertionError(f"{self._amap.get('append_token')} refused after "
                                     f"{self._amap.get('can_append')} said it fits")
            self.length[sid] = self.length.get(sid, 0) + 1
        seq.block_table = self._table(sid)
        self._write_kv(sid, seq.block_table)
        self._probe(sid)

    def _write_kv(self, sid: int, table: list) -> None:
        """The KV of its new tokens, into the slots its table gives them (KV tensors it owns)."""
        if not self.kv:
            return
        for p in range(self.written.get(sid, 0), self.length.get(sid, 0)):
            if p // self.block_size < len(table):
                self.kv.write(table[p // self.block_size], p % self.block_size, f"sequence {sid} (token {p})")
        self.written[sid] = self.length.get(sid, 0)

    def _probe(self, sid: int) -> None:
        """Copy-on-write, where the allocator forks (``kvspec.alloc.cow``)."""
        if self.probe is not None:
            child = next(self.probe_ids)
            self.length[child] = self.length.get(sid, 0)  # the child has the parent's tokens
            try:
                self.probe.run(sid, child, self.length.get(sid, 0), self.block_size)
            finally:
                self.length.pop(child, None)

    def kvspec_found(self) -> list:
        """What the probes found: (invariant, message), reported by the step that ran them."""
        found = list(self.probe.found) if self.probe is not None else []
        return found + (self.kv.problems() if self.kv else [])

    def _append(self, sid: int) -> Any:
        cow = self._m.get("copy_on_write")
        self.last_copies = []
        if cow is not None and self.length.get(sid, 0) % self.block_size:
            # an explicit copy-on-write before a write into the partial last block (its
            # engine's protocol: copy_on_write(seq_id, block_idx), then the write)
            table = self._table(sid)
            if table:
                from kvspec.alloc.cow import copy_pairs
                pairs = copy_pairs(cow(sid, len(table) - 1)) or []
                self.last_copies = [(a, b) for a, b in pairs if a != b]  # (src, src): nothing copied
        if self._amap.per_id.get("grow_by_one"):
            return self._m["append_token"](sid, 1)
        return self._m["append_token"](sid)

    def _probe_append(self, sid: int) -> Any:
        """The probe's write: with an explicit copy-on-write, its copies are what it returns."""
        value = self._append(sid)
        if self._m.get("copy_on_write") is None or self._refused("append_token", value):
            return value
        return self.last_copies

    def deallocate(self, seq: Any) -> None:
        sid = getattr(seq, _SEQ_ID, None)
        if sid is not None and sid in self.live:
            self._m["free_sequence"](sid)
            del self.live[sid]
            self.length.pop(sid, None)
            self.written.pop(sid, None)
            if self.kv:  # its slots are no one's now; the others' stay
                self.kv.forget_where({(b, p % self.block_size) for s in self.live
                                      for p, b in ((p, self._table(s)[p // self.block_size])
                                                   for p in range(self.written.get(s, 0)))})
        seq.block_table = []
        seq.num_cached_tokens = 0

    # -- the observation hook ---------------------------------------------------------------
    def _refs(self) -> Optional[list]:
        """The allocator's own ref counts, where it keeps them."""
        name = self._amap.get("ref_counts")
        return [int(r) for r in getattr(self.inner, name)] if name else None

    def _free_count(self) -> Optional[int]:
        """The free count it reports (else its free list's length; None: neither)."""
        m = self._amap.methods
        if m.get("num_free"):
            v = getattr(self.inner, m["num_free"])
            return int(v() if callable(v) else v)
        if m.get("free_ids"):
            return len(read_free(getattr(self.inner, m["free_ids"])))
        return None

    def kvspec_observe(self) -> dict:
        m = self._amap.methods
        n = self.num_blocks
        refs = self._refs()
        if refs is None:
            held = Counter(b for sid in self.live for b in self._table(sid))
            refs = [held[b] for b in range(n)]
        if m.get("free_ids"):
            free = read_free(getattr(self.inner, m["free_ids"]))
        else:
            free = [b for b in range(n) if refs[b] == 0]
        out = {"blocks": [(refs[b], None, []) for b in range(n)], "free": free, "index": {}}
        if m.get("num_free"):
            v = getattr(self.inner, m["num_free"])
            out["free_count"] = int(v() if callable(v) else v)
        return out


def front_class(cls: type, amap: AllocMap, make: Callable[[int, int], Any]) -> type:
    """A SequenceFront subclass named after the allocator class (messages name it)."""
    return type(cls.__name__, (SequenceFront,), {"_amap": amap, "_make": staticmethod(make),
                                                 "__module__": cls.__module__})


class FrontDriver(NanoDriver):
    """The nano-vllm driver over a front, with what the front's probes found in the observation."""

    def observe(self) -> Observation:
        obs = super().observe()
        found = getattr(self.mgr, "kvspec_found", None)
        found = tuple(found()) if callable(found) else ()
        return replace(obs, found=found) if found else obs


class SequenceTarget(NanoTarget):
    """The cache-level target over a front: the nano-vllm driver, plus the probes' findings."""

    def _driver(self, config: Config) -> Driver:
        driver = FrontDriver(self.manager_cls, self.seq_cls, self.api, config, self.make, self.names, self.protocol,
                             self.caching_support)
        driver.free_order = self.traits.free_order
        return driver
