"""A breadth-first level's states on disk: an append-only file of packed states, read
back in order, a chunk at a time (TLC keeps its queue of states to explore the same way).

A record is what the search keeps per frontier state: the saved state packed
(``kvspec.mc.pack.encode``), the observation as plain tuples (``parallel.flat_obs``),
the search's per-state ``extra`` and the state's number (``kvspec.mc.trace``). Reading
gives them back in the order written, so the search tries the same transitions in the
same order as with the level in memory.
"""
from __future__ import annotations

import os
import pickle
import tempfile
from typing import Any, Iterator, Optional

_BUFFER = 1 << 20


class DiskFrontier:
    """One level's states, appended and then read back once, in order. The file is
    unlinked as soon as it is made (only the open file holds it), so a search that is
    killed leaves nothing behind."""

    def __init__(self, directory: Optional[str] = None) -> None:
        fd, path = tempfile.mkstemp(prefix="kvspec-mc-level-", dir=directory)
        self.f = os.fdopen(fd, "w+b", buffering=_BUFFER)
        os.unlink(path)
        self.n = 0
        self.bytes = 0

    def __len__(self) -> int:
        return self.n

    def append(self, record: Any) -> None:
        self.f.write(pickle.dumps(record, pickle.HIGHEST_PROTOCOL))
        self.n += 1

    def __iter__(self) -> Iterator[Any]:
        """The records in the order written."""
        f = self.f
        f.flush()
        self.bytes = f.tell()
        f.seek(0)
        # (a fresh unpickler per record: one unpickler's memo would outlive a record)
        load = pickle.load
        for _ in range(self.n):
            yield load(f)

    def close(self) -> None:
        if not self.f.closed:
            self.f.close()

    def __del__(self) -> None:
        self.close()
