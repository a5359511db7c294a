"""Adapter for kvspec's own allocator (``kvspec.impl``), at both levels."""
from __future__ import annotations

import hashlib
from pathlib import Path
from types import ModuleType
from typing import Any, Optional

from kvspec.spec.config import Config
from kvspec.spec.observation import Observation, RequestState
from kvspec.spec.ops import Admit, Finish, Op, Preempt, Step
from kvspec.targets.base import Driver, Target, Traits
from kvspec.targets.snapshot import _InPlaceSnapshots
from kvspec.targets.v1_driver import V1PoolDriver, _Deltas, observe_pool

def label_hash(label: str) -> bytes:
    """The target hash standing for a pool-level hash label."""
    return hashlib.sha256(b"kvspec-label:" + label.encode()).digest()

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
            from kvspec import impl as mod  # type: ignore[no-redef]
        self.mod = mod
        self.name = label
        self.traits = Traits(null_block=True, unhashed_free_first=False, misuse_errors=(mod.KVCacheError,))

    def driver(self, config: Config) -> Driver:
        return ImplCacheDriver(self.mod, config) if config.level == "cache" else ImplPoolDriver(self.mod, config)

    @staticmethod
    def package_dir() -> Path:
        from kvspec import impl
        return Path(impl.__file__).parent
