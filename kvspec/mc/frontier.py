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
    """One level's states, appended and then read back once, in order."""

    def __init__(self, directory: Optional[str] = None) -> None:
        fd, self.path = tempfile.mkstemp(prefix="kvspec-mc-level-", dir=directory)
        self.f = os.fdopen(fd, "wb", buffering=_BUFFER)
        self.n = 0
        self.bytes = 0

    def __len__(self) -> int:
        return self.n

    def append(self, record: Any) -> None:
        self.f.write(pickle.dumps(record, pickle.HIGHEST_PROTOCOL))
        self.n += 1

    def __iter__(self) -> Iterator[Any]:
        """The records in the order written (the file is closed for writing first)."""
        if not self.f.closed:
            self.f.close()
        self.bytes = os.path.getsize(self.path)
        with open(self.path, "rb", buffering=_BUFFER) as f:
            # (a fresh unpickler per record: one unpickler's memo would outlive a record)
            load = pickle.load
            for _ in range(self.n):
                yield load(f)

    def close(self) -> None:
        if not self.f.closed:
            self.f.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass

    def __del__(self) -> None:
        self.close()
