"""The model checker's seen set: 64-bit fingerprints of canonical state keys, as TLC keeps.

A state's key (``kvspec.mc.canonical``, marshalled by ``compact``) is a few hundred bytes;
the search only ever asks whether it has seen one. So it keeps ``fingerprint(key)``, the
xxh3_64 hash of those bytes, in ``FingerprintSet``: an open-addressing table of unsigned
64-bit words (``array('Q')``, at most half full), 16 to 32 bytes a state against the
kilobyte or so of a set of keys.

Two different states with one fingerprint would be merged, and the second one's
successors could go unexplored: the search would under-count, never report a false
violation (a reported counterexample is replayed on the real target). ``collision_odds``
gives the two estimates TLC prints at the end of a run: the optimistic one for n
fingerprints drawn at random, n(n-1)/2 / 2^64, and one from the fingerprints actually
kept, the smallest gap between two sorted fingerprints, 1/min_gap (TLC's "actual
fingerprints" estimate: how close together the real ones fell).
"""
from __future__ import annotations

import pickle
from array import array
from typing import Any, Iterable, Optional

import numpy as np
import xxhash

_hash = xxhash.xxh3_64_intdigest
_EMPTY = 0       # an empty slot; a fingerprint of 0 is kept as 1 (a 2^-64 merge, counted in the odds)
_MIN_SLOTS = 1 << 10


def fingerprint(key: Any) -> int:
    """A key's 64-bit fingerprint (never 0: that marks an empty slot). A key that
    ``compact`` could not marshal (a target's own hash type) is pickled first: equal
    keys that pickle apart only split a state in two, as ``compact`` says."""
    if type(key) is not bytes:
        key = pickle.dumps(key, pickle.HIGHEST_PROTOCOL)
    return _hash(key) or 1


class FingerprintSet:
    """A set of nonzero 64-bit ints, stored as a flat ``array('Q')`` with linear probing.

    Used as the search's ``seen`` (``in``, ``add``, ``len``). Grows by doubling at half
    full; while it grows it holds the old table and the new (three times the table's
    size at the peak, for a moment). ``nbytes`` is the memory of the table itself."""

    __slots__ = ("table", "mask", "n", "limit")

    def __init__(self, items: Iterable[int] = (), slots: int = _MIN_SLOTS) -> None:
        size = _MIN_SLOTS
        while size < slots:
            size <<= 1
        self.table = array("Q", bytes(8 * size))
        self.mask = size - 1
        self.n = 0
        self.limit = size >> 1
        for fp in items:
            self.add(fp)

    def __len__(self) -> int:
        return self.n

    def __contains__(self, fp: int) -> bool:
        t, m = self.table, self.mask
        i = fp & m
        while True:
            v = t[i]
            if v == fp:
                return True
            if v == _EMPTY:
                return False
            i = (i + 1) & m

    def add(self, fp: int) -> bool:
        """Insert ``fp``; True if it was new."""
        t, m = self.table, self.mask
        i = fp & m
        while True:
            v = t[i]
            if v == fp:
                return False
            if v == _EMPTY:
                t[i] = fp
                self.n += 1
                if self.n > self.limit:
                    self._grow()
                return True
            i = (i + 1) & m

    def discard(self, fp: int) -> None:   # (a set's API; the seen set never forgets)
        raise NotImplementedError("a fingerprint set only grows")

    def _grow(self) -> None:
        old = self.table
        size = (self.mask + 1) << 1
        t = array("Q", bytes(8 * size))
        m = size - 1
        for fp in old:
            if fp:
                i = fp & m
                while t[i]:
                    i = (i + 1) & m
                t[i] = fp
        self.table, self.mask, self.limit = t, m, size >> 1

    def __iter__(self):
        return (fp for fp in self.table if fp)

    @property
    def nbytes(self) -> int:
        return self.table.itemsize * len(self.table)

    def to_bytes(self) -> bytes:
        """The fingerprints, for a checkpoint (``from_bytes`` reads them back)."""
        a = np.frombuffer(self.table, dtype=np.uint64)
        return a[a != 0].tobytes()

    @classmethod
    def from_bytes(cls, data: bytes) -> "FingerprintSet":
        fps = array("Q")
        fps.frombytes(data)
        return cls(fps, slots=2 * len(fps) + 2)


def collision_odds(n: int, fps: Optional[Iterable[int]] = None) -> dict:
    """TLC's two estimates of the probability that two of ``n`` distinct states share a
    fingerprint: ``optimistic`` (n(n-1)/2 pairs, each 2^-64) and, given the fingerprints,
    ``actual`` (1 / the smallest gap between two of them, sorted)."""
    out: dict = {"fingerprints": n, "optimistic": n * (n - 1) / 2 / 2.0 ** 64, "actual": None}
    if fps is not None and n > 1:
        if isinstance(fps, FingerprintSet):   # sorted as 8-byte words, not Python ints
            a = np.frombuffer(fps.table, dtype=np.uint64)
            a = np.sort(a[a != 0])
        else:
            a = np.sort(np.fromiter(fps, dtype=np.uint64))
        gap = int(np.diff(a).min())
        out["actual"] = 1.0 / gap if gap else 1.0
    return out
