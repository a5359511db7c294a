"""Adapter for kvspec's own allocator (``kvspec.impl``), at both levels."""
from __future__ import annotations

import hashlib
from pathlib import Path
from types import ModuleType
from typing import Any, Optional

from ..config import Config
from ..observation import BlockState, Observation, RequestState
from ..ops import Admit, Alloc, Cache, CachePartial, Finish, Free, FreeForeign, Lookup, Op, Preempt, Reset, Step, Touch
from .base import Driver, Target, Traits


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
    blocks = tuple(BlockState(b.ref_cnt, b.block_hash, b.block_id in queued) for b in pool.blocks)
    index = {h: tuple(m.keys()) if isinstance(m, dict) else (m.block_id,)
             for h, m in _index_items(pool.cached_block_hash_to_block)}
    null = pool.null_block.block_id if getattr(pool, "null_block", None) is not None else None
    return Observation(blocks=blocks, queue=tuple(queue), index=index, free_count=pool.get_num_free_blocks(),
                       null_block=null, requests=requests or {}, queue_problems=tuple(problems))


def _index_items(index: Any):
    return index.items() if isinstance(index, dict) else index._cache.items()


class ImplPoolDriver(Driver):
    def __init__(self, mod: ModuleType, config: Config) -> None:
        self.mod = mod
        self.pool = mod.BlockPool(config.num_blocks, enable_caching=config.caching)

    def _blocks(self, ids):
        return [self.pool.blocks[i] for i in ids]

    def apply(self, op: Op) -> Any:
        p = self.pool
        if isinstance(op, Alloc):
            return tuple(b.block_id for b in p.get_new_blocks(op.n))
        if isinstance(op, Free):
            return p.free_blocks(self._blocks(op.blocks))
        if isinstance(op, Touch):
            return p.touch(self._blocks(op.blocks))
        if isinstance(op, (Cache, CachePartial)):
            hashes = [label_hash(h) for h in op.hashes]
            return p.cache_full_blocks(self._blocks(op.blocks), hashes, 0, len(op.blocks))
        if isinstance(op, FreeForeign):
            other = self.mod.BlockPool(len(p.blocks))
            return p.free_blocks(other.get_new_blocks(1))
        if isinstance(op, Lookup):
            b = p.get_cached_block(label_hash(op.hash))
            return None if b is None else b.block_id
        if isinstance(op, Reset):
            return p.reset_prefix_cache()
        raise TypeError(f"{op!r} is not a pool-level op")

    def observe(self) -> Observation:
        return observe_pool(self.pool)


class ImplCacheDriver(Driver):
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

    def observe(self) -> Observation:
        reqs = {rid: RequestState(tuple(self.mgr.get_block_ids(rid)), self.reqs[rid].num_computed_tokens)
                for rid in sorted(self.running)}
        return observe_pool(self.mgr.block_pool, reqs)


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
