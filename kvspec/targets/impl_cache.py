"""impl's cache-level driver: plays the scheduler over ``KVCacheManager`` (one full
group, no cap: the manager every old operation has always driven) or, for several
KV-cache groups or a ``max_model_len``, ``HybridKVCacheManager``.

Operations (see ``kvspec.spec.ops``): ``Admit`` = prefix lookup + ``allocate_slots``
for a chunk of the prompt after the hit and the connector's tokens; ``Prefill`` =
the next chunk; ``Step`` = append the sampled token, then slots for it and its draft
tokens; ``Verify`` = append the accepted drafts and roll the computed count back
past the rejected ones (their slots stay allocated, unread); ``Preempt``/``Finish``
= free.
"""
from __future__ import annotations

from types import ModuleType
from typing import Any

from kvspec.spec.config import Config
from kvspec.spec.observation import Observation, RequestState
from kvspec.spec.ops import Admit, Finish, Op, Prefill, Preempt, Step, Verify
from kvspec.targets.base import Driver
from kvspec.targets.snapshot import _InPlaceSnapshots
from kvspec.targets.v1_driver import _Deltas, observe_pool


def uses_hybrid(config: Config) -> bool:
    return getattr(config, "kv_groups", "full") != "full" or getattr(config, "max_model_len", None) is not None


class ImplCacheDriver(_InPlaceSnapshots, _Deltas, Driver):
    """Plays the scheduler: prefill = lookup + allocate_slots; decode = append + allocate."""

    def __init__(self, mod: ModuleType, config: Config, features: bool = True) -> None:
        # ``features``: the target declares cache_features, so the group-aware model judges it
        # (a refused Step leaves its token for Prefill); without, the single-group model does,
        # and the next Step allocates every pending token, as vLLM's scheduler would.
        self.features = features
        # The names it needs, not the module: a driver must pickle (the model checker forks it).
        self._keyed_request = getattr(mod, "KeyedRequest", None)
        self._parse_extra = getattr(mod, "parse_extra", None)
        self._invalid = getattr(mod, "InvalidCountError", ValueError)
        self._unknown = getattr(mod, "UnknownRequestError", KeyError)
        self.hybrid = uses_hybrid(config)
        if self.hybrid:
            self.mgr = mod.HybridKVCacheManager(config.num_blocks, config.block_size, config.kv_groups,
                                                enable_caching=config.caching, max_model_len=config.max_model_len)
        else:
            self.mgr = mod.KVCacheManager(config.num_blocks, config.block_size, enable_caching=config.caching)
        self.reqs: dict[str, Any] = {}
        self.running: set[str] = set()
        self.drafts: dict[str, tuple] = {}
        self.finished: dict[str, Any] = {}   # a Step of one reaches the manager (a scheduler misuse)

    def _new_request(self, rid: str, prompt, extra):
        m = self.mgr
        if self.hybrid:
            return m.make_request(rid, prompt, extra)
        if extra:
            return self._keyed_request(rid, prompt, m.block_size, m.hash_fn, self._parse_extra(extra))
        return m.make_request(rid, prompt)

    def _refuse(self, why: str) -> None:
        raise self._invalid(why)

    def apply(self, op: Op) -> Any:
        m = self.mgr
        if isinstance(op, Admit):
            if op.chunk is not None and op.chunk < 1:
                self._refuse(f"chunk {op.chunk} is not positive")
            if op.external < 0:
                self._refuse(f"negative external token count {op.external}")
            req = self.reqs.get(op.req) if op.prompt is None else self._new_request(op.req, op.prompt, op.extra)
            if req is None:
                raise KeyError(f"no waiting request {op.req}")
            hits, num_hit = m.get_computed_blocks(req)   # refuses a running request or an empty prompt
            self.reqs[op.req] = req
            n = req.num_tokens
            ext = max(0, min(op.external, n - 1 - num_hit))   # a connector never supplies the last token
            new = n - num_hit - ext if op.chunk is None else min(op.chunk, n - num_hit - ext)
            if self.hybrid:
                out = m.allocate_slots(req, new, num_hit, hits, num_external_computed_tokens=ext)
            else:  # one full group: connector tokens take slots like computed ones
                out = m.allocate_slots(req, ext + new, num_hit, hits)
            if out is None:
                return None
            req.num_computed_tokens = num_hit + ext + new
            self.running.add(op.req)
            self.drafts.pop(op.req, None)
            return num_hit
        if isinstance(op, Prefill):
            req = self._running(op.req)
            if req.num_computed_tokens >= req.num_tokens or op.n < 1:
                self._refuse(f"prefill of {op.n} tokens for {op.req}, {req.num_computed_tokens} of "
                             f"{req.num_tokens} computed")
            new = min(op.n, req.num_tokens - req.num_computed_tokens)
            if m.allocate_slots(req, new) is None:
                return False
            req.num_computed_tokens += new
            return True
        if isinstance(op, Step):
            if op.req in self.finished and op.req not in self.running:
                return m.allocate_slots(self.finished[op.req], 1)   # the manager must refuse it
            req = self._running(op.req)
            if self.drafts.get(op.req) or (self.features and req.num_computed_tokens < req.num_tokens):
                self._refuse(f"step of {op.req} before its prefill or drafts are done")
            req.append_output_token_ids(op.token)
            k = len(op.drafts)
            if self.hybrid:
                # The drafts ride at the request's end until verified; they get lookahead slots.
                req.append_spec_tokens(op.drafts)
                out = m.allocate_slots(req, req.num_verified_tokens - req.num_computed_tokens, num_lookahead_tokens=k)
                if out is None:
                    req.verify(0)
            else:  # the drafts are scheduled tokens past the request's own
                out = m.allocate_slots(req, req.num_tokens - req.num_computed_tokens + k)
            if out is None:
                return False
            req.num_computed_tokens = (req.num_verified_tokens if self.hybrid else req.num_tokens) + k
            if k:
                self.drafts[op.req] = tuple(op.drafts)
            return True
        if isinstance(op, Verify):
            req = self._running(op.req)
            drafts = self.drafts.get(op.req, ())
            if not drafts or not 0 <= op.accepted <= len(drafts):
                self._refuse(f"verify of {op.accepted} drafts of {op.req}, which has {len(drafts)} in flight")
            del self.drafts[op.req]
            if self.hybrid:
                req.verify(op.accepted)
            else:
                for t in drafts[: op.accepted]:
                    req.append_output_token_ids(t)
            req.num_computed_tokens -= len(drafts) - op.accepted
            return None
        if isinstance(op, (Preempt, Finish)):
            req = self.reqs.get(op.req) or m.make_request(op.req, [0])
            # A waiting request holds nothing: finishing it is bookkeeping only, while
            # preempting it (or anything unknown) reaches the manager, which must refuse.
            if op.req in self.running or isinstance(op, Preempt) or op.req not in self.reqs:
                m.free(req)
            self.running.discard(op.req)
            if self.drafts.pop(op.req, None) and self.hybrid:
                req.verify(0)  # drafts in flight are dropped with the blocks
            if isinstance(op, Finish):
                if self.reqs.pop(op.req, None) is not None and req.num_computed_tokens:
                    self.finished[op.req] = req   # it ran: its computed tokens stay, as a scheduler's would
            else:
                req.num_computed_tokens = 0
            return None
        raise TypeError(f"{op!r} is not a cache-level op")

    def _running(self, rid: str):
        if rid not in self.running:
            raise self._unknown(f"request {rid!r} is not running")
        return self.reqs[rid]

    def _requests(self) -> dict:
        out = {}
        for rid in sorted(self.running):
            ids = self.mgr.get_block_ids(rid)
            if self.hybrid:
                out[rid] = RequestState(tuple(ids[0]), self.reqs[rid].num_computed_tokens,
                                        tuple(tuple(t) for t in ids[1:]))
            else:
                out[rid] = RequestState(tuple(ids), self.reqs[rid].num_computed_tokens)
        return out

    def observe(self) -> Observation:
        return observe_pool(self.mgr.block_pool, self._requests())

    def _tracked_pool(self) -> Any:
        return self.mgr.block_pool
