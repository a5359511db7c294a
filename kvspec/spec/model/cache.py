"""Cache-level reference model: requests with token lists over a PoolModel.

A block's hash key here is the *whole token prefix* up to the end of that block:
the meaning that a parent-chained hash is meant to have. The invariants compare the
target's opaque hashes against these keys (HASH_CHAIN).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Optional

from kvspec.spec.config import Config
from kvspec.spec.ops import Admit, Finish, Op, Preempt, Step
from kvspec.spec.model.pool import PoolModel


@dataclass
class ReqModel:
    tokens: list[int]
    running: bool = False
    computed: int = 0              # tokens whose KV is in the table
    table: list[int] = field(default_factory=list)
    num_cached: int = 0            # leading blocks already in the index


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class CacheModel:
    def __init__(self, config: Config, traits) -> None:
        self.bs = config.block_size
        self.caching = config.caching
        self.pool = PoolModel(config, traits)
        self.reqs: dict[str, ReqModel] = {}
        self.noops = getattr(traits, "documented_noops", frozenset())
        self.admit_all_blocks = getattr(traits, "admit_all_blocks", False)
        self.whole_prompt_hits = getattr(traits, "whole_prompt_hits", False)
        self.head_first = getattr(traits, "free_order", "lru_tail_first") == "fifo"
        self.lru_refresh = getattr(traits, "lru_refresh_on_lookup", False)

    def clone(self) -> "CacheModel":
        return copy.deepcopy(self)

    def key(self, tokens: list[int], i: int) -> tuple[int, ...]:
        """Content key of logical block i: every token up to its end."""
        return tuple(tokens[: (i + 1) * self.bs])

    def running(self) -> list[str]:
        return [r for r, q in self.reqs.items() if q.running]

    def waiting(self) -> list[str]:
        return [r for r, q in self.reqs.items() if not q.running]

    def steppable(self) -> list[str]:
        """Running requests that may decode another token: not one whose last Step was
        refused (its token is still uncomputed, ``computed < len(tokens)``). An engine
        never appends after a refused allocation: vLLM's scheduler preempts (this request
        or a lower-priority one) and nano-vllm's leaves it waiting, so the next op for it
        is a Preempt or a Finish, not another Step."""
        return [r for r, q in self.reqs.items() if q.running and q.computed >= len(q.tokens)]

    # -- misuse -----------------------------------------------------------------
    def misuse_reason(self, op: Op) -> Optional[str]:
        if isinstance(op, Admit):
            if op.prompt is not None and op.req in self.reqs:
                return f"request {op.req} already exists"
            if op.prompt is not None and not op.prompt:
                return "empty prompt"
            if op.prompt is None and op.req not in self.waiting():
                return f"request {op.req} is not waiting"
        elif isinstance(op, (Step, Preempt)):
            if op.req not in self.running() and not (isinstance(op, Preempt) and "free_unknown_request" in self.noops):
                return f"{type(op).__name__.lower()} of request {op.req}, which is not running"
        elif isinstance(op, Finish):
            if op.req not in self.reqs and "free_unknown_request" not in self.noops:
                return f"finish of request {op.req}, which does not exist"
        return None

    # -- transitions -------------------------------------------------------------
    def hit_blocks(self, tokens: list[int]) -> list[int]:
        """Longest cached prefix: full blocks only, at most len-1 tokens (every token
        where whole-prompt hits are declared), stop at a miss."""
        if not self.caching:
            return []
        hits = []
        for i in range((len(tokens) if self.whole_prompt_hits else len(tokens) - 1) // self.bs):
            b = self.pool.lookup(self.key(tokens, i))
            if b is None:
                break
            hits.append(b)
        return hits

    def apply(self, op: Op):
        self.req_now = getattr(op, "req", None)  # whose table an allocation fills (free order "any")
        if isinstance(op, Admit):
            if op.prompt is not None:
                self.reqs[op.req] = ReqModel(tokens=list(op.prompt))
            return self._admit(self.reqs[op.req])
        if isinstance(op, Step):
            q = self.reqs[op.req]
            q.tokens.append(op.token)
            return self._grow(q)
        if isinstance(op, Preempt):
            q = self.reqs.get(op.req)
            if q is not None and q.running:  # else a documented no-op
                self._release(q)
            return None
        if isinstance(op, Finish):
            q = self.reqs.pop(op.req, None)
            if q is not None and q.running:
                self._release(q)
            return None
        raise TypeError(f"not a cache-level op: {op!r}")

    def _admit(self, q: ReqModel) -> Optional[int]:
        hits = self.hit_blocks(q.tokens)
        if self.lru_refresh:  # the admission check reads the hits: refreshed even if then refused
            self.pool.refresh(hits)
        need = cdiv(len(q.tokens), self.bs) - len(hits)
        revived = sum(1 for b in hits if self.pool.ref[b] == 0)
        if self.admit_all_blocks:
            need_free = cdiv(len(q.tokens), self.bs)  # hits on held blocks counted too
        else:
            need_free = need + revived
        if need_free > self.pool.free_count():
            return None  # refused: nothing changes, the request keeps waiting
        self.pool.touch(hits)  # after the capacity check, before popping new blocks
        q.table = hits + self.pool.alloc(need, (self.req_now, 0, len(hits)))
        q.num_cached = len(hits)
        q.running = True
        self._computed(q)
        return len(hits) * self.bs

    def _grow(self, q: ReqModel) -> bool:
        need = cdiv(len(q.tokens), self.bs) - len(q.table)
        if need > self.pool.free_count():
            return False  # refused: the token waits, uncomputed
        q.table += self.pool.alloc(need, (self.req_now, 0, len(q.table)))
        self._computed(q)
        return True

    def _computed(self, q: ReqModel) -> None:
        q.computed = len(q.tokens)
        full = q.computed // self.bs
        for i in range(q.num_cached, full):
            self.pool.cache(q.table[i], self.key(q.tokens, i))
        q.num_cached = max(q.num_cached, full)

    def _release(self, q: ReqModel) -> None:
        # tail first, so the prefix stays cached longest; head first under "fifo"
        self.pool.free(list(q.table) if self.head_first else list(reversed(q.table)))
        q.table, q.computed, q.num_cached, q.running = [], 0, 0, False
