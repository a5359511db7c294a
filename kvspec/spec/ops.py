"""The one vocabulary of operations, shared by the stateful machines, the model
checker, the repro files, the corpus and the reports.

Three levels (see DESIGN.md). Pool level works on block ids and opaque hash labels;
cache level works on requests and token lists; engine level says only what the outside
world does (a request arrives, the engine steps, a client aborts) and lets the engine's
own scheduler decide the rest. Each op is a frozen dataclass whose
``repr`` is valid Python, so a step list can be pasted into a test file as is.
Whether an op is a *misuse* is not a property of the op: the reference model
decides it from the current state (freeing block 3 is fine while it is held).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Optional


@dataclass(frozen=True)
class Op:
    level: ClassVar[str] = ""

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"op": type(self).__name__}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            d[f.name] = list(v) if isinstance(v, tuple) else v
        return d


# -- pool level ------------------------------------------------------------------
@dataclass(frozen=True)
class Alloc(Op):
    """get_new_blocks(n): the target returns n block ids, front of the free queue first."""
    n: int
    level: ClassVar[str] = "pool"


@dataclass(frozen=True)
class Free(Op):
    """free_blocks(blocks): one holder fewer for each; the first is evicted first."""
    blocks: tuple[int, ...]
    level: ClassVar[str] = "pool"


@dataclass(frozen=True)
class Touch(Op):
    """touch(blocks): one holder more for each; a free cached block is revived."""
    blocks: tuple[int, ...]
    level: ClassVar[str] = "pool"


@dataclass(frozen=True)
class Cache(Op):
    """cache_full_blocks: register held, full blocks under hash labels."""
    blocks: tuple[int, ...]
    hashes: tuple[str, ...]
    level: ClassVar[str] = "pool"


@dataclass(frozen=True)
class CachePartial(Op):
    """Misuse: cache blocks of which the last is not full (it has no hash)."""
    blocks: tuple[int, ...]
    hashes: tuple[str, ...]  # one fewer than blocks
    level: ClassVar[str] = "pool"


@dataclass(frozen=True)
class FreeForeign(Op):
    """Misuse: free a block that belongs to another pool."""
    block: int
    level: ClassVar[str] = "pool"


@dataclass(frozen=True)
class Lookup(Op):
    """get_cached_block(label): a block holding that content, or None."""
    hash: str
    level: ClassVar[str] = "pool"


@dataclass(frozen=True)
class Reset(Op):
    """reset_prefix_cache(): succeeds (True) only when no block is held."""
    level: ClassVar[str] = "pool"


# -- cache level -----------------------------------------------------------------
@dataclass(frozen=True)
class Admit(Op):
    """Schedule a request: prefix lookup, then slots for the rest, or refusal.

    ``prompt`` starts a new request; ``None`` re-admits a waiting one (refused
    earlier, or preempted, with every token it had). ``chunk``: prompt tokens to
    compute now (chunked prefill; None: all). ``extra``: extra keys, e.g.
    ``'lora:A'``, ``'salt:s'``, ``'mm:X@2'`` (joined by ``;``). ``external``: tokens
    after the hit that a connector supplies (at most all but the last token).
    """
    req: str
    prompt: Optional[tuple[int, ...]] = None
    chunk: Optional[int] = None
    extra: Optional[str] = None
    external: int = 0
    level: ClassVar[str] = "cache"


@dataclass(frozen=True)
class Prefill(Op):
    """Chunked prefill: compute the next ``n`` prompt tokens of a running request."""
    req: str
    n: int
    level: ClassVar[str] = "cache"


@dataclass(frozen=True)
class Step(Op):
    """Decode: append ``token`` to a running request and allocate its slot, plus one
    slot per speculative ``drafts`` token (computed, never cached until verified)."""
    req: str
    token: int
    drafts: tuple[int, ...] = ()
    level: ClassVar[str] = "cache"


@dataclass(frozen=True)
class Verify(Op):
    """Keep the first ``accepted`` draft tokens of the last step; roll back the rest."""
    req: str
    accepted: int
    level: ClassVar[str] = "cache"


@dataclass(frozen=True)
class Preempt(Op):
    """Free a running request's blocks; it waits with all its tokens."""
    req: str
    level: ClassVar[str] = "cache"


@dataclass(frozen=True)
class Finish(Op):
    """Free a request's blocks for good."""
    req: str
    level: ClassVar[str] = "cache"


# -- engine level ----------------------------------------------------------------
@dataclass(frozen=True)
class Arrive(Op):
    """A request arrives at the engine with its prompt and ``max_tokens`` (it finishes by
    length). ``extra``: extra keys as for ``Admit`` (``'lora:NAME@PATH'``, ``'salt:s'``).
    ``priority``: under the priority policy, lower values are served first and preempted last.
    ``session``: a streaming (resumable) session: when it reaches ``max_tokens`` it waits,
    holding its KV, for its next input (``StreamInput``) instead of finishing."""
    req: str
    prompt: tuple[int, ...]
    max_tokens: int = 4
    extra: Optional[str] = None
    priority: int = 0
    session: bool = False
    level: ClassVar[str] = "engine"


@dataclass(frozen=True)
class StreamInput(Op):
    """A streaming session's next input: the engine keeps the session's tokens up to its
    last sampled one (which the session discards, as vLLM's streaming input does), appends
    ``prompt`` and runs ``max_tokens`` more. The KV of every kept token stays valid; the
    slots after it must be recomputed for the new tokens (KV_INTEGRITY)."""
    req: str
    prompt: tuple[int, ...]
    max_tokens: int = 4
    level: ClassVar[str] = "engine"


@dataclass(frozen=True)
class EngineStep(Op):
    """One engine step: the scheduler schedules, the "model" runs, every request at its end
    of prompt samples ``token``; with speculative decoding ``drafts`` draft tokens are
    proposed for the next step and ``accepted`` of this step's drafts are kept."""
    token: int = 1
    drafts: int = 0
    accepted: int = 0
    level: ClassVar[str] = "engine"


@dataclass(frozen=True)
class Abort(Op):
    """A client aborts a request (waiting or running; a no-op once it has finished)."""
    req: str
    level: ClassVar[str] = "engine"


@dataclass(frozen=True)
class ResetPrefixCache(Op):
    """An operator resets the engine's prefix cache mid-run (vLLM's
    ``Scheduler.reset_prefix_cache``). It succeeds only when no block is held; with
    ``preempt_running`` the engine first preempts every running request, and then it must."""
    preempt_running: bool = False
    level: ClassVar[str] = "engine"


POOL_OPS = (Alloc, Free, Touch, Cache, CachePartial, FreeForeign, Lookup, Reset)
CACHE_OPS = (Admit, Step, Preempt, Finish, Prefill, Verify)
ENGINE_OPS = (Arrive, EngineStep, Abort, ResetPrefixCache, StreamInput)


def _short_repr(self: Op) -> str:
    """Valid Python, leaving out fields at their defaults, so repros stay short."""
    parts = []
    for f in dataclasses.fields(self):
        v = getattr(self, f.name)
        if f.default is not dataclasses.MISSING and v == f.default:
            continue
        parts.append(f"{f.name}={v!r}")
    return f"{type(self).__name__}({', '.join(parts)})"


for _cls in POOL_OPS + CACHE_OPS + ENGINE_OPS:
    _cls.__repr__ = _short_repr  # type: ignore[method-assign]
_BY_NAME = {cls.__name__: cls for cls in POOL_OPS + CACHE_OPS + ENGINE_OPS}


def op_from_dict(d: dict[str, Any]) -> Op:
    cls = _BY_NAME[d["op"]]
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in d:
            v = d[f.name]
            kwargs[f.name] = tuple(v) if isinstance(v, list) else v
    return cls(**kwargs)
