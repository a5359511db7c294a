"""Adapter for the installed vLLM's v1 allocator: ``vllm.v1.core.block_pool.BlockPool``
(pool level) and ``vllm.v1.core.kv_cache_manager.KVCacheManager`` with one
full-attention KV-cache group (cache level), driven with upstream's own hashing
(sha256, vLLM's default, after ``init_none_hash``) and real ``vllm.v1.request.Request``
objects. CPU only. The heavy import (torch) happens once, in ``VllmTarget()``.

What vLLM documents, and so the reference model follows:
- freed blocks without a hash go to the front of the free queue, in order; cached
  ones to the LRU tail (``BlockPool.free_blocks``);
- no misuse defence at all: misuse findings are robustness findings;
- deliberate no-ops: touch/free skip the null block, ``free_blocks`` hands a block
  of another pool to that pool, and freeing a request that holds no blocks is
  allowed ("in case a request is freed (aborted) before alloc").
"""
from __future__ import annotations

import logging
from types import ModuleType
from typing import Any, Optional

from kvspec.spec.config import Config
from kvspec.spec.observation import Observation, RequestState
from kvspec.spec.ops import Admit, Finish, Op, Preempt, Step
from kvspec.targets.base import Driver, Target, Traits
from kvspec.targets.v1_driver import V1PoolDriver, observe_pool
from kvspec.targets.vllm_patch import import_vllm

MAX_MODEL_LEN = 1 << 20  # no kvspec sequence comes near it: the cap never bites
GROUP = 0                # the one KV-cache group


class Upstream:
    """One (possibly patched) family of vLLM modules and what the drivers need from it."""

    def __init__(self, mods: dict[str, ModuleType]) -> None:
        self.utils = mods["vllm.v1.core.kv_cache_utils"]
        self.block_pool = mods["vllm.v1.core.block_pool"]
        self.manager = mods["vllm.v1.core.kv_cache_manager"]
        self.request = mods["vllm.v1.request"]
        self.interface = mods["vllm.v1.kv_cache_interface"]
        self.sampling = mods["vllm.sampling_params"].SamplingParams(max_tokens=MAX_MODEL_LEN)
        self.hash_fn = mods["vllm.utils.hashing"].get_hash_fn_by_name("sha256")
        # NONE_HASH is a module global of this family's kv_cache_utils; sha256 gives a
        # fixed seed, so hashes (and pool-level labels) are stable across processes.
        self.utils.init_none_hash(self.hash_fn)
        self._labels: dict[tuple[str, int], bytes] = {}

    def label_hash(self, label: str, block_size: int) -> bytes:
        """The real upstream hash standing for a pool-level label: the first-block hash
        of a block whose tokens are the label's code points, repeated to fill it. The
        label also goes in as an extra key, because the truncated tokens alone collide
        ("c1" and "c12" at two tokens per block)."""
        key = (label, block_size)
        if key not in self._labels:
            self._labels[key] = self.utils.hash_block_tokens(self.hash_fn, None, label_tokens(label, block_size),
                                                             (label,))
        return self._labels[key]

    def new_request(self, rid: str, tokens, block_hasher=None) -> Any:
        return self.request.Request(rid, list(tokens), self.sampling, None, block_hasher=block_hasher)


def label_tokens(label: str, block_size: int) -> list[int]:
    """A full block of tokens for a pool-level label (its code points, repeated)."""
    return (list(label.encode()) * block_size)[:block_size]


class VllmPoolDriver(V1PoolDriver):
    def __init__(self, up: Upstream, config: Config) -> None:
        self.up = up
        self.bs = config.block_size
        self.caching = config.caching
        self.pool = up.block_pool.BlockPool(config.num_blocks, enable_caching=config.caching,
                                            hash_block_size=config.block_size)

    def _cache(self, ids, labels) -> None:
        if not self.caching:
            return  # vLLM's callers never cache with prefix caching off (no-prefix-cache coordinator)
        hashes = [self.up.label_hash(h, self.bs) for h in labels]
        req = self.up.new_request("kvspec-pool", [t for h in labels for t in label_tokens(h, self.bs)])
        req.block_hashes = hashes  # the labels' hashes, not the prompt's chained ones: that is the mapping
        self.pool.cache_full_blocks(req, self._blocks(ids), 0, len(ids), self.bs, GROUP)

    def _lookup(self, label: str) -> Any:
        hit = self.pool.get_cached_block(self.up.label_hash(label, self.bs), [GROUP])
        return None if hit is None else hit[0].block_id

    def _foreign_block(self) -> Any:
        other = self.up.block_pool.BlockPool(len(self.pool.blocks), enable_caching=self.caching,
                                             hash_block_size=self.bs)
        return other.get_new_blocks(1)[0]

    def observe(self) -> Observation:
        return observe_pool(self.pool)


class VllmCacheDriver(Driver):
    """Plays vLLM's scheduler, as ImplCacheDriver does: prefill = get_computed_blocks +
    allocate_slots for the whole prompt; decode = append one token + allocate_slots;
    preempt = free + recompute from scratch; finish = free."""

    def __init__(self, up: Upstream, config: Config) -> None:
        import torch  # already imported by vLLM; only the spec's dtype needs it

        self.up = up
        bs = config.block_size
        iface = up.interface
        spec = iface.FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=1, dtype=torch.float32)
        kv_config = iface.KVCacheConfig(num_blocks=config.num_blocks, kv_cache_tensors=[],
                                        kv_cache_groups=[iface.KVCacheGroupSpec(["layers.0.attn"], spec)])
        self.mgr = up.manager.KVCacheManager(kv_config, max_model_len=MAX_MODEL_LEN, scheduler_block_size=bs,
                                             hash_block_size=bs, enable_caching=config.caching)
        self.hasher = up.utils.get_request_block_hasher(bs, up.hash_fn)
        self.status = up.request.RequestStatus
        self.reqs: dict[str, Any] = {}
        self.running: set[str] = set()

    def apply(self, op: Op) -> Any:
        m = self.mgr
        if isinstance(op, Admit):
            req = self.reqs.get(op.req) if op.prompt is None else self.up.new_request(op.req, op.prompt, self.hasher)
            if req is None:
                raise KeyError(f"no waiting request {op.req}")
            self.reqs[op.req] = req
            hits, num_hit, _ = m.get_computed_blocks(req)
            if m.allocate_slots(req, req.num_tokens - num_hit, num_hit, hits) is None:
                return None
            req.num_computed_tokens = req.num_tokens
            req.status = self.status.RUNNING
            self.running.add(op.req)
            return num_hit
        if isinstance(op, Step):
            req = self.reqs[op.req]
            req.append_output_token_ids(op.token)  # also hashes any block it fills
            if m.allocate_slots(req, req.num_tokens - req.num_computed_tokens) is None:
                return False
            req.num_computed_tokens = req.num_tokens
            return True
        if isinstance(op, (Preempt, Finish)):
            # The scheduler frees a request however it ends, running or waiting; free()
            # of one that holds nothing is a documented no-op.
            req = self.reqs.get(op.req) or self.up.new_request(op.req, [0])
            m.free(req)
            self.running.discard(op.req)
            req.num_computed_tokens = 0
            if isinstance(op, Preempt):
                req.status = self.status.PREEMPTED
                req.num_preemptions += 1
            else:
                self.reqs.pop(op.req, None)
            return None
        raise TypeError(f"{op!r} is not a cache-level op")

    def observe(self) -> Observation:
        # req_to_blocks is a defaultdict: .get, so that reading never adds an entry.
        req_to_blocks = self.mgr.coordinator.single_type_managers[GROUP].req_to_blocks
        reqs = {rid: RequestState(tuple(b.block_id for b in req_to_blocks.get(rid, ())),
                                  self.reqs[rid].num_computed_tokens)
                for rid in sorted(self.running)}
        return observe_pool(self.mgr.block_pool, reqs)


class VllmTarget(Target):
    def __init__(self, patch_text: Optional[str] = None, patch_name: Optional[str] = None) -> None:
        self.up = Upstream(import_vllm(patch_text))
        # reset_prefix_cache logs a warning on every refusal (a normal outcome here);
        # vLLM's own logger would flood the terminal and the JSON's stderr.
        logging.getLogger("vllm").setLevel(logging.ERROR)
        self.name = "vllm" if not patch_name else f"vllm+{patch_name}"
        self.traits = Traits(null_block=True, unhashed_free_first=True, misuse_errors=(),
                             documented_noops=frozenset({"null_block", "foreign_free", "free_unknown_request"}))

    def driver(self, config: Config) -> Driver:
        return VllmCacheDriver(self.up, config) if config.level == "cache" else VllmPoolDriver(self.up, config)

    def describe(self) -> str:
        import vllm

        return f"vllm {getattr(vllm, '__version__', '?')}" + (f" ({self.name})" if self.name != "vllm" else "")
