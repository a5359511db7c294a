"""Adapter for sglang's KV allocator and radix cache (``--target sglang``).

Loading. ``sglang/__init__.py`` and ``sglang/srt/__init__.py`` start the serving stack
and ``sglang.srt.mem_cache.memory_pool`` pulls in every model config (torchvision,
flash kernels). The adapter imports ``sglang.srt.mem_cache.allocator`` (base, paged,
token) and ``sglang.srt.mem_cache.radix_cache`` by their real names under stand-in
parent packages (``kvspec.targets.stub_import``), with two leaf stand-ins for modules
that the radix cache imports only for names it never uses here:
``memory_pool.ReqToTokenPool`` (a type annotation: the driver keeps each request's KV
row itself) and ``observability.metrics_collector`` (used only when metrics are on).

Pool level: ``PagedTokenToKVPoolAllocator`` (``need_sort=False``, sglang's default).
Pages are kvspec's blocks; page 0 is the padding page sglang never hands out (the null
block), so ``num_blocks`` = pages + 1. ``Alloc(n)`` = ``alloc(n * page_size)`` (``None``
is sglang's refusal: the driver raises ``AllocRefused``); ``Free(blocks)`` =
``free_page_ids(blocks)``, the release path every ``free*`` method ends in (``free()``
first maps token slots to pages and sorts them with ``torch.unique``; the request
release path, ``free_kv_row`` -> ``free_segment``, keeps row order): the freed pages go
to the front of ``free_pages`` in the order given, so the most recently freed page is
reused first. ``FreeForeign`` frees a page id only a larger pool has. There are no ref
counts, no touch and no prefix cache at this level (``Traits.unsupported_ops``): a page
is held (ref 1) iff it is not in ``free_pages``.

Cache level: ``RadixCache`` over the paged allocator, driven the way sglang's scheduler
does it. Admit: ``match_prefix`` on all tokens but the last (sglang computes at least
one token), ``inc_lock_ref`` on the matched node, a capacity check against free plus
evictable tokens (refused: the lock is dropped again), ``evict`` for the shortfall,
``alloc_extend`` for the rest, then ``insert`` of the full pages (as
``cache_unfinished_req`` does after a prefill) with the lock moved to the new node; a
page ``insert`` finds already in the tree replaces the request's own copy, which is
freed (sglang deduplicates at insertion). Step: ``alloc_decode`` (``alloc_extend`` for
several pending tokens) after evicting if short, then ``insert`` of a newly full page.
Preempt / finish: ``dec_lock_ref`` and ``free_segment`` of the row past the tree's part
(the unfull tail page), as ``release_kv_cache`` does. With prefix caching off the tree
is built with ``disable=True`` (it then matches and holds nothing) and nothing is
inserted: a release frees the whole row.

Observation. A page in ``free_pages``: ref 0, queued, no hash. A page in the tree: its
hash is the tree path's tokens up to the page's end (the radix tree's own key for it),
its ref is its node's ``lock_ref`` (the requests locking it or a node below), and it is
queued (reclaimable) while that is 0. ``queue`` = ``free_pages`` in order, then the
evictable tree pages in the order ``evict`` would take them (least recently accessed
leaf first, a parent once its last child is gone). ``free_count`` = (available +
evictable tokens) / page size.
"""
from __future__ import annotations

import copy
import heapq
from array import array
from typing import Any, Optional

from kvspec.errors import TargetError
from kvspec.spec.config import Config
from kvspec.spec.observation import BlockState, Observation, RequestState
from kvspec.spec.ops import Admit, Alloc, Finish, Free, FreeForeign, Op, Preempt, Step
from kvspec.targets.base import Driver, Target, Traits
from kvspec.targets.stub_import import package_dir, stand_ins

INSTALL = "pip install --no-deps sglang==0.5.23 orjson==3.8.3"


class AllocRefused(Exception):
    """The allocator returned None: too few free pages (sglang's refusal)."""


class _Unavailable:
    def __init__(self, what: str) -> None:
        self.what = what

    def __call__(self, *_a: Any, **_k: Any) -> Any:
        raise RuntimeError(f"{self.what} is not available under kvspec")


def _leaf_stand_ins() -> dict:
    class ReqToTokenPool:  # only a type name to the radix cache
        pass

    return {
        "sglang.srt.mem_cache.memory_pool": {"ReqToTokenPool": ReqToTokenPool},
        "sglang.srt.observability.metrics_collector": {
            "STAT_LOGGER_ROLE_RADIX_CACHE": "radix_cache",
            "RadixCacheMetricsCollector": type("RadixCacheMetricsCollector", (), {}),
            "radix_cache_metric_labels": _Unavailable("radix cache metrics"),
            "resolve_collector_class": _Unavailable("radix cache metrics"),
        },
    }


class SglangAPI:
    """The sglang classes the drivers use."""

    def __init__(self) -> None:
        import importlib

        root = package_dir("sglang", "sglang", INSTALL)
        try:
            with stand_ins(root, ("sglang", "sglang.srt", "sglang.srt.mem_cache"), _leaf_stand_ins()):
                alloc = importlib.import_module("sglang.srt.mem_cache.allocator")
                rc = importlib.import_module("sglang.srt.mem_cache.radix_cache")
                params = importlib.import_module("sglang.srt.mem_cache.cache_init_params")
                base = importlib.import_module("sglang.srt.mem_cache.base_prefix_cache")
        except TargetError:
            raise
        except Exception as e:  # a missing dependency (orjson, msgspec, ...) or an API change
            raise TargetError(f"target sglang: cannot import sglang.srt.mem_cache: {type(e).__name__}: {e} "
                              f"({INSTALL})") from None
        try:
            self.Paged = alloc.PagedTokenToKVPoolAllocator
            self.RadixCache, self.RadixKey = rc.RadixCache, rc.RadixKey
            self.CacheInitParams = params.CacheInitParams
            self.MatchPrefixParams, self.InsertParams = base.MatchPrefixParams, base.InsertParams
            self.EvictParams = base.EvictParams
        except AttributeError as e:
            raise TargetError(f"target sglang: the installed sglang lacks {e.name}: drive sglang 0.5.23") from None


def _pages(kv: Any, ps: int) -> list[int]:
    return [int(t) // ps for t in kv[::ps].tolist()]


class SglangPoolDriver(Driver):
    def __init__(self, api: SglangAPI, config: Config) -> None:
        import torch

        self.torch = torch
        self.ps = config.block_size
        self.num_pages = config.num_blocks - 1
        try:
            self.alloc = api.Paged(size=self.num_pages * self.ps, page_size=self.ps, dtype=torch.float16,
                                   device="cpu", kvcache=None, need_sort=False)
        except Exception as e:
            raise TargetError(f"target sglang: cannot build PagedTokenToKVPoolAllocator: {type(e).__name__}: {e}") from None

    # Forking (the model checker): deep copies only. Pickling a class of a module loaded
    # under the stand-in parents imports its top-level package, i.e. runs sglang's real
    # ``__init__`` (seconds, and the serving stack), so it is refused up front.
    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError("an sglang driver is forked by deep copy, not pickled")

    def __deepcopy__(self, memo: dict) -> "SglangPoolDriver":
        new = object.__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return new

    def _slots(self, pages) -> Any:
        ps = self.ps
        return self.torch.tensor([p * ps + i for p in pages for i in range(ps)], dtype=self.torch.int64)

    def apply(self, op: Op) -> Any:
        if isinstance(op, Alloc):
            out = self.alloc.alloc(op.n * self.ps)
            if out is None:
                raise AllocRefused(f"alloc({op.n * self.ps}) returned None")
            return tuple(_pages(out, self.ps))
        if isinstance(op, Free):
            return self.alloc.free_page_ids(self.torch.tensor(op.blocks, dtype=self.torch.int64))
        if isinstance(op, FreeForeign):
            return self.alloc.free_page_ids(self.torch.tensor([self.num_pages + 1 + op.block], dtype=self.torch.int64))
        raise TargetError(f"target sglang: the paged allocator has no {type(op).__name__} (no ref counts, no prefix cache)")

    def _free_pages(self) -> list[int]:
        return [int(p) for p in self.alloc.get_all_free_pages().tolist()]

    def observe(self) -> Observation:
        queue = self._free_pages()
        queued = set(queue)
        blocks = [BlockState(0, None, True) if b in queued else BlockState(1, None, False)
                  for b in range(self.num_pages + 1)]
        blocks[0] = BlockState(0, None, False)  # the padding page: never handed out
        return Observation(blocks=tuple(blocks), queue=tuple(queue), index={},
                           free_count=self.alloc.available_size() // self.ps, null_block=0)


class _Req:
    __slots__ = ("tokens", "kv", "node", "cached", "running")

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.kv: Any = None          # token slots of the computed tokens (the req_to_token row)
        self.node: Any = None        # the locked tree node, or None
        self.cached = 0              # leading tokens of the row that the tree owns
        self.running = False


class SglangCacheDriver(SglangPoolDriver):
    def __init__(self, api: SglangAPI, config: Config) -> None:
        super().__init__(api, config)
        self.api = api
        try:
            self.tree = api.RadixCache(api.CacheInitParams(disable=not config.caching, req_to_token_pool=None,
                                                           token_to_kv_pool_allocator=self.alloc, page_size=self.ps))
        except Exception as e:
            raise TargetError(f"target sglang: cannot build RadixCache: {type(e).__name__}: {e}") from None
        self.caching = config.caching
        self.reqs: dict[str, _Req] = {}

    # -- helpers -----------------------------------------------------------------
    def _key(self, tokens: list[int]) -> Any:
        return self.api.RadixKey(array("q", tokens))

    def _room(self) -> int:
        return self.alloc.available_size() + self.tree.evictable_size()

    def _make_room(self, tokens: int) -> None:
        short = tokens - self.alloc.available_size()
        if short > 0:
            self.tree.evict(self.api.EvictParams(num_tokens=short))

    def _t(self, values) -> Any:
        return self.torch.tensor(values, dtype=self.torch.int64)

    def _extend(self, q: _Req, start: int, end: int) -> Optional[Any]:
        """Slots for tokens [start, end) of q after its row ``q.kv[:start]``."""
        last = int(q.kv[start - 1]) if start > 0 else -1
        if end - start == 1 and start > 0:
            return self.alloc.alloc_decode(self._t([end]), self._t([end]), self._t([last]))
        return self.alloc.alloc_extend(self._t([start]), self._t([start]), self._t([end]), self._t([end]),
                                       self._t([last]), end - start)

    def _checkpoint(self, q: _Req, release: bool = False) -> None:
        """sglang's ``checkpoint``: hand q's full pages to the tree, free the request's own
        copies of pages the tree already held, re-read the row's tree part from the tree
        (``match_prefix``, which also marks the path as just used) and move the lock to
        its end. The driver inserts one page per ``insert``, as a chunked prefill with a
        one-page chunk does, so every tree node holds one page (see the module doc)."""
        ps = self.ps
        full = len(q.kv) // ps * ps
        if not self.caching or (full <= q.cached and not release):
            return
        for end in range(q.cached + ps, full + 1, ps):
            res = self.tree.insert(self.api.InsertParams(key=self._key(q.tokens[:end]), value=q.kv[:end].clone()))
            if res.prefix_len >= end:  # the tree held this page already: ours is a duplicate
                self.alloc.free_segment(q.kv[end - ps:end], start_pos=end - ps)
        match = self.tree.match_prefix(self.api.MatchPrefixParams(key=self._key(q.tokens[:full])))
        node = match.last_device_node
        q.kv = self.torch.cat([self.tree.path_device_indices(node), q.kv[full:]])
        if q.node is not None:
            self.tree.dec_lock_ref(q.node)
        self.tree.inc_lock_ref(node)
        q.node, q.cached = node, full

    def _release(self, q: _Req) -> None:
        """``release_kv_cache(checkpoint=True)``: checkpoint, unlock, free the rest of the row."""
        if q.kv is not None:
            self._checkpoint(q, release=True)
        if q.node is not None:
            self.tree.dec_lock_ref(q.node)
        if q.kv is not None and len(q.kv) > q.cached:
            self.alloc.free_segment(q.kv[q.cached:], start_pos=q.cached)
        q.kv, q.node, q.cached, q.running = None, None, 0, False

    # -- ops ---------------------------------------------------------------------
    def apply(self, op: Op) -> Any:
        if getattr(op, "chunk", None) is not None or getattr(op, "extra", None) or getattr(op, "external", 0) \
                or getattr(op, "drafts", ()):
            raise TargetError(f"target sglang: {op!r} uses chunks, extra keys, connector tokens or drafts, "
                              f"which this adapter does not drive")
        if isinstance(op, Admit):
            if op.prompt is not None:
                if op.req in self.reqs:
                    raise ValueError(f"request {op.req} already exists")
                if not op.prompt:
                    raise ValueError("empty prompt")
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
        if isinstance(op, Preempt):
            q = self.reqs.get(op.req)
            if q is None or not q.running:
                raise ValueError(f"request {op.req} is not running")
            self._release(q)
            return None
        if isinstance(op, Finish):
            q = self.reqs.pop(op.req, None)
            if q is None:
                raise ValueError(f"request {op.req} does not exist")
            if q.running:
                self._release(q)
            return None
        raise TargetError(f"target sglang: {type(op).__name__} is not a cache-level op")

    def _admit(self, q: _Req) -> Optional[int]:
        n, ps = len(q.tokens), self.ps
        match = self.tree.match_prefix(self.api.MatchPrefixParams(key=self._key(q.tokens[:-1])))
        hit, node = match.device_prefix_len, match.last_device_node
        self.tree.inc_lock_ref(node)
        need = -(-n // ps) * ps - hit
        if need > self._room():
            self.tree.dec_lock_ref(node)
            return None
        self._make_room(need)
        q.kv = self.tree.path_device_indices(node).clone()
        out = self._extend(q, hit, n)
        if out is None:
            self.tree.dec_lock_ref(node)
            q.kv = None
            return None
        q.kv = self.torch.cat([q.kv, out])
        q.node, q.cached, q.running = node, hit, True
        self._checkpoint(q)
        return hit

    def _grow(self, q: _Req) -> bool:
        start, end = len(q.kv), len(q.tokens)
        need = -(-end // self.ps) * self.ps - -(-start // self.ps) * self.ps
        if need > self._room():
            return False
        self._make_room(need)
        out = self._extend(q, start, end)
        if out is None:
            return False
        q.kv = self.torch.cat([q.kv, out])
        self._checkpoint(q)
        return True

    # -- observation -------------------------------------------------------------
    def _tree_pages(self) -> tuple[dict, list]:
        """page -> (hash, ref) for every page in the tree, and the evictable pages in
        the order ``evict`` takes them."""
        ps, root = self.ps, self.tree.root_node
        info: dict[int, tuple] = {}
        stack = [(root, ())]
        while stack:
            node, prefix = stack.pop()
            for child in node.children.values():
                toks = prefix + tuple(child.key.raw_token_ids())
                base = len(prefix)
                for i, p in enumerate(_pages(child.value, ps)):
                    info[p] = (toks[: base + (i + 1) * ps], child.lock_ref)
                stack.append((child, toks))
        # the eviction order: evict()'s heap walk, without freeing anything (equal
        # priorities, which sglang leaves to the heap's layout, go by page id here)
        strategy = self.tree.eviction_strategy
        left = {id(n): len(n.children) for n in self._nodes()}

        def entry(x: Any) -> tuple:
            pages = _pages(x.value, ps)
            return (strategy.get_priority(x), pages[0] if pages else -1, id(x), x, pages)

        heap = [entry(x) for x in self.tree.evictable_leaves]
        heapq.heapify(heap)
        order: list[int] = []
        while heap:
            *_, x, pages = heapq.heappop(heap)
            order.extend(pages)
            parent = x.parent
            left[id(parent)] -= 1
            if parent is not root and left[id(parent)] == 0 and parent.lock_ref == 0:
                heapq.heappush(heap, entry(parent))
        return info, order

    def _nodes(self) -> list:
        out, stack = [], [self.tree.root_node]
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    def observe(self) -> Observation:
        free = self._free_pages()
        info, evictable = self._tree_pages()
        queue = free + evictable
        queued = set(queue)
        tables = {rid: tuple(_pages(q.kv, self.ps)) for rid, q in self.reqs.items() if q.running}
        holders: dict[int, int] = {}
        for table in tables.values():
            for b in table:
                holders[b] = holders.get(b, 0) + 1
        blocks = []
        for b in range(self.num_pages + 1):
            # a tree page counts its node's lock refs; a page outside the tree, its tables
            h, ref = info.get(b, (None, holders.get(b, 0)))
            blocks.append(BlockState(ref, h, b in queued))
        index: dict = {}
        for p, (h, _) in info.items():
            index[h] = index.get(h, ()) + (p,)
        requests = {rid: RequestState(tables[rid], len(self.reqs[rid].kv)) for rid in tables}
        count = (self.alloc.available_size() + self.tree.evictable_size()) // self.ps
        return Observation(blocks=tuple(blocks), queue=tuple(queue), index=index, free_count=count,
                           null_block=0, requests=requests)


class SglangTarget(Target):
    name = "sglang"
    # sglang's paged allocator is built for page_size > 1 (``alloc_decode`` finds a
    # page boundary with ``seq_len % page_size == 1``; page size 1 uses
    # ``TokenToKVPoolAllocator``).
    # Free order: the allocator's free list takes freed pages at the front, in the order
    # freed (most recently freed reused first); at the cache level a page the radix tree
    # keeps is reclaimed only after every free page, its path's tail first. With nothing
    # hashed (the pool level) vLLM's "unhashed blocks to the front" gives exactly the
    # former, and its "hashed blocks to the back, a request's tail first" the latter.
    traits = Traits(null_block=True, min_block_size=2, free_order="lru_tail_first", unhashed_free_first=True,
                    prefix_caching="on",
                    unsupported_ops=frozenset({"Touch", "Cache", "CachePartial", "Lookup", "Reset"}))

    def __init__(self) -> None:
        self.api = SglangAPI()

    def driver(self, config: Config) -> Driver:
        if config.block_size < 2:
            raise TargetError("target sglang: the paged allocator needs a page size of at least 2")
        if getattr(config, "kv_groups", "full") not in ("full", None) or getattr(config, "max_model_len", None):
            raise TargetError("target sglang: the adapter drives one full-attention KV pool (no --kv-groups, "
                              "no max_model_len)")
        if config.level == "cache":
            return SglangCacheDriver(self.api, config)
        return SglangPoolDriver(self.api, config)

    def describe(self) -> str:
        try:
            from importlib.metadata import version
            return f"sglang {version('sglang')} (PagedTokenToKVPoolAllocator, RadixCache)"
        except Exception:
            return "sglang (PagedTokenToKVPoolAllocator, RadixCache)"
