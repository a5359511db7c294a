"""Adapter for kvspec's own allocator (``kvspec.impl``), at both levels."""
from __future__ import annotations

import hashlib
from pathlib import Path
from types import ModuleType
from typing import Any, Optional

from kvspec.spec.config import Config
from kvspec.spec.observation import Observation
from kvspec.targets.base import Driver, Target, Traits
from kvspec.targets.policies import with_policies
from kvspec.targets.impl_cache import ImplCacheDriver  # noqa: F401  (re-exported)
from kvspec.targets.snapshot import _InPlaceSnapshots
from kvspec.targets.v1_driver import V1PoolDriver, _Deltas, observe_pool

_LABEL_HASHES: dict = {}


def label_hash(label: str) -> bytes:
    """The target hash standing for a pool-level hash label (remembered: the model
    checker asks for the same few labels on every Cache and Lookup)."""
    h = _LABEL_HASHES.get(label)
    if h is None:
        h = hashlib.sha256(b"kvspec-label:" + label.encode()).digest()
        if len(_LABEL_HASHES) < 4096:
            _LABEL_HASHES[label] = h
    return h

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

class ImplTarget(Target):
    def __init__(self, mod: Optional[ModuleType] = None, label: str = "impl") -> None:
        if mod is None:
            from kvspec import impl as mod  # type: ignore[no-redef]
        self.mod = mod
        self.name = label
        # impl draws its root hash at random per process (so tenants cannot precompute
        # each other's hashes); under kvspec it is fixed, so the same seed prints the same
        # hash values in every process (reproducible messages and repros).
        if callable(getattr(mod, "init_none_hash", None)):
            mod.init_none_hash(seed=0)
        base = Traits(null_block=True, unhashed_free_first=False, misuse_errors=(mod.KVCacheError,),
                      cache_features=hasattr(mod, "HybridKVCacheManager"))
        # impl declares its policies in code, beside the allocator, so a patch that changes
        # a policy (kvspec/corpus/impl/policy_*.diff) changes its declaration with it.
        decl = getattr(getattr(mod, "KVCacheManager", None), "kvspec_traits", None)
        self.traits = base if decl is None else with_policies(base, decl, f"{label}: KVCacheManager.kvspec_traits",
                                                              mod.__name__)

    def driver(self, config: Config) -> Driver:
        return ImplCacheDriver(self.mod, config) if config.level == "cache" else ImplPoolDriver(self.mod, config)

    @staticmethod
    def package_dir() -> Path:
        from kvspec import impl
        return Path(impl.__file__).parent
