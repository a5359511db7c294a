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
- ``preempt`` / ``finish``: ``Preempt`` / ``Finish``.

The result is what the target did, in the cache level's terms: an admission's hit
tokens (None when refused), a growth's success.
"""
from __future__ import annotations

from typing import Any

from kvspec.engine.protocol import ManagerCall
from kvspec.errors import TargetError
from kvspec.spec.ops import Admit, Finish, Op, Prefill, Preempt, Step


def translate(call: ManagerCall, model: Any) -> tuple[Op, Any]:
    """(the cache-level op, the target's result) for ``call``, given the reference model
    before it. May set a waiting request's tokens in the model (see the module doc)."""
    q = model.reqs.get(call.req)
    if call.kind == "admit":
        todo = len(call.tokens) - call.hit - call.external
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
        if pending == 1 and q.computed >= len(q.tokens) and call.new == 1:
            return Step(call.req, call.tokens[-1]), call.ok
        if pending == 0:
            return Prefill(call.req, call.new), call.ok
        raise TargetError(f"engine level: {call.req} grows by {call.new} with {pending} new tokens "
                          f"(speculative or jump decoding), which the cache level cannot express yet")
    if call.kind == "preempt":
        return Preempt(call.req), None
    if call.kind == "finish":
        return Finish(call.req), None
    raise TargetError(f"engine level: unknown manager call kind {call.kind!r}")
