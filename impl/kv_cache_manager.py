"""KVCacheManager: per-request block tables on top of one BlockPool."""
from __future__ import annotations

from typing import Optional, Sequence, Union

from .block import BlockHash, KVCacheBlock
from .block_pool import BlockPool
from .errors import InvalidCountError, RequestStateError, UnknownRequestError
from .hashing import HASH_FUNCTIONS, HashFn, hash_block_tokens


# -- pure helpers (with PEP 316 contracts that CrossHair checks: tests/test_crosshair.py) --
def max_hit_blocks(num_tokens: int, block_size: int) -> int:
    """How many leading full blocks of a ``num_tokens``-token prompt may hit the cache.

    At most ``num_tokens - 1`` tokens: the last token must be computed to produce
    logits, even when the whole prompt is cached (vLLM #11186).

    pre: num_tokens >= 1
    pre: block_size >= 1
    post: 0 <= __return__ * block_size <= num_tokens - 1
    post: (__return__ + 1) * block_size > num_tokens - 1
    """
    return (num_tokens - 1) // block_size


def blocks_fit(num_new_blocks: int, num_revived: int, num_free: int) -> bool:
    """Do ``num_new_blocks`` fresh blocks fit once ``num_revived`` free cached hits are revived?

    Reviving a hit takes it out of the free queue, so both come out of ``num_free``.

    pre: num_new_blocks >= 0 and num_revived >= 0 and num_free >= 0
    post: __return__ == (num_new_blocks + num_revived <= num_free)
    """
    return num_new_blocks + num_revived <= num_free


class Request:
    """A request's tokens and the chained hashes of its full blocks.

    Hashes are extended as tokens arrive, so ``block_hashes`` always covers exactly
    the full blocks of ``all_token_ids``.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        block_size: int,
        hash_fn: HashFn = HASH_FUNCTIONS["sha256"],
        extra_keys: Optional[tuple] = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.block_size = block_size
        self.hash_fn = hash_fn
        self.extra_keys = extra_keys
        self.num_computed_tokens = 0
        self.block_hashes: list[BlockHash] = []
        self._update_hashes()

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def append_output_token_ids(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self._update_hashes()

    def _update_hashes(self) -> None:
        tokens = self.all_token_ids
        bs = self.block_size
        while (len(self.block_hashes) + 1) * bs <= len(tokens):
            i = len(self.block_hashes)
            parent = self.block_hashes[-1] if self.block_hashes else None
            self.block_hashes.append(hash_block_tokens(self.hash_fn, parent, tokens[i * bs:(i + 1) * bs], self.extra_keys))


def check_admissible(request: "Request", held: dict) -> None:
    """Reject an admission the scheduler must never make, before any state is touched:
    an empty prompt (no token to compute, nothing to hash), or a request that already
    holds blocks (running: looking it up again would hold its hits twice)."""
    if request.num_tokens == 0:
        raise RequestStateError(f"request {request.request_id!r} has an empty prompt")
    if request.request_id in held:
        raise RequestStateError(f"request {request.request_id!r} is running: only a waiting request is admitted")


def check_schedulable(request: "Request", held: dict) -> None:
    """Reject scheduling a finished request: it holds no blocks, yet tokens of it were
    computed (a waiting or preempted request has none: the scheduler resets them)."""
    if request.request_id not in held and request.num_computed_tokens > 0:
        raise UnknownRequestError(f"request {request.request_id!r} holds no blocks but has "
                                  f"{request.num_computed_tokens} computed tokens: it was finished")


class KVCacheManager:
    """The interface a scheduler uses: prefix lookup, slot allocation, free."""

    # Its pool's declared policies (``free`` hands a request's blocks over tail first,
    # which is what "lru_tail_first" says), and the errors of its own misuses.
    kvspec_traits = {**BlockPool.kvspec_traits,
                     "misuse_errors": {**BlockPool.kvspec_traits["misuse_errors"],
                                       "unknown_request": UnknownRequestError, "not_running": UnknownRequestError,
                                       "not_waiting": RequestStateError, "empty_prompt": RequestStateError,
                                       "duplicate_request": RequestStateError}}

    def __init__(
        self,
        num_gpu_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        hash_fn: Union[str, HashFn] = "sha256",
    ) -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise InvalidCountError(f"block_size must be an int >= 1, got {block_size!r}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hash_fn: HashFn = HASH_FUNCTIONS[hash_fn] if isinstance(hash_fn, str) else hash_fn
        self.block_pool = BlockPool(num_gpu_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are already in the index.
        self.num_cached_block: dict[str, int] = {}

    def make_request(self, request_id: str, prompt_token_ids: Sequence[int]) -> Request:
        return Request(request_id, prompt_token_ids, self.block_size, self.hash_fn)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of ``request``, as (blocks, number of tokens).

        At most ``num_tokens - 1`` tokens can hit: the last token must be computed to
        produce logits, even when the whole prompt is cached. The walk stops at the
        first miss, because a hit must be contiguous from block 0.
        """
        check_admissible(request, self.req_to_blocks)
        if not self.enable_caching:
            return [], 0
        max_blocks = max_hit_blocks(request.num_tokens, self.block_size)
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Optional[Sequence[KVCacheBlock]] = None,
    ) -> Optional[list[KVCacheBlock]]:
        """Make room for ``num_new_tokens`` more tokens; None when memory is short.

        Hits are touched only after the capacity check (a refused request must not
        keep them: vLLM #11565) and before new blocks are popped (so the pop cannot
        evict them: vLLM #10507). Newly full blocks are cached; a partial one never.
        """
        if num_new_tokens < 0 or num_new_computed_tokens < 0:
            raise InvalidCountError("token counts must be non-negative")
        check_schedulable(request, self.req_to_blocks)
        computed = list(new_computed_blocks or [])
        rid = request.request_id
        table = self.req_to_blocks.get(rid, [])
        total = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_required = -(-total // self.block_size)
        num_new_blocks = max(0, num_required - len(table) - len(computed))
        num_revived = sum(1 for b in computed if b.ref_cnt == 0)
        if not blocks_fit(num_new_blocks, num_revived, self.block_pool.get_num_free_blocks()):
            return None

        if rid not in self.req_to_blocks:
            self.req_to_blocks[rid] = table
            self.num_cached_block[rid] = 0
        if computed:
            self.block_pool.touch(computed)
            table.extend(computed)
            self.num_cached_block[rid] = len(table)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        table.extend(new_blocks)

        if self.enable_caching:
            num_full = min(total, request.num_tokens) // self.block_size
            self.block_pool.cache_full_blocks(table, request.block_hashes, self.num_cached_block[rid], num_full)
            self.num_cached_block[rid] = max(num_full, self.num_cached_block[rid])
        return new_blocks

    def free(self, request: Request) -> None:
        """Release a finished or preempted request's blocks.

        Tail blocks are freed first so they are evicted first: the shared prefix
        blocks stay cached the longest.
        """
        rid = request.request_id
        if rid not in self.req_to_blocks:
            raise UnknownRequestError(f"request {rid!r} holds no blocks")
        blocks = self.req_to_blocks.pop(rid)
        self.num_cached_block.pop(rid, None)
        self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()
