"""Bookkeeping the checks carry from step to step.

``ShadowKV`` stands in for the GPU's KV buffer: each slot holds the *identity* of
the content last written there, which is the whole token prefix up to that token
(the KV at position p depends on every token up to p). A request that reads a slot
whose identity is not its own prefix reads someone else's KV (KV_INTEGRITY).

``HashMap`` pairs the target's opaque hash values with the model's content keys.
It must stay a bijection: one target hash for two different contents is a chain
collision, one content under two hashes is a non-deterministic hash (HASH_CHAIN).
"""
from __future__ import annotations

from typing import Hashable, Optional


class ShadowKV:
    def __init__(self, block_size: int) -> None:
        self.bs = block_size
        self.slots: dict[tuple[int, int], tuple[int, ...]] = {}

    def write(self, table: tuple[int, ...], tokens: list[int], start: int, stop: int) -> None:
        for p in range(start, stop):
            self.slots[(table[p // self.bs], p % self.bs)] = tuple(tokens[: p + 1])

    def first_bad(self, table: tuple[int, ...], tokens: list[int], upto: int) -> Optional[int]:
        """The first position < upto whose slot does not hold this request's prefix."""
        for p in range(min(upto, len(table) * self.bs, len(tokens))):
            if self.slots.get((table[p // self.bs], p % self.bs)) != tuple(tokens[: p + 1]):
                return p
        return None


class HashMap:
    def __init__(self) -> None:
        self.t2k: dict[Hashable, Hashable] = {}
        self.k2t: dict[Hashable, Hashable] = {}

    def pair(self, target_hash: Hashable, key: Hashable) -> Optional[str]:
        """Record target_hash <-> key; return a description of a conflict, if any."""
        k = self.t2k.get(target_hash)
        if k is not None and k != key:
            return f"two different contents ({_show(k)} and {_show(key)}) got the same hash"
        t = self.k2t.get(key)
        if t is not None and t != target_hash:
            return f"the same content ({_show(key)}) got two different hashes"
        self.t2k[target_hash] = key
        self.k2t[key] = target_hash
        return None

    def key_of(self, target_hash: Hashable) -> Optional[Hashable]:
        return self.t2k.get(target_hash)


def _show(key: Hashable) -> str:
    if isinstance(key, tuple) and len(key) == 3 and isinstance(key[2], tuple):  # (group, extra keys, prefix)
        g, extra, prefix = key
        return f"group {g}, extra keys {extra or 'none'}, prefix {list(prefix)}"
    return f"prefix {list(key)}" if isinstance(key, tuple) else repr(key)
