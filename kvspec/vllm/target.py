"""Adapter for the installed vLLM's v1 allocator: ``vllm.v1.core.block_pool.BlockPool``
(pool level) and ``vllm.v1.core.kv_cache_manager.KVCacheManager`` with one
full-attention KV-cache group (cache level), driven with upstream's own hashing
(sha256, vLLM's default, after ``init_none_hash``) and real ``vllm.v1.request.Request``
objects. CPU only. The heavy import (torch) happens once, in ``VllmTarget()``.
Every release from 0.8.0 on drives: what differs between releases is detected by
feature in ``kvspec.vllm.compat`` (tools/vllm_releases.py runs them all).

What vLLM documents, and so the reference model follows:
- freed blocks without a hash go to the front of the free queue, in order; cached
  ones to the LRU tail (``BlockPool.free_blocks``);
- one misuse defence: ``BlockPool.get_new_blocks`` asked for more blocks than are free
  raises ``ValueError`` ("Cannot get N free blocks from the pool", before it pops any;
  vllm/v1/core/block_pool.py, every release from 0.8.0 to 0.33.0); every other misuse is
  undefended, and its findings are robustness findings;
- deliberate no-ops: touch/free skip the null block, ``free_blocks`` hands a block
  of another pool to that pool, and freeing a request that holds no blocks is
  allowed ("in case a request is freed (aborted) before alloc").
"""
from __future__ import annotations

import logging
import os
from typing import Any, Optional

from kvspec.errors import UsageError
from kvspec.spec.config import Config
from kvspec.spec.observation import Observation, RequestState
from kvspec.spec.ops import Admit, Finish, Op, Preempt, Step, Touch
from kvspec.vllm import compat as compat
from kvspec.targets.base import Driver, Target, Traits
from kvspec.targets.policies import with_policies
from kvspec.targets.v1_driver import V1PoolDriver, observe_pool
from kvspec.vllm.compat import GROUP, MAX_MODEL_LEN  # noqa: F401  (re-exported)
from kvspec.vllm.groups import end_request
from kvspec.vllm.patch import import_vllm


class Upstream(compat.Api):
    """One (possibly patched) family of vLLM modules and what the drivers need from it."""

    def __init__(self, mods) -> None:
        super().__init__(mods)
        self._labels: dict[tuple[str, int], Any] = {}
        self._label_blocks: dict[tuple[str, int], tuple[int, ...]] = {}

    def label_hash(self, label: str, block_size: int) -> Any:
        """The real upstream hash standing for a pool-level label: the first-block hash
        of a block whose tokens are the label's code points, repeated to fill it. The
        label also goes in as an extra key, because the truncated tokens alone collide
        ("c1" and "c12" at two tokens per block)."""
        key = (label, block_size)
        h = self._labels.get(key)
        if h is None:
            h = self._labels[key] = self.hash_block_tokens(None, self.label_block(label, block_size), (label,))
        return h

    def label_block(self, label: str, block_size: int) -> tuple[int, ...]:
        """``label_tokens``, remembered: every Cache of a label asks for it again."""
        key = (label, block_size)
        t = self._label_blocks.get(key)
        if t is None:
            t = self._label_blocks[key] = tuple(label_tokens(label, block_size))
        return t


def label_tokens(label: str, block_size: int) -> list[int]:
    """A full block of tokens for a pool-level label (its code points, repeated)."""
    return (list(label.encode()) * block_size)[:block_size]


class VllmPoolDriver(V1PoolDriver):
    def __init__(self, up: Upstream, config: Config) -> None:
        self.up = up
        self.bs = config.block_size
        self.caching = config.caching
        self.pool = compat.new_pool(up.block_pool.BlockPool, config.num_blocks, config.caching, config.block_size)
        self._cache_call: Optional[Any] = None

    def apply(self, op: Op) -> Any:
        if isinstance(op, Touch):  # one list, or one list per KV-cache group, by release
            return compat.touch(self.pool, self._blocks(op.blocks))
        return super().apply(op)

    def _cache(self, ids, labels) -> None:
        if not self.caching:
            return  # vLLM's callers never cache with prefix caching off (no-prefix-cache coordinator)
        if self._cache_call is None:
            self._cache_call = compat.cache_full_blocks_call(self.up, self.pool, self.bs)
        up, bs = self.up, self.bs
        hashes = [up.label_hash(h, bs) for h in labels]
        req = up.new_request("kvspec-pool", [t for h in labels for t in up.label_block(h, bs)])
        # the labels' hashes, not the prompt's chained ones: that is the mapping
        self._cache_call(req, self._blocks(ids), hashes)

    def _lookup(self, label: str) -> Any:
        return compat.lookup(self.pool, self.up.label_hash(label, self.bs))

    def _foreign_block(self) -> Any:
        other = compat.new_pool(type(self.pool), len(self.pool.blocks), self.caching, self.bs)
        return other.get_new_blocks(1)[0]

    def observe(self) -> Observation:
        return observe_pool(self.pool)


class VllmCacheDriver(Driver):
    """Plays vLLM's scheduler, as ImplCacheDriver does: prefill = get_computed_blocks +
    allocate_slots for the whole prompt; decode = append one token + allocate_slots;
    preempt = free + recompute from scratch; finish = free."""

    def __init__(self, up: Upstream, config: Config) -> None:
        self.up = up
        self.bs = bs = config.block_size
        self.mgr = compat.new_manager(up, up.manager.KVCacheManager, config.num_blocks, bs, config.caching)
        self.hasher = up.request_hasher(bs)
        self.status = up.request.RequestStatus
        self.reqs: dict[str, Any] = {}
        self.running: set[str] = set()
        self.finished: dict[str, Any] = {}   # a Step of one reaches the manager (a scheduler misuse)

    def apply(self, op: Op) -> Any:
        m = self.mgr
        if isinstance(op, Admit):
            req = self.reqs.get(op.req) if op.prompt is None else self.up.new_request(op.req, op.prompt, self.hasher)
            if req is None:
                raise KeyError(f"no waiting request {op.req}")
            hits, num_hit = compat.computed_blocks(m, req, self.bs)
            self.reqs[op.req] = req   # only now: a rejected admission must leave the driver as it was
            if compat.allocate(m, req, req.num_tokens - num_hit, num_hit, hits) is None:
                return None
            req.num_computed_tokens = req.num_tokens
            req.status = self.status.RUNNING
            self.running.add(op.req)
            return num_hit
        if isinstance(op, Step):
            if op.req in self.finished and op.req not in self.running:
                return compat.allocate(m, self.finished[op.req], 1)   # the manager must refuse it
            req = self.reqs[op.req]
            req.append_output_token_ids(op.token)  # also hashes any block it fills
            if compat.allocate(m, req, req.num_tokens - req.num_computed_tokens) is None:
                return False
            req.num_computed_tokens = req.num_tokens
            return True
        if isinstance(op, (Preempt, Finish)):
            end_request(self, m, op)
            return None
        raise TypeError(f"{op!r} is not a cache-level op")

    def observe(self) -> Observation:
        # req_to_blocks is a defaultdict: .get, so that reading never adds an entry.
        req_to_blocks = compat.req_to_blocks(self.mgr)
        reqs = {rid: RequestState(tuple(b.block_id for b in req_to_blocks.get(rid, ())),
                                  self.reqs[rid].num_computed_tokens)
                for rid in sorted(self.running)}
        return observe_pool(self.mgr.block_pool, reqs)


POLICIES_ENV = "KVSPEC_VLLM_POLICIES"


def declared_policies(traits: Traits) -> Traits:
    """``traits`` with the policies declared in ``$KVSPEC_VLLM_POLICIES`` applied
    (``key=value;key=value``, values in TOML, keys as in ``[tool.kvspec]``). It states
    an older release's policy of its time, e.g. ``unhashed_free_first=false`` before
    vLLM adopted it (tools/vllm_releases.py); never read off the code under test."""
    text = os.environ.get(POLICIES_ENV, "").strip()
    if not text:
        return traits
    import tomllib

    try:
        decl = tomllib.loads("\n".join(part.strip() for part in text.split(";") if part.strip()))
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"{POLICIES_ENV}: not key=value pairs with TOML values: {e}") from None
    return with_policies(traits, decl, POLICIES_ENV)


class VllmTarget(Target):
    def __init__(self, patch_text: Optional[str] = None, patch_name: Optional[str] = None) -> None:
        self.up = Upstream(import_vllm(patch_text))
        self.patch_text = patch_text  # the engine level loads the scheduler under the same diff
        # reset_prefix_cache logs a warning on every refusal (a normal outcome here);
        # vLLM's own logger would flood the terminal and the JSON's stderr.
        logging.getLogger("vllm").setLevel(logging.ERROR)
        self.name = "vllm" if not patch_name else f"vllm+{patch_name}"
        # Releases before 0.8.5 have no null block: detected on a probe pool.
        null = getattr(compat.new_pool(self.up.block_pool.BlockPool, 4, True, 2), "null_block", None) is not None
        noops = {"foreign_free", "free_unknown_request"} | ({"null_block"} if null else set())
        # The groups driver (KV-cache groups, chunked prefill, drafts, extra keys, connector
        # tokens, max_model_len; kvspec.vllm.groups) drives every release whose manager
        # is built from a KVCacheConfig and takes the hit as num_new_computed_tokens (0.9.0 on),
        # drawing only what the release has (compat.cache_api, by feature). 0.8.x gets the
        # one-group driver, which builds every call by feature.
        self.cache_api = compat.cache_api(self.up)
        self.groups = self.cache_api is not None
        missing = self.cache_api.missing if self.cache_api is not None else frozenset()
        # The one documented misuse defence (see the module doc): only this kind is held to
        # ATOMIC_REJECT with ValueError; the other kinds stay robustness findings.
        self.traits = declared_policies(Traits(null_block=null, unhashed_free_first=True,
                                               misuse_error_map=(("over_alloc", ValueError),),
                                               documented_noops=frozenset(noops), cache_features=self.groups,
                                               cache_missing=missing,
                                               cache_kinds=self._opt_in() if self.groups else frozenset()))

    def _opt_in(self) -> frozenset:
        """The opt-in cache features this release has (``stateful.cache.OPT_IN_KINDS``): its
        group kinds, and ``eagle`` where its KVCacheManager takes ``use_eagle``."""
        return self.cache_api.kinds | ({"eagle"} if self.cache_api.eagle else frozenset())

    def driver(self, config: Config) -> Driver:
        if config.level != "cache":
            return VllmPoolDriver(self.up, config)
        if self.groups:
            from kvspec.vllm.groups import VllmGroupsCacheDriver
            return VllmGroupsCacheDriver(self.up, config, self.cache_api)
        return VllmCacheDriver(self.up, config)

    def describe(self) -> str:
        import vllm

        return f"vllm {getattr(vllm, '__version__', '?')}" + (f" ({self.name})" if self.name != "vllm" else "")
