"""The cache-level model as an engine's manager calls drive it (nano-vllm-style engines).

The cache level plays one op as one whole scheduler step: an admission computes its
tokens and caches the full blocks at once. An engine splits that up, and the model must
check the state the engine exposes at each point, not at a point of its own:

- **when hashes become visible follows the engine**: a manager may publish a block's
  hash at admission, after the forward pass (``hash_blocks``) or in ``postprocess``. The
  model caches a request's full blocks only up to what the engine has published at that
  call (``ManagerCall.published``: the tokens of the request's leading hashed blocks, read
  off the manager right after the call), and a later publication is a ``Publish`` op of
  its own. A block the engine hashes that the model does not hold full is still a
  finding (I3 and HASH_CHAIN compare the two), and so is a hash that is wrong;
- **chunked admissions**: an ``Admit`` with a ``chunk`` computes only that chunk, and a
  ``Prefill`` computes the next ``n`` prompt tokens (the plain model admits whole prompts).

The group-aware model (vLLM's targets) already does both; it is left as it is.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from kvspec.spec.ops import Admit, Op, Prefill


@dataclass(frozen=True)
class Publish(Op):
    """The engine published the hashes of ``req``'s full blocks up to token ``upto``."""
    req: str
    upto: int


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def follow_engine(model: Any) -> Any:
    """``model`` (a plain ``CacheModel``) made to follow an engine (see the module doc)."""
    if hasattr(model, "_cache_g") or getattr(model, "_follows_engine", False):
        return model
    model._follows_engine = True
    model.published_upto = None
    plain_apply = model.apply

    def cache_upto(q: Any, upto: int) -> None:
        if not model.caching:
            return
        full = min(q.computed, len(q.tokens), upto) // model.bs
        full = min(full, len(q.table))
        for i in range(q.num_cached, full):
            model.pool.cache(q.table[i], model.key(q.tokens, i))
        q.num_cached = max(q.num_cached, full)

    def computed(q: Any, upto: Optional[int] = None) -> None:
        q.computed = len(q.tokens) if upto is None else upto
        bound = model.published_upto
        cache_upto(q, q.computed if bound is None else bound)

    model._computed = computed

    def admit_chunk(q: Any, chunk: int) -> Optional[int]:
        hits = model.hit_blocks(q.tokens)
        done = len(hits) * model.bs + chunk
        need = _cdiv(done, model.bs) - len(hits)
        revived = sum(1 for b in hits if model.pool.ref[b] == 0)
        need_free = _cdiv(done, model.bs) if model.admit_all_blocks else need + revived
        if need_free > model.pool.free_count():
            return None
        model.pool.touch(hits)
        q.table = hits + model.pool.alloc(need, (model.req_now, 0, len(hits)))
        q.num_cached = len(hits)
        q.running = True
        computed(q, done)
        return len(hits) * model.bs

    def prefill(q: Any, n: int) -> bool:
        done = min(q.computed + n, len(q.tokens))
        need = _cdiv(done, model.bs) - len(q.table)
        if need > model.pool.free_count():
            return False
        q.table += model.pool.alloc(max(need, 0), (model.req_now, 0, len(q.table)))
        computed(q, done)
        return True

    def apply(op: Op) -> Any:
        if isinstance(op, Publish):
            q = model.reqs.get(op.req)
            if q is not None and q.running:
                cache_upto(q, op.upto)
            return None
        if isinstance(op, Admit) and op.chunk is not None:
            model.req_now = op.req
            if op.prompt is not None:
                from kvspec.spec.model.cache import ReqModel
                model.reqs[op.req] = ReqModel(tokens=list(op.prompt))
            return admit_chunk(model.reqs[op.req], op.chunk)
        if isinstance(op, Prefill):
            model.req_now = op.req
            return prefill(model.reqs[op.req], op.n)
        return plain_apply(op)

    model.apply = apply
    return model


__all__ = ["Publish", "follow_engine"]
