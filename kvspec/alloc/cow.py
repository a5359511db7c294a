"""Copy-on-write, probed (issue 31): a sequence-keyed allocator with ``fork(parent, child)``.

The cache-level vocabulary has no fork, so kvspec checks what any copy-on-write allocator
promises by a probe that leaves a correct allocator as it found it, run by the sequence
front (``kvspec.alloc.seq_manager``) after each admission and step of a sequence P:

1. ``fork(P, C)``: C's table is P's, each of its blocks has one holder more, and the free
   count does not move (a fork takes no block);
2. C writes its next token (``append_slot(C)``): P's table does not change; where P's last
   block is partial (shared, and the token goes into it) C's last block is a fresh one,
   and where the call returns copy operations they include (P's last -> C's new last). A
   write into a block another sequence holds, without a copy, overwrites that sequence's KV;
3. ``free(C)``: the free count and every ref count are back where they were before the fork
   (the copy's source lost its extra holder, nothing leaks).

What the probe finds is reported as ``COPY_ON_WRITE`` findings through the observation
(``Observation.found``), so the step that ran it is the step reported. A refused write (no
free block for the copy) is fine: nothing is checked past it but the free of C."""
from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Optional

COW = "COPY_ON_WRITE"


def copy_pairs(value: Any) -> Optional[list[tuple[int, int]]]:
    """The (src, dst) block pairs an append returned, or None where it returned no copies
    kvspec can read (True, a count, an object without src/dst): then only the tables speak."""
    from kvspec.alloc.pool_driver import block_id

    def pair(x: Any) -> Optional[tuple[int, int]]:
        if isinstance(x, (tuple, list)) and len(x) == 2:
            try:
                return block_id(x[0]), block_id(x[1])
            except (TypeError, ValueError):
                return None
        src = next((getattr(x, f) for f in ("src", "source", "src_block", "from_block") if hasattr(x, f)), None)
        dst = next((getattr(x, f) for f in ("dst", "dest", "target", "dst_block", "to_block") if hasattr(x, f)), None)
        return (block_id(src), block_id(dst)) if src is not None and dst is not None else None

    if value is None:
        return []  # nothing to copy
    if isinstance(value, dict):
        out = []
        for k, v in value.items():
            out += [(block_id(k), block_id(d)) for d in (v if isinstance(v, (list, tuple, set)) else [v])]
        return out
    one = pair(value)
    if one is not None and not (isinstance(value, (list, tuple)) and value and isinstance(value[0], (list, tuple))):
        return [one]
    if isinstance(value, (list, tuple)):
        pairs = [pair(x) for x in value]
        return None if any(p is None for p in pairs) else pairs  # type: ignore[return-value]
    return None


class ForkProbe:
    """The probe over one allocator, read through the front's accessors."""

    def __init__(self, fork: Callable[[Any, Any], Any], append: Callable[[Any], Any], free: Callable[[Any], Any],
                 table: Callable[[Any], list], free_count: Callable[[], Optional[int]],
                 refs: Callable[[], Optional[list]], refused: Callable[[Any], bool], names: dict,
                 reports_copies: bool) -> None:
        self.fork, self.append, self.free, self.table = fork, append, free, table
        self.free_count, self.refs, self.refused, self.names = free_count, refs, refused, names
        self.reports_copies = reports_copies  # its append returns something: then the copies it asks for
        self.found: list[tuple[str, str]] = []

    def _say(self, message: str) -> None:
        self.found.append((COW, message))

    def run(self, parent: Any, child: Any, length: int, block_size: int) -> None:
        """The probe on ``parent`` (``length`` tokens in the allocator), forked as ``child``."""
        if self.found:
            return  # one finding is enough: the state behind it is no longer a correct one
        n = self.names
        try:
            self._run(parent, child, length, block_size)
        except Exception as e:
            self._say(f"probing {n['fork']}({parent}, {child}), then {n['append_token']}({child}) and "
                      f"{n['free_sequence']}({child}), raised {type(e).__name__}: {e}")

    def _run(self, p: Any, c: Any, length: int, bs: int) -> None:
        n = self.names
        pt, free0, refs0 = self.table(p), self.free_count(), self.refs()
        self.fork(p, c)
        ct = self.table(c)
        if ct != pt:
            return self._say(f"after {n['fork']}({p}, {c}) the child's table is {ct}, not the parent's {pt}")
        refs1, free1 = self.refs(), self.free_count()
        if refs0 is not None and refs1 is not None:
            extra = Counter(pt)
            wrong = [b for b in sorted(extra) if refs1[b] != refs0[b] + extra[b]]
            if wrong:
                b = wrong[0]
                return self._say(f"after {n['fork']}({p}, {c}) block {b} has ref count {refs1[b]}, not "
                                 f"{refs0[b] + extra[b]}: the child holds it too")
        if free0 is not None and free1 != free0:
            return self._say(f"{n['fork']}({p}, {c}) changed the free count from {free0} to {free1}: a fork shares "
                             f"blocks, it takes none")
        if free1 is None or free1 > 0:
            self._write(p, c, pt, length, bs)
        if self.found:
            return
        self.free(c)
        refs2, free2 = self.refs(), self.free_count()
        if self.table(p) != pt:
            return self._say(f"{n['free_sequence']}({c}) changed the parent's table from {pt} to {self.table(p)}")
        if refs0 is not None and refs2 is not None and list(refs2) != list(refs0):
            b = next(b for b in range(len(refs0)) if refs2[b] != refs0[b])
            return self._say(f"after {n['fork']}({p}, {c}), a write into {c} and {n['free_sequence']}({c}), "
                             f"block {b} has ref count {refs2[b]}, not {refs0[b]} as before the fork")
        if free0 is not None and free2 != free0:
            self._say(f"after {n['fork']}({p}, {c}), a write into {c} and {n['free_sequence']}({c}), the free "
                      f"count is {free2}, not {free0} as before the fork: "
                      + ("a block leaked" if free2 < free0 else "a block the parent holds was freed"))

    def _write(self, p: Any, c: Any, pt: list, length: int, bs: int) -> None:
        n = self.names
        value = self.append(c)
        if self.refused(value):
            return
        ct = self.table(c)
        if self.table(p) != pt:
            return self._say(f"{n['append_token']}({c}) on the forked child changed the parent's table from {pt} "
                             f"to {self.table(p)}")
        if length % bs == 0:
            return  # the token starts a new block: nothing shared is written
        last = pt[-1]
        if ct[-1] == last:
            return self._say(f"{n['append_token']}({c}) writes token {length + 1} into block {last}, which "
                             f"sequence {p} still holds (ref > 1): no copy, so sequence {p}'s KV is overwritten")
        if ct[:-1] != pt[:-1]:
            return self._say(f"{n['append_token']}({c}) changed more than the last block: {pt} became {ct}")
        if last in ct:
            return
        pairs = copy_pairs(value) if self.reports_copies else None  # else it copies by itself
        if pairs is not None and (last, ct[-1]) not in pairs:
            self._say(f"{n['append_token']}({c}) moved the shared block {last} to block {ct[-1]} but returned "
                      f"{value!r}, not the copy ({last}, {ct[-1]}): the new block holds no KV of the prefix")
