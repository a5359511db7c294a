"""KV-cache groups: which tokens each kind of attention layer still needs, and where
a prefix hit may start and stop for it.

A model may mix layer kinds that share one block pool. Each kind is one *group*
with its own block table per request:

* ``full``: every query attends to every earlier token; a hit is the longest run of
  cached blocks from block 0.
* ``swa:W`` (sliding window of W tokens): the query at position p attends to
  ``[p-W+1, p]``; blocks wholly before the window of every still-needed query are
  freed and become the null block in the table; a hit at length L only needs the
  blocks holding positions ``[L-W+1, L)`` cached, earlier ones may be null.
* ``chunked:C`` (chunked local attention): the query at p attends to
  ``[p//C*C, p]``; a hit at L needs only the blocks of L's chunk.

``parse_kv_groups`` turns a spec string such as ``"full,swa:4"`` into group specs;
kvspec reads the same strings, so the parser lives here (impl imports nothing from
kvspec). ``find_agreed_hit`` is the coordinator: the groups shrink a candidate hit
length until all of them accept it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

KINDS = ("full", "swa", "chunked")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVGroupSpec:
    kind: str       # "full" | "swa" | "chunked"
    size: int = 0   # the window (swa) or chunk (chunked) in tokens; 0 for full

    def __str__(self) -> str:
        return self.kind if self.kind == "full" else f"{self.kind}:{self.size}"

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """How many leading tokens the next query (at ``num_computed_tokens``) and every
        later one never attend to."""
        n = num_computed_tokens
        if self.kind == "swa":
            return max(0, n - self.size + 1)
        if self.kind == "chunked":
            return n // self.size * self.size
        return 0

    def first_needed(self, position: int) -> int:
        """The first position the query at ``position`` attends to."""
        if self.kind == "swa":
            return max(0, position - self.size + 1)
        if self.kind == "chunked":
            return position // self.size * self.size
        return 0


def parse_kv_groups(spec: str) -> list[KVGroupSpec]:
    """``"full,swa:4,chunked:8"`` -> group specs; ValueError on anything else.

    ``mamba`` is not modelled by impl (its state is one block that is overwritten in
    place, which the shadow-store checks do not describe) and is refused here.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError("a kv-groups spec is a comma list such as 'full' or 'full,swa:4'")
    out = []
    for part in spec.split(","):
        part = part.strip()
        kind, _, arg = part.partition(":")
        if kind == "full" and not arg:
            out.append(KVGroupSpec("full"))
        elif kind in ("swa", "chunked") and arg.isdigit() and int(arg) >= 1:
            out.append(KVGroupSpec(kind, int(arg)))
        elif kind == "mamba":
            raise ValueError("kv group 'mamba' is not supported by this allocator")
        else:
            raise ValueError(f"bad kv group {part!r}: expected full, swa:W or chunked:C (W, C >= 1)")
    return out


def format_kv_groups(groups: Sequence[KVGroupSpec]) -> str:
    return ",".join(str(g) for g in groups)


def group_hash(block_hash: bytes, group_id: int) -> bytes:
    """The key a group caches a block under: the same content in two groups is two
    different blocks (their KV comes from different layers). Group 0 keeps the plain
    hash, so a single full-attention group caches exactly as before."""
    return block_hash if group_id == 0 else block_hash + b"#g%d" % group_id


Lookup = Callable[[int], Optional[object]]   # logical block index -> cached block or None


def find_group_hit(spec: KVGroupSpec, lookup: Lookup, max_length: int, block_size: int,
                   null_block: object) -> list:
    """The blocks of this group's longest hit of at most ``max_length`` tokens
    (block-aligned); positions the hit does not need are the null block."""
    max_blocks = max(max_length, 0) // block_size
    if spec.kind == "full":
        hits = []
        for i in range(max_blocks):
            b = lookup(i)
            if b is None:
                break
            hits.append(b)
        return hits
    if spec.kind == "swa":
        # The last ceil((W-1)/bs) blocks before the hit point must be cached; scan
        # from the right and stop at the first long enough run.
        need = max(1, cdiv(spec.size - 1, block_size))
        run = 0
        for i in range(max_blocks - 1, -1, -1):
            if lookup(i) is None:
                run = 0
                continue
            run += 1
            if run >= need:
                return [null_block] * i + [lookup(j) for j in range(i, i + run)]
        # No long enough run: a shorter run from block 0 is still a hit (nothing before it).
        return [lookup(j) for j in range(run)]
    # chunked: only the blocks of the hit point's own chunk need to be cached.
    start_block = (max_length // spec.size * spec.size if max_length > 0 else 0) // block_size
    start_block = min(start_block, max_blocks)
    hits: list = [null_block] * start_block
    for i in range(start_block, max_blocks):
        b = lookup(i)
        if b is None:
            break
        hits.append(b)
    return hits


def find_agreed_hit(groups: Sequence[KVGroupSpec], lookups: Sequence[Lookup], max_length: int, block_size: int,
                    null_block: object) -> tuple[list[list], int]:
    """Per-group hit blocks and the one hit length every group accepts.

    Fixed point: each group either accepts the candidate length or lowers it; after a
    lowering every group is asked again. Lengths only decrease, so this ends. A
    full-attention group's hit is downward-closed, so it is looked up once and later
    cut to the agreed length.
    """
    hit_length = max(max_length, 0) // block_size * block_size
    per_group: list[Optional[list]] = [None] * len(groups)
    while True:
        cur = hit_length
        for g, spec in enumerate(groups):
            if spec.kind == "full" and per_group[g] is not None:
                cur = min(cur, len(per_group[g]) * block_size)
                continue
            per_group[g] = find_group_hit(spec, lookups[g], cur, block_size, null_block)
            cur = len(per_group[g]) * block_size
        if cur >= hit_length:
            break
        hit_length = cur
    num_blocks = hit_length // block_size
    for g, spec in enumerate(groups):
        if spec.kind == "full":
            del per_group[g][num_blocks:]
    return [blocks or [] for blocks in per_group], hit_length
