"""The adapter interface: how kvspec drives one allocator and reads it back.

A ``Target`` knows how to build a fresh allocator for a ``Config`` and level and
returns a ``Driver`` for it. The driver translates kvspec's operation vocabulary
(``kvspec.spec.ops``) into the allocator's API and its internals into one
``Observation``. Everything above this layer is target-independent.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from kvspec.spec.config import Config
from kvspec.spec.observation import Observation
from kvspec.spec.ops import Op


from kvspec.errors import TargetError  # noqa: F401  (re-exported)


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
    # The target drives KV-cache groups (--kv-groups), chunked prefill, draft tokens,
    # extra keys, connector tokens and max_model_len at the cache level: the machines
    # then generate those operations and the group-aware model is used.
    cache_features: bool = False
    # Of those features, the ones this target lacks (an older vLLM release, found by
    # feature): "groups" (several groups in one manager), "swa", "chunked", "external",
    # "drafts", "lora", "salt", "mm". The cache machine draws none of them.
    cache_missing: frozenset[str] = frozenset()
    # KV-cache group kinds beyond full, swa and chunked that the target builds (vLLM's
    # "compressed", DeepSeek-V4's compressed MLA spec, where the release has it): such a
    # kind is drawn or accepted by --kv-groups only where declared (stateful.cache.OPT_IN_KINDS);
    # "eagle" there: the target takes Config.use_eagle (vLLM: KVCacheManager(use_eagle=...)).
    cache_kinds: frozenset[str] = frozenset()
    # Smallest block size the target supports (nano-vllm detects a block boundary
    # with ``len(seq) % block_size == 1``, which never fires for block size 1).
    min_block_size: int = 1
    # -- declared policies (kvspec.targets.policies validates declarations) -------------
    # The prefix-caching modes the target supports: "on", "off" or "both" (the machines
    # draw one per example; ``kvspec mc --caching``).
    prefix_caching: str = "both"
    # Free-queue order: "lru_tail_first" (vLLM: freed blocks to the back, a request's
    # tail first), "mru" (a free call's blocks to the front, in its order), "fifo" (to
    # the back, a request's head first), "sorted" (the queue kept in block-id order).
    # ``unhashed_free_first`` refines the first two; with caching off every block is
    # unhashed, so vLLM's traits give vLLM's caching-off policy (front, tail first).
    free_order: str = "lru_tail_first"
    # A prefix hit may cover the whole prompt (nano-vllm-voxcpm runs a fully cached
    # prompt as a decode step): MAX_HIT then allows it, and KV_INTEGRITY checks that the
    # last token's KV is read correctly.
    whole_prompt_hits: bool = False
    # The null block's id, where ``null_block`` is true.
    null_block_id: int = 0
    # Misuse kind (kvspec.spec.misuse.MISUSE_KINDS, or "*") -> the documented error
    # class; ``misuse_errors`` is then their union unless given.
    misuse_error_map: tuple[tuple[str, type[BaseException]], ...] = ()
    # Op names (kvspec.spec.ops) the target has no API for, e.g. Touch, Lookup and Reset
    # on an allocator without ref counts or a prefix cache (sglang's, LMCache's): the
    # machines and the model checker never run them against it.
    unsupported_ops: frozenset[str] = frozenset()
    # -- policy vocabulary of issue 20 -----------------------------------------------------
    # The index keeps one block per hash and the FIRST block cached with a content keeps
    # the entry: a later block with the same content carries its hash but is never hit
    # (``if h not in hash_to_block_id: ...``). Exclusive with ``index_latest_wins``.
    index_first_wins: bool = False
    # The last, partly filled block of a request is hashed and cached too (partial-block
    # hashing, shared by copy-on-write): a hashed partial block, a held partial block
    # whose hash changes as it fills, and a hit that ends inside a block are allowed (I3,
    # MAX_HIT, I4 relaxed); every token a hit covers is still checked by KV_INTEGRITY.
    partial_block_caching: bool = False
    # The admission check (or a lookup) moves a hit block that is free to the MRU end (the
    # back) of the free queue, as an LRU cache refreshes what it reads: EVICTION_ORDER
    # follows it, also when the admission is then refused.
    lru_refresh_on_lookup: bool = False
    # -- where the policies came from (kvspec.targets.policies) ----------------------------
    # Which declaration was used, in words, shown in every output ("[tool.kvspec] in
    # /path/pyproject.toml", "none: vLLM's defaults", ...); "" for kvspec's own targets.
    declaration: str = ""
    # The declarable policy keys (kvspec.targets.policies.KEYS) the target left
    # undeclared: only these are open to policy hints (kvspec.check.hints). A key the user
    # declared is never second-guessed; kvspec's own targets leave none open.
    hintable: frozenset[str] = frozenset()
    # Policies kvspec read from the target's own code where nothing was declared
    # (kvspec.targets.nano_reading): (key, value, why) triples. A read key is closed to
    # hints; a finding its other value would accept says why it is a bug (kvspec.check.hints).
    read: tuple[tuple[str, Any, str], ...] = ()
    # Policies assumed on a policy hint's word, never declared by the user: (key, value)
    # pairs a continued search (kvspec.check.hints) and its repros run under.
    assumed: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        from kvspec.targets.policies import CACHING_MODES, FREE_ORDERS
        if self.free_order not in FREE_ORDERS:
            raise ValueError(f"free_order {self.free_order!r} is not one of {', '.join(FREE_ORDERS)}")
        if self.prefix_caching not in CACHING_MODES:
            raise ValueError(f"prefix_caching {self.prefix_caching!r} is not one of {', '.join(CACHING_MODES)}")
        if self.index_first_wins and self.index_latest_wins:
            raise ValueError("an index cannot keep both the first and the latest block per hash")
        if self.misuse_error_map and not self.misuse_errors:
            object.__setattr__(self, "misuse_errors", tuple(dict.fromkeys(c for _, c in self.misuse_error_map)))

    @property
    def caching_modes(self) -> tuple[bool, ...]:
        """The ``Config.caching`` values the target is checked under."""
        return {"on": (True,), "off": (False,), "both": (True, False)}[self.prefix_caching]


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


class Target(ABC):
    name: str = "?"
    traits: Traits = Traits()

    @abstractmethod
    def driver(self, config: Config) -> Driver:
        """A fresh allocator for ``config`` (``config.level`` picks the API level)."""

    def describe(self) -> str:
        return self.name
