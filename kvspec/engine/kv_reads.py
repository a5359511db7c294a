"""KV_INTEGRITY at the engine level, for an engine whose manager calls are not replayed
through the cache-level model (vLLM's legacy engine, or a run the model stopped following).

The cache-level model keeps a shadow of the KV buffer (``kvspec.spec.shadow.ShadowKV``):
each slot holds the identity of the content last written there. Here the engine's own
decisions feed it: every token a step schedules writes its slot (``StepFacts.slots``) with
the KV of its request's prefix up to that token, under the request's identity (its extra
keys: a LoRA adapter's KV differs, a salt must not be shared); and every scheduled request
reads, in the same step, every position below where its tokens start (its prefix-cache hit
and its own earlier tokens, through ``StepFacts.tables``). A read of a slot holding other
content is the engine serving KV computed for other tokens: for instance a block cached
under a hash that its tokens no longer have (vLLM #49449: a streaming session's update
replaced a token of an already-hashed block).

Writes are applied before reads: vLLM publishes a block's hash when it allocates, so a
second request may hit, in the same step, a block the first one is computing (attention
runs after the step's KV writes). Draft tokens' slots hold KV of tokens the engine has not
decided yet: their content is unknown, and reads of them are not judged. A KV connector's load
writes the KV of the prefix it serves into the slots of the external tokens
(``StepFacts.loaded``); with a connector, reads of a slot nothing wrote are not judged either.
"""
from __future__ import annotations

from typing import Optional

from kvspec.engine.protocol import StepFacts
from kvspec.spec.violation import Violation

_DRAFT = object()   # a draft token's KV: content not known to the checker


class EngineKV:
    """The shadow KV store of one engine-level run (see the module doc)."""

    def __init__(self, block_size: int, loaded_externally: bool = False) -> None:
        self.bs = block_size
        self.loaded_externally = loaded_externally   # a connector writes slots no step schedules
        self.slots: dict[int, object] = {}        # slot id (block * block_size + offset) -> content identity
        self.identity: dict[str, Optional[str]] = {}   # request -> its extra keys
        self.wanted = True   # False once the engine's steps report no tables: nothing to judge, skip the tokens

    def arrived(self, req: str, extra: Optional[str]) -> None:
        self.identity[req] = extra

    def _content(self, req: str, tokens: tuple[int, ...], p: int) -> object:
        return (self.identity.get(req), tokens[: p + 1]) if p < len(tokens) else _DRAFT

    def step(self, what: str, facts: StepFacts, tokens: dict[str, tuple[int, ...]]) -> list[Violation]:
        """``tokens``: every live request's tokens when the step was scheduled."""
        if facts.scheduled:   # a step that scheduled tokens says whether this engine reports its tables
            self.wanted = bool(facts.tables)
        if not facts.tables:
            return []
        for rid, (first, count) in facts.loaded.items():   # a connector's load: the KV of that prefix
            table, toks = facts.tables.get(rid, ()), tokens.get(rid, ())
            for p in range(first, min(first + count, len(table) * self.bs)):
                self.slots[table[p // self.bs] * self.bs + p % self.bs] = self._content(rid, toks, p)
        for rid, got in facts.slots.items():
            start, toks = facts.start.get(rid, 0), tokens.get(rid, ())
            for i, slot in enumerate(got):
                self.slots[slot] = self._content(rid, toks, start + i)
        for rid in facts.scheduled:
            table, toks = facts.tables.get(rid, ()), tokens.get(rid, ())
            for p in range(min(facts.start.get(rid, 0), len(table) * self.bs, len(toks))):
                slot = table[p // self.bs] * self.bs + p % self.bs
                have = self.slots.get(slot)
                if have is _DRAFT or (have is None and self.loaded_externally):
                    continue
                want = self._content(rid, toks, p)
                if have != want:
                    return [Violation("KV_INTEGRITY", f"{what}: {rid} reads token {p} from block {table[p // self.bs]} "
                                      f"as computed, but that slot holds {_show(have)}, not {_show(want)}")]
        return []


def _show(content: object) -> str:
    if content is None:
        return "nothing this run wrote"
    extra, prefix = content   # type: ignore[misc]
    return f"the KV of prefix {list(prefix)}" + (f" under {extra}" if extra else "")
