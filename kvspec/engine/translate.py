"""An engine's manager calls as the cache level's operations, so that one reference
model (``kvspec.spec.model``) and one invariant catalogue judge both levels.

The scheduler's calls map onto the cache-level vocabulary one for one:

- ``admit`` (a waiting or preempted request gets slots): ``Admit`` with ``chunk`` the
  tokens it computes now (a refused admission that was gated on room for the whole
  sequence, vLLM's ``scheduler_reserve_full_isl``, is the model's whole-prompt ``Admit``:
  both refuse exactly when the whole sequence does not fit); a request the model has already seen is re-admitted
  (``prompt=None``) with the tokens the engine gave it meanwhile (sampled while it ran,
  before its preemption: a waiting request's tokens are the engine's to decide);
- ``grow`` (a running request gets slots): ``Step`` when the engine appended one sampled
  token since the model last saw the request, ``Prefill`` for the next chunk of tokens
  it already had (a chunked prompt, or a Step refused earlier and retried after a
  preemption: the engine never appends after a refusal);
  A growth that carries draft tokens is a ``Step`` with those ``drafts``; retried after
  a refusal, it is the same ``Step`` again (the refused one changed nothing in the model
  but appending its token, which is taken back first);
- ``verify`` (the output update after a drafted step): ``Verify`` with the drafts kept.
  The scheduler then caches the blocks the kept tokens fill (``cache_blocks``), so the
  engine's model does too (``engine_model``);
- ``preempt`` / ``finish``: ``Preempt`` / ``Finish``;
- ``reset`` (``reset_prefix_cache`` reached the manager): the pool's ``Reset``, which the
  engine's model applies to its pool (True only when no block is held; a success forgets
  every hash). A call that reserves lookahead slots (a drafter's, ``kvspec.vllm.inputs``) has no
  cache-level op: ``Unexpressible``.

The result is what the target did, in the cache level's terms: an admission's hit
tokens (None when refused), a growth's success.
"""
from __future__ import annotations

from typing import Any, Optional

from kvspec.engine.protocol import ManagerCall
from kvspec.errors import TargetError
from kvspec.spec.ops import Admit, Finish, Op, Prefill, Preempt, Reset, Step, Verify


class Unexpressible(Exception):
    """A manager call the cache-level vocabulary has no op for (e.g. vLLM padding a new
    decode request with placeholder drafts at admission, for uniform spec-decode batches).
    The model cannot follow the engine past it: the rest of that run is checked by the
    engine-level checks alone (``EngineSession``)."""


def engine_model(model: Any) -> Any:
    """``model`` as the engine level uses it: a ``Verify`` also caches the blocks the kept
    tokens fill, as vLLM's scheduler does in its output update (``cache_blocks``)."""
    if not hasattr(model, "_cache_g"):
        from kvspec.engine.follow import follow_engine   # the plain model: publication and chunks as the engine
        return follow_engine(model)
    plain = model.apply

    def apply(op: Op) -> Any:
        if isinstance(op, Reset):   # an engine's reset_prefix_cache: the pool's own
            return model.pool.reset()
        result = plain(op)
        if isinstance(op, Verify):
            q = model.reqs[op.req]
            upto = getattr(model, "verified_upto", None)   # set by translate: what the engine computed
            model._cache_g(q, min(q.computed, len(q.tokens), upto if upto is not None else q.computed))
        return result

    model.apply = apply
    return model


def translate(call: ManagerCall, model: Any) -> "tuple[Optional[Op], Any]":
    """(the cache-level op, the target's result) for ``call``, given the reference model
    before it; the op is None when the call changes nothing the model holds. May set a
    waiting request's tokens in the model (see the module doc)."""
    if call.kind == "reset":
        return Reset(), call.ok
    if call.lookahead and call.kind in ("admit", "grow"):
        raise Unexpressible(f"{call.req} is given {call.lookahead} lookahead slots past its new tokens "
                            f"(a drafter's KV): the cache model has no op for them")
    q = model.reqs.get(call.req)
    if hasattr(model, "published_upto"):   # kvspec.engine.follow: cache only what the engine published
        model.published_upto = call.published
    if call.kind == "publish":
        from kvspec.engine.follow import Publish
        if q is None or not q.running or call.published is None:
            return None, None
        return Publish(call.req, call.published), None
    if call.kind == "admit":
        todo = len(call.tokens) - call.hit - call.external
        if call.new > todo:
            raise Unexpressible(f"{call.req} is admitted with {call.new - todo} placeholder draft slots")
        chunk = None if call.new >= todo or (call.whole and not call.ok) else call.new
        result = call.hit if call.ok else None
        if q is None:
            return Admit(call.req, tuple(call.tokens), chunk, call.extra, call.external), result
        if not q.running:
            q.tokens = list(call.tokens)
        return Admit(call.req, None, chunk, None, call.external), result
    if call.kind == "grow":
        if q is None or not q.running:
            return Prefill(call.req, call.new), call.ok   # the model calls it a misuse
        pending = len(call.tokens) - len(q.tokens)
        drafts = tuple(call.drafts[: max(call.new - 1, 0)])
        if pending == 0 and drafts and q.computed == len(q.tokens) - 1 and not getattr(q, "drafts", ()):
            q.tokens.pop()   # the retry of a refused drafted Step: the same Step again
            pending = 1
        if pending == 1 and q.computed >= len(q.tokens) and call.new == 1 + len(drafts):
            return Step(call.req, call.tokens[-1], drafts), call.ok
        if pending == 0:
            return Prefill(call.req, call.new), call.ok
        raise Unexpressible(f"{call.req} grows by {call.new} with {pending} tokens the model has not seen")
    if call.kind == "verify":
        if q is None or not q.running or not getattr(q, "drafts", ()):
            return None, None
        model.verified_upto = call.new   # a request that stops at max_tokens computes (and caches) less
        return Verify(call.req, min(call.accepted, len(q.drafts))), None
    if call.kind == "preempt":
        return Preempt(call.req), None
    if call.kind == "finish":
        return Finish(call.req), None
    raise TargetError(f"engine level: unknown manager call kind {call.kind!r}")
