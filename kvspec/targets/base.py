"""The adapter interface: how kvspec drives one allocator and reads it back.

A ``Target`` knows how to build a fresh allocator for a ``Config`` and level and
returns a ``Driver`` for it. The driver translates kvspec's operation vocabulary
(``kvspec.ops``) into the allocator's API and its internals into one
``Observation``. Everything above this layer is target-independent.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from ..config import Config
from ..observation import Observation
from ..ops import Alloc, Cache, CachePartial, Free, FreeForeign, Lookup, Op, Reset, Touch


class TargetError(Exception):
    """A target that cannot be loaded or driven: a usage error (exit code 2)."""


@dataclass(frozen=True)
class Traits:
    """What a target documents about itself; the reference model follows it."""

    null_block: bool = True
    # Freed blocks without a hash go to the queue front (vLLM >= 0.11), else all
    # freed blocks go to the tail.
    unhashed_free_first: bool = False
    # The exceptions the target documents for misuse. Empty: no documented defence,
    # so misuse findings are robustness findings, not violations.
    misuse_errors: tuple[type[BaseException], ...] = ()
    levels: tuple[str, ...] = ("pool", "cache")
    # Misuses the target documents as deliberate no-ops; the models treat them as
    # valid operations that change nothing. "null_block": touch/free skip the null
    # block. "foreign_free": a block of another pool is freed in its own pool.
    # "free_unknown_request": freeing a request that holds no blocks.
    documented_noops: frozenset[str] = frozenset()
    # Cache-level policies of nano-vllm-style managers (the defaults are vLLM's):
    # admission needs free blocks for the whole request, its cached prefix included
    # (nano-vllm's boolean can_allocate counts seq.num_blocks).
    admit_all_blocks: bool = False
    # A block leaves the prefix cache when its last holder frees it, instead of
    # staying cached (and hittable) in the free queue until allocation pops it.
    free_evicts: bool = False
    # The index keeps one block per hash: caching a block replaces any other block
    # with that content, which stays hashed while held but is never hit again
    # (nano-vllm's ``hash_to_block_id`` dict).
    index_latest_wins: bool = False
    # Smallest block size the target supports (nano-vllm detects a block boundary
    # with ``len(seq) % block_size == 1``, which never fires for block size 1).
    min_block_size: int = 1


class Driver(ABC):
    """One live allocator instance."""

    @abstractmethod
    def apply(self, op: Op) -> Any:
        """Run ``op``. Returns: Alloc -> tuple of block ids; Lookup -> block id or
        None; Reset -> bool; Admit -> hit tokens or None when refused; Step -> bool
        (False when refused); others -> None. Target exceptions propagate."""

    @abstractmethod
    def observe(self) -> Observation:
        """The normalized state, read from the allocator's internals."""


class V1PoolDriver(Driver):
    """Pool-level driver for a vLLM-v1-shaped ``BlockPool`` (``self.pool``, with
    ``blocks``, ``get_new_blocks``, ``free_blocks``, ``touch``, ``reset_prefix_cache``).
    The pools differ only in how a label becomes a cached hash and how a lookup is
    asked, so subclasses supply those three calls."""

    pool: Any

    def _blocks(self, ids):
        return [self.pool.blocks[i] for i in ids]

    @abstractmethod
    def _cache(self, ids: tuple[int, ...], labels: tuple[str, ...]) -> Any:
        """cache_full_blocks on the blocks ``ids`` under the hashes of ``labels``."""

    @abstractmethod
    def _lookup(self, label: str) -> Any:
        """The block id get_cached_block returns for ``label``'s hash, or None."""

    @abstractmethod
    def _foreign_block(self) -> Any:
        """One block handed out by another, fresh pool of the same kind."""

    def apply(self, op: Op) -> Any:
        p = self.pool
        if isinstance(op, Alloc):
            return tuple(b.block_id for b in p.get_new_blocks(op.n))
        if isinstance(op, Free):
            return p.free_blocks(self._blocks(op.blocks))
        if isinstance(op, Touch):
            return p.touch(self._blocks(op.blocks))
        if isinstance(op, (Cache, CachePartial)):
            return self._cache(op.blocks, op.hashes)
        if isinstance(op, FreeForeign):
            return p.free_blocks([self._foreign_block()])
        if isinstance(op, Lookup):
            return self._lookup(op.hash)
        if isinstance(op, Reset):
            return p.reset_prefix_cache()
        raise TypeError(f"{op!r} is not a pool-level op")


class Target(ABC):
    name: str = "?"
    traits: Traits = Traits()

    @abstractmethod
    def driver(self, config: Config) -> Driver:
        """A fresh allocator for ``config`` (``config.level`` picks the API level)."""

    def describe(self) -> str:
        return self.name
