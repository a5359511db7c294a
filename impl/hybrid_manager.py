"""HybridKVCacheManager: several KV-cache groups (full, sliding window, chunked local)
sharing one BlockPool, with chunked prefill, speculative (draft/lookahead) slots,
extra keys, connector (external) tokens and the ``max_model_len`` block cap.

Each request has one block table per group. A prompt's hit is the length every
group agrees on (``find_agreed_hit``). Blocks that no still-needed query attends to
are freed and replaced by the null block in the table. Only verified tokens' full
blocks are cached: draft tokens get slots but never a hash.

``KVCacheManager`` (one full-attention group, the whole prompt at once) is untouched;
this class is what a scheduler uses for the rest.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

from .block import KVCacheBlock
from .block_pool import BlockPool
from .errors import InvalidCountError, UnknownRequestError
from .extra_keys import ExtraKeys, KeyedRequest, parse_extra
from .hashing import HASH_FUNCTIONS, HashFn
from .kv_cache_groups import KVGroupSpec, cdiv, find_agreed_hit, group_hash, parse_kv_groups
from .kv_cache_manager import Request, check_admissible, check_schedulable

GroupBlocks = tuple[list[KVCacheBlock], ...]


def _count(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidCountError(f"{name} must be a non-negative int, got {value!r}")
    return value


class HybridKVCacheManager:
    def __init__(
        self,
        num_gpu_blocks: int,
        block_size: int,
        kv_groups: Union[str, Sequence[KVGroupSpec]] = "full",
        enable_caching: bool = True,
        hash_fn: Union[str, HashFn] = "sha256",
        max_model_len: Optional[int] = None,
    ) -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise InvalidCountError(f"block_size must be an int >= 1, got {block_size!r}")
        if max_model_len is not None and (not isinstance(max_model_len, int) or max_model_len < 1):
            raise InvalidCountError(f"max_model_len must be an int >= 1, got {max_model_len!r}")
        self.block_size = block_size
        self.groups: list[KVGroupSpec] = parse_kv_groups(kv_groups) if isinstance(kv_groups, str) else list(kv_groups)
        self.enable_caching = enable_caching
        self.hash_fn: HashFn = HASH_FUNCTIONS[hash_fn] if isinstance(hash_fn, str) else hash_fn
        self.max_model_len = max_model_len
        self.block_pool = BlockPool(num_gpu_blocks, enable_caching)
        self.null_block = self.block_pool.null_block
        self.req_to_blocks: dict[str, list[list[KVCacheBlock]]] = {}
        self.num_cached_block: dict[str, list[int]] = {}

    @property
    def max_blocks_per_request(self) -> Optional[int]:
        """The block cap of one request in one group."""
        return None if self.max_model_len is None else cdiv(self.max_model_len, self.block_size)

    def make_request(self, request_id: str, prompt_token_ids: Sequence[int],
                     extra: Union[None, str, ExtraKeys] = None) -> KeyedRequest:
        keys = parse_extra(extra) if extra is None or isinstance(extra, str) else extra
        return KeyedRequest(request_id, prompt_token_ids, self.block_size, self.hash_fn, keys)

    # -- prefix hits ---------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[GroupBlocks, int]:
        """Per-group hit blocks and the hit length (tokens) all groups agree on; at most
        ``num_tokens - 1`` tokens, so the last one is computed for its logits."""
        check_admissible(request, self.req_to_blocks)
        if not self.enable_caching:
            return tuple([] for _ in self.groups), 0
        hashes = request.block_hashes

        def lookup_for(g: int):
            def lookup(i: int) -> Optional[KVCacheBlock]:
                return self.block_pool.get_cached_block(group_hash(hashes[i], g)) if i < len(hashes) else None
            return lookup

        blocks, length = find_agreed_hit(self.groups, [lookup_for(g) for g in range(len(self.groups))],
                                         request.num_tokens - 1, self.block_size, self.null_block)
        return tuple(blocks), length

    # -- allocation ----------------------------------------------------------------
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Optional[Sequence[Sequence[KVCacheBlock]]] = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
    ) -> Optional[GroupBlocks]:
        """Slots for ``num_new_tokens`` tokens to compute (draft tokens included) plus
        ``num_lookahead_tokens``, after ``num_new_computed_tokens`` hit tokens (their
        blocks: ``new_computed_blocks``, one list per group) and
        ``num_external_computed_tokens`` tokens a connector supplies. Returns the new
        blocks per group, or None when memory is short or the tokens would pass
        ``max_model_len`` (then nothing is allocated)."""
        _count("num_new_tokens", num_new_tokens)
        _count("num_new_computed_tokens", num_new_computed_tokens)
        _count("num_lookahead_tokens", num_lookahead_tokens)
        _count("num_external_computed_tokens", num_external_computed_tokens)
        check_schedulable(request, self.req_to_blocks)
        rid = request.request_id
        running = rid in self.req_to_blocks
        hits = [list(b) for b in new_computed_blocks] if new_computed_blocks is not None else [[] for _ in self.groups]
        if len(hits) != len(self.groups):
            raise InvalidCountError(f"new_computed_blocks has {len(hits)} groups; the manager has {len(self.groups)}")
        if running and (any(hits) or num_external_computed_tokens):
            raise InvalidCountError(f"request {rid!r} is running: it takes no new hits or external tokens")
        if num_new_tokens == 0 and num_new_computed_tokens == 0 and num_external_computed_tokens == 0:
            raise InvalidCountError("nothing to allocate: num_new_tokens is 0 and no tokens were computed")

        bs = self.block_size
        local = request.num_computed_tokens + num_new_computed_tokens
        total_computed = local + num_external_computed_tokens
        main = total_computed + num_new_tokens
        need_slots = main + num_lookahead_tokens
        if self.max_model_len is not None and need_slots > self.max_model_len:
            return None  # the scheduler never runs a request, drafts included, past max_model_len
        num_required = cdiv(need_slots, bs)

        if running:
            # Blocks behind every window are no longer read: free them before counting.
            self.remove_skipped_blocks(rid, total_computed)
        need = 0
        for g, spec in enumerate(self.groups):
            if running:
                need += max(num_required - len(self.req_to_blocks[rid][g]), 0)
                continue
            skipped = spec.num_skipped_tokens(total_computed) // bs
            need += max(num_required - max(skipped, len(hits[g])), 0)
            # Reviving a free cached hit takes it out of the free queue too.
            need += sum(1 for b in hits[g][skipped:] if not b.is_null and b.ref_cnt == 0)
        if need > self.block_pool.get_num_free_blocks():
            return None

        if not running:
            self.req_to_blocks[rid] = [[] for _ in self.groups]
            self.num_cached_block[rid] = [0] * len(self.groups)
            # Touch every group's hits before any group pops new blocks, so that no pop
            # can evict another group's hit (vLLM #33775).
            for g, spec in enumerate(self.groups):
                skipped = spec.num_skipped_tokens(total_computed) // bs
                kept = [b for b in hits[g][skipped:] if not b.is_null]
                self.block_pool.touch(kept)
                table = self.req_to_blocks[rid][g]
                table.extend([self.null_block] * skipped)
                table.extend(hits[g][skipped:])
                self.num_cached_block[rid][g] = len(table)
            if num_external_computed_tokens:
                self._allocate_external(rid, total_computed)
        new_blocks = []
        for g in range(len(self.groups)):
            table = self.req_to_blocks[rid][g]
            fresh = self.block_pool.get_new_blocks(max(num_required - len(table), 0))
            table.extend(fresh)
            new_blocks.append(fresh)
        # Cache only computed, verified tokens: draft and lookahead slots lie past them.
        self.cache_blocks(request, min(main, getattr(request, "num_verified_tokens", request.num_tokens)))
        return tuple(new_blocks)

    def _allocate_external(self, rid: str, total_computed: int) -> None:
        """Blocks for connector tokens: inside each group's window they get fresh blocks,
        behind it the null block."""
        bs = self.block_size
        for g, spec in enumerate(self.groups):
            if spec.num_skipped_tokens(total_computed) >= total_computed:
                continue  # no connector token is read in this group: its block comes with the new ones
            table = self.req_to_blocks[rid][g]
            skipped = spec.num_skipped_tokens(total_computed) // bs
            if len(table) < skipped:
                table.extend([self.null_block] * (skipped - len(table)))
            table.extend(self.block_pool.get_new_blocks(max(cdiv(total_computed, bs) - len(table), 0)))

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Cache the full blocks of the first ``num_tokens`` tokens in every group; the
        null block (a slot behind the window) is skipped."""
        if not self.enable_caching:
            return
        rid = request.request_id
        if rid not in self.req_to_blocks:
            raise UnknownRequestError(f"request {rid!r} holds no blocks")
        num_full = min(num_tokens, len(request.block_hashes) * self.block_size) // self.block_size
        for g in range(len(self.groups)):
            table = self.req_to_blocks[rid][g]
            start = self.num_cached_block[rid][g]
            for i in range(start, min(num_full, len(table))):
                block = table[i]
                if not block.is_null:
                    self.block_pool.cache_full_blocks([block], [group_hash(request.block_hashes[i], g)], 0, 1)
            self.num_cached_block[rid][g] = max(start, min(num_full, len(table)))

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free the blocks no query from ``num_computed_tokens`` on attends to, and put
        the null block in their place. The last of them is freed first (it goes to the
        queue first, so it is evicted first)."""
        for g, spec in enumerate(self.groups):
            table = self.req_to_blocks[request_id][g]
            skipped = min(spec.num_skipped_tokens(num_computed_tokens) // self.block_size, len(table))
            freed = []
            for i in range(skipped - 1, -1, -1):
                if table[i].is_null:
                    break  # everything before it was freed earlier
                freed.append(table[i])
                table[i] = self.null_block
            if freed:
                self.block_pool.free_blocks(freed)

    def free(self, request: Request) -> None:
        """Release a request's blocks, group by group, each group's tail first."""
        rid = request.request_id
        if rid not in self.req_to_blocks:
            raise UnknownRequestError(f"request {rid!r} holds no blocks")
        tables = self.req_to_blocks.pop(rid)
        self.num_cached_block.pop(rid, None)
        for table in tables:
            self.block_pool.free_blocks([b for b in reversed(table) if not b.is_null])

    # -- queries -------------------------------------------------------------------
    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        tables = self.req_to_blocks.get(request_id)
        if tables is None:
            return tuple([] for _ in self.groups)
        return tuple([b.block_id for b in t] for t in tables)

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()
