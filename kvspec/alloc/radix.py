"""Trie / radix prefix caches (sglang-RadixCache-like classes: ``match_prefix``, ``insert``,
``evict``/``evict_lru``, lock counts on nodes), checked at the cache level with an allocator
kvspec supplies: a plain free list of block ids, which the class never sees.

How kvspec drives one (its own engine, as sglang's scheduler drives sglang's tree):

- the tree's "tokens" are whole blocks: kvspec inserts a key whose items are the tuples of a
  block's tokens, with one value per item, the block id. A pure-Python trie compares items
  with ``==`` and keys children on them, so every divergence falls on a block boundary and a
  match is whole blocks (a paged tree, as sglang's with page_size > 1);
- Admit: match the prompt's full blocks (a whole prompt may hit) and keep the match's
  lock; capacity = free blocks + the tree's evictable blocks (hits excluded); evict the shortfall
  (called again while it frees something); take fresh blocks from the free list; insert the
  full blocks one block longer per call (so every node holds one block, as a one-page chunked
  prefill gives), then match the full prefix again and lock its leading blocks that are the
  request's own (a block the tree already had stays the request's, never deduplicated; the
  request's later blocks hang under the tree's one unlocked, so evicting them only drops the
  tree's reference), and drop the old lock;
- Step: a fresh block when the table is full, insert when a block fills;
- Preempt/Finish: drop the lock; blocks the tree does not hold go back to the free list,
  those it holds stay cached until evicted.

Locks: ``inc_lock_ref(node)``/``dec_lock_ref(node)``-like methods (the match returns the
node), else the match locks itself and ``dec_ref_path(node)`` (with ``match_node`` giving
the node) or ``release(tokens)`` unlocks.

What the observation holds: per block its ref (running tables holding it), its hash (the
tokens of its tree path up to its end, read by walking the tree's nodes), queued if free or
in the tree with lock 0 (evictable); ``free_count`` = free blocks + the tree's own evictable
count where it reports one (else the walk's). So the cache model checks, with the same
invariants as every cache target: a hit returns only KV inserted for exactly that prefix
(HASH_CHAIN, KV_INTEGRITY), a locked (held) block is never evicted (I1: evict gives back a
held block, which kvspec then frees), evict frees exactly what it returns (a block it
returns but keeps is a queue problem) and the evictable count is true (ACCOUNTING)."""
from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

from kvspec.alloc.shapes import (EVICT, EVICTABLE, INSERT, KEY_FIELDS, LOCK, LOCK_FIELDS, MATCH,
                                 MATCH_NODE, ROOT_FIELDS, UNLOCK_NODE, UNLOCK_TOKENS, VALUE_FIELDS, required, takes)
from kvspec.spec.config import Config
from kvspec.spec.observation import BlockState, Observation, RequestState
from kvspec.spec.ops import Admit, Finish, Op, Preempt, Step
from kvspec.targets.base import Driver, Target, TargetError, Traits

ROLES = ("match", "insert", "evict", "lock", "unlock", "match_node", "release", "evictable")


def _find(cls: type, names: tuple[str, ...], nargs: int) -> Optional[str]:
    for n in names:
        req = required(cls, n)
        if req is not None and len(req) <= nargs and takes(cls, n, nargs):
            return n
    return None


def infer_radix(cls: type) -> Optional[dict]:
    """The roles of a radix prefix cache, or None where it is not one (match, insert and
    evict are needed, and some way to unlock a match)."""
    m = {"match": _find(cls, MATCH, 1), "insert": _find(cls, INSERT, 2), "evict": _find(cls, EVICT, 1)}
    if not all(m.values()):
        return None
    m["lock"] = _find(cls, LOCK, 1)
    m["unlock"] = _find(cls, UNLOCK_NODE, 1)
    m["match_node"] = _find(cls, MATCH_NODE, 1)
    m["release"] = _find(cls, UNLOCK_TOKENS, 1)
    n = _find(cls, EVICTABLE, 0)
    raw = inspect.getattr_static(cls, n, None) if n else None
    m["evictable"] = n if n and (callable(raw) or isinstance(raw, property)) else None
    if not (m["unlock"] or m["release"]):
        return None
    return m


def describe(cls: type, m: dict, walk: dict) -> str:
    c = cls.__name__
    if m["lock"]:
        lock = f"lock <- {c}.{m['lock']}(node), unlock <- {c}.{m['unlock']}(node)"
    elif m["unlock"] and m["match_node"]:
        lock = f"the match locks ({c}.{m['match_node']}(key) -> node), unlock <- {c}.{m['unlock']}(node)"
    else:
        lock = f"the match locks, unlock <- {c}.{m['release'] or m['unlock']}(key)"
    ev = f"{c}.{m['evictable']}" if m["evictable"] else "not found (kvspec counts unlocked tree blocks)"
    match = m["match_node"] if not m["lock"] and m["unlock"] and m["match_node"] else m["match"]
    return (f"radix prefix cache (inferred), over a free list kvspec supplies: Admit -> {c}.{match}(the prompt's "
            f"full blocks), {c}.{m['evict']}(n) for a shortfall, {c}.{m['insert']}(key, block ids) "
            f"per full block; {lock}; evictable count <- {ev}; tree walked through .{walk['root']} "
            f"(.children, .{walk['key']}, .{walk['value']}, .{walk['lock']}); keys are block-sized token tuples")


def _ids(v: Any) -> list:
    if hasattr(v, "tolist"):
        v = v.tolist()
    return list(v) if v is not None else []


def parse_match(r: Any) -> tuple[list, Any]:
    """(matched values, node or None) from what a match returns: ``(n, values[, node])``,
    ``values``, ``(values, node)`` or an object with ``value``/``last_node``-like fields."""
    if isinstance(r, (tuple, list)):
        if len(r) >= 2 and isinstance(r[0], int) and not isinstance(r[0], bool) and not isinstance(r[1], int):
            vals = _ids(r[1])
            return vals[: r[0]] if len(vals) >= r[0] else vals, (r[2] if len(r) > 2 else None)
        if len(r) == 2 and isinstance(r[0], (list, tuple)) or hasattr(r[0] if r else None, "tolist"):
            return _ids(r[0]), r[1] if len(r) > 1 else None
        return list(r), None
    for vf in ("value", "values", "device_indices", "blocks", "block_ids"):
        if hasattr(r, vf):
            node = next((getattr(r, nf) for nf in ("last_node", "last_device_node", "node") if hasattr(r, nf)), None)
            return _ids(getattr(r, vf)), node
    raise TypeError(f"kvspec cannot read a match result of type {type(r).__name__}")


def find_walk(tree: Any) -> Optional[dict]:
    """The node field names of a built tree: its root, key, value and lock fields."""
    for rf in ROOT_FIELDS:
        root = getattr(tree, rf, None)
        if root is not None and isinstance(getattr(root, "children", None), dict):
            break
    else:
        return None
    out = {"root": rf}
    for role, names in (("key", KEY_FIELDS), ("value", VALUE_FIELDS), ("lock", LOCK_FIELDS)):
        out[role] = next((n for n in names if hasattr(root, n)), None)
        if out[role] is None:
            return None
    return out


class _Req:
    __slots__ = ("tokens", "table", "handle", "cached", "running", "own")

    def __init__(self, tokens: list) -> None:
        self.tokens, self.table, self.handle, self.cached, self.running = tokens, [], None, 0, False
        self.own = 0  # leading blocks of the table that are the tree's, under q's lock


class RadixDriver(Driver):
    def __init__(self, make: Callable[[int, int], Any], m: dict, walk: dict, config: Config) -> None:
        if config.level != "cache":
            raise TargetError("a radix prefix cache is checked at the cache level: use --level cache")
        self.tree = make(config.num_blocks, config.block_size)
        self.m, self.walk, self.n, self.bs = m, walk, config.num_blocks, config.block_size
        self.free: list[int] = list(range(config.num_blocks))  # kvspec's own allocator
        self.in_tree: set[int] = set()  # blocks kvspec handed to the tree and it has not evicted
        self.stale: dict[int, tuple] = {}  # a computed full block the tree did not take: its content
        self.reqs: dict[str, _Req] = {}
        self.problems: list[str] = []
        self.f = {k: getattr(self.tree, v) for k, v in m.items() if v and callable(getattr(self.tree, v, None))}

    # -- the tree's API --------------------------------------------------------------
    def _key(self, tokens: list, nblocks: int) -> list:
        bs = self.bs
        return [tuple(tokens[i * bs:(i + 1) * bs]) for i in range(nblocks)]

    def _lock(self, key: list) -> tuple[list, Any]:
        """Match ``key`` and lock what it matched: (the matched block ids, an unlock handle)."""
        if self.m["lock"]:
            vals, node = parse_match(self.f["match"](key))
            self.f["lock"](node)
            return vals, ("node", node)
        if self.m["unlock"] and self.m["match_node"]:
            vals, node = parse_match(self.f["match_node"](key))
            return vals, ("node", node)
        vals, node = parse_match(self.f["match"](key))
        if self.m["unlock"] and node is not None:
            return vals, ("node", node)
        return vals, ("key", list(key))

    def _unlock(self, handle: Any) -> None:
        if handle is None:
            return
        kind, x = handle
        if kind == "node":
            self.f["unlock"](x)
        else:
            self.f["release"](x)

    def _evictable(self, locked: tuple = ()) -> int:
        """The tree's own evictable count, else its blocks no table holds nor ``locked`` (a
        match's hits, locked before they join a table)."""
        if self.m["evictable"]:
            v = getattr(self.tree, self.m["evictable"])
            return int(v() if callable(v) else v)
        held = self._held() | set(locked)
        return sum(1 for b in self._walk() if b not in held)

    def _room(self, locked: tuple = ()) -> int:
        return len(self.free) + self._evictable(locked)

    def _evict(self, need: int) -> None:
        while len(self.free) < need:
            before = set(self.in_tree)
            got = self.f["evict"](need - len(self.free))
            pages = []
            for x in _ids(got) if got is not None else []:
                b = x if isinstance(x, int) else None
                if b is None or b in pages:
                    continue
                pages.append(b)
            if not pages:
                return
            held = self._held()
            locked = {b for q in self.reqs.values() if q.running for b in q.table[:q.own]}
            for b in pages:
                if b not in before:
                    self.problems.append(f"{self.m['evict']}() returned block {b}, which the tree did not hold")
                    continue
                self.in_tree.discard(b)
                if b in locked or b not in held:
                    self.free.append(b)  # evicted means free: a locked one too (then held and free: I1)
                # else: an unlocked block a request still holds (past a block the tree already had):
                # the tree let go of it, the request frees it when it ends
            still = set(self._walk()) & set(pages)
            self.problems += [f"{self.m['evict']}() returned block {b} but the tree still holds it"
                              for b in sorted(still)]

    def _take(self, n: int) -> list:
        got, self.free = self.free[:n], self.free[n:]
        for b in got:
            self.stale.pop(b, None)
        return got

    def _cache(self, q: _Req) -> None:
        """Insert q's full blocks one block longer per call, lock the full prefix, drop the
        old lock; a block the tree already held stays q's own (never deduplicated)."""
        full = min(len(q.tokens) // self.bs, len(q.table))
        if full <= q.cached:
            return
        key = self._key(q.tokens, full)
        for i in range(q.cached, full):
            self.f["insert"](key[:i + 1], list(q.table[:i + 1]))
        vals, handle = self._lock(key)  # what the tree now holds for q's blocks
        self._unlock(handle)
        own = 0  # past a block the tree already had, q's blocks hang under that one: not q's to lock
        while own < full and own < len(vals) and vals[own] == q.table[own]:
            own += 1
        handle = self._lock(key[:own])[1] if own else None
        self._unlock(q.handle)
        q.handle, q.own = handle, own
        for i in range(q.cached, full):
            if i < len(vals) and vals[i] == q.table[i]:
                self.in_tree.add(q.table[i])
            else:
                self.stale[q.table[i]] = tuple(q.tokens[:(i + 1) * self.bs])
        q.cached = full

    # -- ops -------------------------------------------------------------------------
    def apply(self, op: Op) -> Any:
        if getattr(op, "chunk", None) is not None or getattr(op, "extra", None) or getattr(op, "external", 0) \
                or getattr(op, "drafts", ()):
            raise TargetError(f"{op!r}: chunks, extra keys, connector tokens and drafts are not driven on a radix "
                              f"prefix cache")
        if isinstance(op, Admit):
            if op.prompt is not None:
                if op.req in self.reqs:
                    raise ValueError(f"request {op.req} already exists")
                self.reqs[op.req] = _Req(list(op.prompt))
            q = self.reqs.get(op.req)
            if q is None or q.running:
                raise ValueError(f"request {op.req} is not waiting")
            return self._admit(q)
        if isinstance(op, Step):
            q = self.reqs.get(op.req)
            if q is None or not q.running:
                raise ValueError(f"request {op.req} is not running")
            q.tokens.append(op.token)
            return self._grow(q)
        if isinstance(op, (Preempt, Finish)):
            q = self.reqs.get(op.req) if isinstance(op, Preempt) else self.reqs.pop(op.req, None)
            if q is None or (isinstance(op, Preempt) and not q.running):
                raise ValueError(f"request {op.req} is not running")
            if q.running:
                self._release(q)
            return None
        raise TargetError(f"{type(op).__name__} is not a cache-level op")

    def _admit(self, q: _Req) -> Optional[int]:
        n = len(q.tokens)
        vals, handle = self._lock(self._key(q.tokens, n // self.bs))  # the whole prompt may hit
        hits = list(vals[:n // self.bs])
        need = -(-n // self.bs) - len(hits)
        if need > self._room(tuple(hits)):
            self._unlock(handle)
            return None
        self._evict(need)
        if len(self.free) < need:
            self._unlock(handle)
            return None
        q.table = hits + self._take(need)
        q.handle, q.cached, q.running = handle, len(hits), True
        self._cache(q)
        return len(hits) * self.bs

    def _grow(self, q: _Req) -> bool:
        if -(-len(q.tokens) // self.bs) > len(q.table):
            if self._room() < 1:
                return False
            self._evict(1)
            if not self.free:
                return False
            q.table += self._take(1)
        self._cache(q)
        return True

    def _release(self, q: _Req) -> None:
        self._unlock(q.handle)
        table = q.table
        q.table, q.handle, q.cached, q.running, q.own = [], None, 0, False, 0
        held = self._held()
        for b in reversed(table):
            if b not in self.in_tree and b not in held:
                self.free.append(b)
                self.stale.pop(b, None)  # a free block the tree does not hold is not cached

    def _held(self) -> set:
        return {b for q in self.reqs.values() if q.running for b in q.table}

    # -- observation -------------------------------------------------------------------
    def _walk(self) -> dict:
        """block -> (hash: the tokens of its tree path up to its end, its node's lock)."""
        w = self.walk
        out: dict = {}
        stack = [(getattr(self.tree, w["root"]), ())]
        while stack:
            node, prefix = stack.pop()
            for child in list(getattr(node, "children", {}).values()):
                items = tuple(getattr(child, w["key"]) or ())
                vals = _ids(getattr(child, w["value"]))
                lock = getattr(child, w["lock"]) or 0
                path = prefix + items
                for i, b in enumerate(vals[:len(items)]):
                    if isinstance(b, int):
                        toks = tuple(t for item in path[:len(prefix) + i + 1] for t in
                                     (item if isinstance(item, tuple) else (item,)))
                        out[b] = (toks, int(lock))
                stack.append((child, path))
        return out

    def observe(self) -> Observation:
        walk = self._walk()
        problems = list(self.problems)
        free = [b for b in self.free]
        held: dict[int, int] = {}
        tables = {rid: tuple(q.table) for rid, q in self.reqs.items() if q.running}
        for t in tables.values():
            for b in t:
                held[b] = held.get(b, 0) + 1
        # a tree block no table holds is free to the cache model (evictable once its node's
        # lock drops: a descendant's lock may pin it, as any tree's does)
        evictable = [b for b in sorted(walk) if not held.get(b)]
        locked = {b for q in self.reqs.values() if q.running for b in q.table[:q.own]}
        problems += [f"block {b} is in kvspec's free list (the tree gave it back) and still in the tree"
                     for b in free if b in walk]
        blocks = []
        for b in range(self.n):
            h = walk[b][0] if b in walk else self.stale.get(b)
            # a held tree block must be locked: unlocked, the tree may evict it (queued)
            blocks.append(BlockState(held.get(b, 0), h, b in free or (b in walk and not held.get(b))
                                     or (b in locked and b in walk and walk[b][1] == 0)))
        index: dict = {}
        for b, (h, _) in walk.items():
            index[h] = index.get(h, ()) + (b,)
        requests = {rid: RequestState(tables[rid], min(len(self.reqs[rid].tokens), len(tables[rid]) * self.bs))
                    for rid in tables}
        return Observation(blocks=tuple(blocks), queue=tuple(free + evictable), index=index,
                           free_count=len(free) + self._evictable(), null_block=None, requests=requests,
                           queue_problems=tuple(problems))


class RadixTarget(Target):
    def __init__(self, name: str, traits: Traits, make: Callable[[int, int], Any], m: dict, walk: dict) -> None:
        self.name, self.traits, self.make, self.m, self.walk = name, traits, make, m, walk
        self.api = "radix"

    def driver(self, config: Config) -> Driver:
        return RadixDriver(self.make, self.m, self.walk, config)

    def describe(self) -> str:
        return f"{self.name} (radix prefix cache)"


def load_radix(spec: str, cls: type, make: Optional[Callable[..., Any]], m: dict) -> Target:
    """The target for a radix prefix cache; its mapping is shown on stderr and in the report."""
    import sys

    from kvspec.alloc.build import build_probe, plan
    try:
        make_fn, how = plan(make or cls)
    except TargetError as e:
        raise TargetError(f"target {spec}: {e}") from None
    probe = build_probe(make_fn, spec)
    try:
        getattr(probe, m["insert"])([(1, 2), (3, 4)], [0, 1])
    except Exception as e:
        raise TargetError(f"target {spec}: {cls.__name__}.{m['insert']}(key, values) raised {type(e).__name__}: "
                          f"{e} on a two-item key: kvspec drives radix caches whose key items are compared with "
                          f"== (a list of hashable items)") from None
    walk = find_walk(probe)
    if walk is None:
        raise TargetError(f"target {spec}: {cls.__name__} is a radix prefix cache, but kvspec finds no tree to "
                          f"read (a root node with a children dict and key/value/lock fields)")
    shown = describe(cls, m, walk) + f"; built as {how}"
    print(f"kvspec: note: {spec}: {shown}", file=sys.stderr)
    traits = Traits(null_block=False, unhashed_free_first=False, misuse_errors=(), levels=("cache",),
                    prefix_caching="on", free_order="any", index_first_wins=True, whole_prompt_hits=True,
                    documented_noops=frozenset({"free_unknown_request"}),
                    unsupported_ops=frozenset({"Touch", "Cache", "CachePartial", "Lookup", "Reset", "FreeForeign"}),
                    declaration=f"none: {shown}")
    return RadixTarget(spec, traits, make_fn, m, walk)


__all__ = ["infer_radix", "load_radix", "RadixDriver", "RadixTarget", "parse_match", "find_walk"]
