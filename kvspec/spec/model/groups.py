"""KV-cache groups and extra keys, as the reference model states them.

A spec string such as ``"full,swa:4,chunked:8"`` names the groups that share one pool
(see ``--kv-groups``). Which positions a query attends to decides which blocks a
group must hold and which prefix hits it accepts. Extra keys (``lora:A``,
``salt:s``, ``mm:X@2``, joined by ``;``) decide who may share a block.

This is written apart from ``kvspec.impl`` on purpose (impl has its own parser and
hit finder, and a patched impl must never change the model).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# A compressed group (``compressed:R``: DeepSeek-V4's compressed MLA layers, R tokens per
# stored entry) holds and shares blocks as full attention does: its queries read every
# earlier position, one block per ``block_size`` tokens; the ratio changes only the bytes
# of a page, which no allocator invariant reads. It is a group of its own because its
# spec differs from full attention's: a hybrid coordinator keeps it apart (H9 of
# reports/vllm-history.md: a second full-like group kept hit blocks past the agreed hit).
WHOLE = ("full", "compressed")   # kinds whose queries read from position 0


@dataclass(frozen=True)
class Group:
    kind: str      # "full" | "swa" | "chunked" | "compressed"
    size: int = 0  # window or chunk, in tokens; a compressed group's ratio

    def __str__(self) -> str:
        return self.kind if self.kind == "full" else f"{self.kind}:{self.size}"

    @property
    def whole(self) -> bool:
        """Whether its queries read every earlier position (full attention's semantics)."""
        return self.kind in WHOLE

    def attends_from(self, p: int) -> int:
        """The first position the query at ``p`` reads."""
        if self.kind == "swa":
            return max(0, p - self.size + 1)
        if self.kind == "chunked":
            return p // self.size * self.size
        return 0

    def skipped(self, computed: int) -> int:
        """Leading tokens that no query from ``computed`` on reads."""
        return self.attends_from(computed) if not self.whole else 0


def parse_groups(spec: Optional[str]) -> list[Group]:
    """``"full,swa:4"`` -> groups; ValueError for anything else (``mamba`` included:
    the model does not describe a state overwritten in place)."""
    if spec is None or not str(spec).strip():
        raise ValueError("a kv-groups spec is a comma list such as 'full' or 'full,swa:4'")
    out = []
    for part in str(spec).split(","):
        kind, _, arg = part.strip().partition(":")
        if kind == "full" and not arg:
            out.append(Group("full"))
        elif kind in ("swa", "chunked", "compressed") and arg.isdigit() and int(arg) >= 1:
            out.append(Group(kind, int(arg)))
        elif kind == "mamba":
            raise ValueError("kv group 'mamba' is not supported by the reference model")
        else:
            raise ValueError(f"bad kv group {part.strip()!r}: expected full, swa:W, chunked:C or compressed:R (W, C, R >= 1)")
    return out


def canonical_groups(spec: str) -> str:
    """The spec written back from its groups (``"full, swa:4"`` -> ``"full,swa:4"``); ValueError if bad."""
    return ",".join(str(g) for g in parse_groups(spec))


# -- per-group prefix hits ------------------------------------------------------------
Cached = Callable[[int], bool]   # is logical block i cached (in this group)?


def group_hit(g: Group, cached: Cached, max_len: int, bs: int) -> int:
    """The longest hit (tokens, block-aligned, <= max_len) group ``g`` accepts alone."""
    top = max(max_len, 0) // bs
    if g.whole:
        k = 0
        while k < top and cached(k):
            k += 1
        return k * bs
    if g.kind == "swa":
        # A hit at k blocks needs the ceil((W-1)/bs) blocks before it (at least one), or
        # every block from 0 when there are fewer.
        need = max(1, cdiv(g.size - 1, bs))
        for k in range(top, 0, -1):
            if all(cached(i) for i in range(max(0, k - need), k)):
                return k * bs
        return 0
    # chunked: the blocks of max_len's own chunk, from its first block on
    start = (max_len // g.size * g.size if max_len > 0 else 0) // bs
    start = min(start, top)
    k = start
    while k < top and cached(k):
        k += 1
    return k * bs


def needed_blocks(g: Group, hit: int, bs: int) -> range:
    """The logical blocks of a ``hit``-token hit that group ``g`` takes from the cache;
    the others are null in its table."""
    k = hit // bs
    if g.whole or k == 0:
        return range(0, k)
    if g.kind == "swa":
        return range(max(0, k - max(1, cdiv(g.size - 1, bs))), k)
    return range(min((hit // g.size * g.size) // bs, k), k)


def agreed_hit(groups: list[Group], cached_in: Callable[[int], Cached], max_len: int, bs: int) -> int:
    """The hit length every group accepts: lower the candidate until none lowers it."""
    cur = max(max_len, 0) // bs * bs
    while True:
        x = cur
        for gi, g in enumerate(groups):
            x = group_hit(g, cached_in(gi), x, bs)
        if x == cur:
            return cur
        cur = x


def eagle_hit(groups: list[Group], cached_in: Callable[[int], Cached], max_len: int, bs: int) -> int:
    """The hit every group serves under EAGLE/MTP: the longest ``L`` that every group
    accepts (as ``agreed_hit`` reads it) and whose next block, the one EAGLE matches and
    drops so that the drafter recomputes it, is cached in every group and within
    ``max_len`` (a full group keeps L/bs+1 blocks from 0, a window group its window
    before L plus block L/bs: the one extra contiguous block). The drop is applied once
    per candidate: a lookup that drops it again on a retry pass loses a hit this proves
    available (H10 of reports/vllm-history.md). Chunked local groups take no EAGLE drop
    (vLLM asserts it), so they are not described here."""
    for k in range(max(max_len, 0) // bs - 1, 0, -1):
        hit = k * bs
        if all(cached_in(g)(k) and group_hit(grp, cached_in(g), hit, bs) == hit for g, grp in enumerate(groups)):
            return hit
    return 0


def accepted(groups: list[Group], cached_in: Callable[[int], Cached], hit: int, bs: int) -> bool:
    """Whether every group accepts a ``hit``-token prefix hit (block-aligned)."""
    return hit % bs == 0 and all(group_hit(g, cached_in(gi), hit, bs) == hit for gi, g in enumerate(groups))


# -- extra keys -----------------------------------------------------------------------
@dataclass(frozen=True)
class Extra:
    """A request's extra keys, as identities. ``lora`` names an adapter by its name and
    path (``lora:NAME@PATH``; the path is the name when left out), as vLLM keys it: two
    adapters may share a name (at two paths), and a salt or a multimodal hash may equal an
    adapter's name without naming the same thing, since each kind keeps its own place in
    the key. ``mm`` is in offset order: the same item at another offset is another input."""
    lora: Optional[str] = None
    salt: Optional[str] = None
    mm: tuple[tuple[str, int, int], ...] = ()   # (content hash, offset, length)

    def upto(self, end: int) -> tuple:
        """What, besides the tokens, the KV of positions < ``end`` depends on (or who may
        share it): LoRA, salt, and the multimodal inputs starting before ``end``. A
        multimodal hash names its content, so its length is not part of the key."""
        mm = tuple((h, o) for h, o, _ in self.mm if o < end)
        if self.lora is None and self.salt is None and not mm:
            return ()
        return (self.lora, self.salt, mm)


def parse_extra(label: Optional[str]) -> Extra:
    if not label:
        return Extra()
    lora = salt = None
    mm = []
    for item in label.split(";"):
        kind, _, value = item.partition(":")
        if kind == "lora" and value and not value.startswith("@"):
            name, _, path = value.partition("@")
            lora = name if path in ("", name) else f"{name}@{path}"   # one spelling per adapter
        elif kind == "salt" and value:
            salt = value
        elif kind == "mm" and "@" in value:
            h, _, where = value.partition("@")
            off, _, length = where.partition("+")
            if not h or not off.isdigit() or (length and (not length.isdigit() or int(length) < 1)):
                raise ValueError(f"bad multimodal key {item!r}: expected mm:HASH@OFFSET[+LENGTH]")
            mm.append((h, int(off), int(length) if length else 1))
        else:
            raise ValueError(f"bad extra key {item!r}: expected lora:NAME[@PATH], salt:S or mm:HASH@OFFSET[+LENGTH]")
    return Extra(lora, salt, tuple(sorted(mm, key=lambda m: m[1])))


# -- which part of an identity a hash collision lost ------------------------------------------
def _parts(key) -> tuple:
    """A content key (``prefix`` of group 0 without extra keys, or ``(group, extra, prefix)``,
    see ``GroupCacheModel.gkey``) -> ``(group, lora, salt, mm, prefix)``."""
    if isinstance(key, tuple) and len(key) == 3 and isinstance(key[2], tuple) and isinstance(key[1], tuple) \
            and len(key[1]) in (0, 3):
        g, extra, prefix = key
        lora, salt, mm = extra or (None, None, ())
        return g, lora, salt, mm, prefix
    return 0, None, None, (), key


def lost_identity(a, b) -> str:
    """What tells apart two content keys that a target hashed alike: the part of the
    identity its hash leaves out, named for the bug it stands for (a LoRA name read as a
    salt, one name for two adapters, a multimodal item's offset, ...). Two collisions that
    lose different parts are distinct bugs (``Violation.where`` of HASH_CHAIN), so a search
    goes on past the first to the next."""
    ga, la, sa, ma, pa = _parts(a)
    gb, lb, sb, mb, pb = _parts(b)
    lost = []
    if pa != pb:
        lost.append("tokens")
    if ga != gb:
        lost.append("group")
    if la != lb and sa != sb and (la, sa) == (sb, lb):
        lost.append("lora name vs salt")   # the same string in the other kind's place
    else:
        if la != lb:
            same_name = None not in (la, lb) and la.partition("@")[0] == lb.partition("@")[0]
            lost.append("lora path" if same_name else "lora")
        if sa != sb:
            lost.append("salt")
    if ma != mb:
        same_items = [h for h, _ in ma] == [h for h, _ in mb]
        lost.append("mm offset" if same_items else "mm")
    return "key part: " + (", ".join(lost) or "none")
