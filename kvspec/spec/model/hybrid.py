"""Cache-level reference model with KV-cache groups, chunked prefill, draft tokens,
extra keys, connector tokens and the ``max_model_len`` cap, over one PoolModel.

Used for targets that declare ``Traits.cache_features``. With one full group and
the old operations it does exactly what ``CacheModel`` does.

Per request and group there is a table; group 0's is ``ReqModel.table`` (what the
old checks read), the others are in ``more``. A position a group no longer needs
holds the null block's id. A block's content key is the token prefix up to its end,
plus the group and the extra keys when either is not the default, so the hash-chain
check pairs each target hash with exactly one (group, extra keys, prefix).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Optional

from kvspec.spec.config import Config
from kvspec.spec.model.cache import CacheModel, ReqModel
from kvspec.spec.model.groups import Extra, accepted, agreed_hit, cdiv, eagle_hit, needed_blocks, parse_extra, parse_groups
from kvspec.spec.ops import Admit, Op, Prefill, Step, Verify


@dataclass
class GroupReq(ReqModel):
    extra: Extra = field(default_factory=Extra)
    more: list = field(default_factory=list)          # tables of groups 1.. (lists of ids)
    more_cached: list = field(default_factory=list)   # their num_cached
    drafts: tuple = ()                                # unverified draft tokens in flight
    computing_from: int = 0                           # first token the last schedule computed (not hit, not external)

    def tables(self) -> list[list[int]]:
        return [self.table] + self.more


class GroupCacheModel(CacheModel):
    def __init__(self, config: Config, traits) -> None:
        super().__init__(config, traits)
        self.groups = parse_groups(getattr(config, "kv_groups", "full") or "full")
        mml = getattr(config, "max_model_len", None)
        self.max_len: Optional[int] = mml
        self.null = self.pool.null
        self.use_eagle = bool(getattr(config, "use_eagle", False))
        # Under EAGLE the model proves a hit available (``eagle_hit``: the floor) and
        # bounds it (``agreed_hit``: every group accepts it). A target may take any hit
        # up to the bound that every group accepts (vLLM 0.33.0 looks one block further
        # than 0.20.0 on a block-aligned prompt): the session hands the model the target's
        # result (``target_result``) and the model follows it when it is such a hit, so
        # that its tables stay the target's. ``hit_floor``: the floor of the last
        # admission (None when the model states none), which MIN_HIT holds the target to.
        self.target_result = None
        self.hit_floor: Optional[int] = None

    # -- what may run next (for the machines) -----------------------------------------
    def steppable(self) -> list[str]:
        return [r for r, q in self.reqs.items() if q.running and not q.drafts and q.computed >= len(q.tokens)]

    def prefilling(self) -> list[str]:
        return [r for r, q in self.reqs.items() if q.running and q.computed < len(q.tokens)]

    def drafting(self) -> list[str]:
        return [r for r, q in self.reqs.items() if q.running and q.drafts]

    # -- content keys -------------------------------------------------------------------
    def gkey(self, q: GroupReq, g: int, i: int) -> Hashable:
        end = (i + 1) * self.bs
        prefix = tuple(q.tokens[:end])
        extra = q.extra.upto(end)
        return prefix if g == 0 and not extra else (g, extra, prefix)

    def kv_identity(self, q: GroupReq, g: int, p: int) -> Hashable:
        """What the KV written at position ``p`` of group ``g`` is computed from."""
        return (g, q.extra.upto(p + 1), tuple(q.tokens[: p + 1]))

    # -- misuse -------------------------------------------------------------------------
    def misuse_reason(self, op: Op) -> Optional[str]:
        q = self.reqs.get(getattr(op, "req", None))
        if isinstance(op, Admit):
            if op.chunk is not None and op.chunk < 1:
                return f"chunk {op.chunk} is not positive"
            if op.external < 0:
                return f"negative external token count {op.external}"
            if op.prompt is not None and op.extra:
                try:
                    parse_extra(op.extra)
                except ValueError as e:
                    return str(e)
        if isinstance(op, Prefill):
            if q is None or not q.running:
                return f"prefill of request {op.req}, which is not running"
            if q.computed >= len(q.tokens):
                return f"prefill of request {op.req}, whose prefill is complete"
            if op.n < 1:
                return f"prefill of {op.n} tokens"
            return None
        if isinstance(op, Verify):
            if q is None or not q.running or not q.drafts:
                return f"verify of request {op.req}, which has no draft tokens in flight"
            if not 0 <= op.accepted <= len(q.drafts):
                return f"verify accepting {op.accepted} of {len(q.drafts)} draft tokens"
            return None
        if isinstance(op, Step) and q is not None and q.running:
            if q.drafts:
                return f"step of request {op.req}, whose draft tokens are not verified"
            if q.computed < len(q.tokens):
                return f"step of request {op.req}, whose prefill is not complete"
        return super().misuse_reason(op)

    # -- transitions --------------------------------------------------------------------
    def apply(self, op: Op):
        self.req_now = getattr(op, "req", None)  # whose tables an allocation fills (free order "any")
        if isinstance(op, Admit):
            if op.prompt is not None:
                self.reqs[op.req] = GroupReq(tokens=list(op.prompt), extra=parse_extra(op.extra))
            return self._admit_g(self.reqs[op.req], op.chunk, op.external)
        if isinstance(op, Prefill):
            q = self.reqs[op.req]
            return self._schedule(q, min(op.n, len(q.tokens) - q.computed), ())
        if isinstance(op, Step):
            q = self.reqs[op.req]
            q.tokens.append(op.token)
            return self._schedule(q, len(q.tokens) - q.computed, tuple(op.drafts))
        if isinstance(op, Verify):
            q = self.reqs[op.req]
            rejected = len(q.drafts) - op.accepted
            q.tokens += list(q.drafts[: op.accepted])
            q.computed -= rejected  # the rejected drafts' slots stay allocated, unread
            q.drafts = ()
            return None
        return super().apply(op)

    def hit_blocks(self, tokens):  # the old single-group entry point is not used here
        raise NotImplementedError

    def _cached_in(self, q: GroupReq):
        def for_group(g: int):
            return lambda i: self.caching and self.pool.lookup(self.gkey(q, g, i)) is not None
        return for_group

    def _admit_g(self, q: GroupReq, chunk: Optional[int], external: int) -> Optional[int]:
        bs, n = self.bs, len(q.tokens)
        hit = agreed_hit(self.groups, self._cached_in(q), n - 1, bs) if self.caching else 0
        self.hit_floor = None
        if self.use_eagle and self.caching:
            floor = eagle_hit(self.groups, self._cached_in(q), n - 1, bs)
            r = self.target_result
            took = r if isinstance(r, int) and not isinstance(r, bool) else None
            if took is not None and took <= hit and accepted(self.groups, self._cached_in(q), took, bs):
                # a hit every group serves: the target's choice, followed so that the tables
                # stay comparable (one below the floor is MIN_HIT's alone to report)
                hit = took
            elif took is None or took < hit:
                hit = floor          # refused, or a hit no group layout explains: the model's own
            self.hit_floor = floor
        hits = []
        for g, grp in enumerate(self.groups):
            need = needed_blocks(grp, hit, bs)
            hits.append([self.pool.lookup(self.gkey(q, g, i)) if i in need else self.null for i in range(hit // bs)])
        ext = max(0, min(external, n - 1 - hit))   # a connector never supplies the last token
        total = hit + ext
        new = n - total if chunk is None else min(chunk, n - total)
        main = total + new
        if self.max_len is not None and main > self.max_len:
            return None
        required = cdiv(main, bs)
        want = 0
        for g, grp in enumerate(self.groups):
            skip = grp.skipped(total) // bs
            want += max(required - max(skip, len(hits[g])), 0)
            want += sum(1 for b in hits[g][skip:] if b != self.null and self.pool.ref[b] == 0)
        if want > self.pool.free_count():
            return None
        tables = []
        for g, grp in enumerate(self.groups):
            skip = grp.skipped(total) // bs
            kept = [b for b in hits[g][skip:] if b != self.null]
            self.pool.touch(kept)  # every group's hits before any pop (vLLM #33775)
            tables.append([self.null] * skip + hits[g][skip:])
        cached = [len(t) for t in tables]
        if ext:
            for g, grp in enumerate(self.groups):
                if grp.skipped(total) >= total:
                    continue  # no connector token is read here: its block comes with the new ones (vLLM)
                skip = grp.skipped(total) // bs
                t = tables[g]
                t += [self.null] * max(skip - len(t), 0)
                t += self.pool.alloc(max(cdiv(total, bs) - len(t), 0), (self.req_now, g, len(t)))
        for g, t in enumerate(tables):
            t += self.pool.alloc(max(required - len(t), 0), (self.req_now, g, len(t)))
        q.table, q.more = tables[0], tables[1:]
        q.num_cached, q.more_cached = cached[0], cached[1:]
        q.running, q.computed, q.drafts, q.computing_from = True, main, (), total
        self._cache_g(q, min(main, n))
        return hit

    def _schedule(self, q: GroupReq, new: int, drafts: tuple):
        """Slots for ``new`` tokens after the computed ones, plus ``drafts``; False if refused."""
        total = q.computed
        main = total + new + len(drafts)
        if self.max_len is not None and main > self.max_len:
            return False
        self._remove_skipped(q, total)
        required = cdiv(main, self.bs)
        if sum(max(required - len(t), 0) for t in q.tables()) > self.pool.free_count():
            return False
        for g, t in enumerate(q.tables()):
            t += self.pool.alloc(max(required - len(t), 0), (self.req_now, g, len(t)))
        self._cache_g(q, min(main, len(q.tokens)))   # drafts lie past the verified tokens
        q.computed, q.drafts, q.computing_from = main, drafts, total
        return True

    def _remove_skipped(self, q: GroupReq, computed: int) -> None:
        for g, t in zip(self.groups, q.tables()):
            skip = min(g.skipped(computed) // self.bs, len(t))
            freed = []
            for i in range(skip - 1, -1, -1):
                if t[i] == self.null:
                    break
                freed.append(t[i])
                t[i] = self.null
            if freed:
                self.pool.free(freed)

    def _cache_g(self, q: GroupReq, num_tokens: int) -> None:
        if not self.caching:
            return
        full = num_tokens // self.bs
        counts = [q.num_cached] + q.more_cached
        for g, t in enumerate(q.tables()):
            stop = min(full, len(t))
            for i in range(counts[g], stop):
                if t[i] != self.null:
                    self.pool.cache(t[i], self.gkey(q, g, i))
            counts[g] = max(counts[g], stop)
        q.num_cached, q.more_cached = counts[0], counts[1:]

    def _release(self, q: GroupReq) -> None:
        for t in q.tables():
            self.pool.free([b for b in (t if self.head_first else reversed(t)) if b != self.null])  # see CacheModel
        q.table, q.more, q.computed, q.num_cached, q.running, q.drafts = [], [], 0, 0, False, ()
        q.more_cached = []
