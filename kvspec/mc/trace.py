"""How the model checker gets back the path to a state: per state found, its parent's
number and the index of the op (in the parent's list of enabled ops) that reached it,
16 bytes, appended to a file (TLC keeps its trace the same way, on disk).

State 0 is the initial state. ``ParentLog.indices(i)`` walks back from state ``i`` to
it; ``replay_path`` turns those op indices into the ops themselves by replaying them on a
fresh session, asking the same ``ops_of`` the search asked (the enabled ops of a state
are a function of the state, so the i-th op there is the op the search tried).
"""
from __future__ import annotations

import os
import tempfile
from array import array
from typing import Any, Callable, Optional

_FLUSH = 1 << 16   # records buffered before they go to the file


class ParentLog:
    """Append-only (parent, op index) per state, on disk with the newest in memory."""

    def __init__(self, directory: Optional[str] = None, path: Optional[str] = None, initial: bool = True) -> None:
        """A temporary file in ``directory``, gone once closed; or the file ``path``,
        kept (a checkpoint, ``kvspec.mc.distributed``: records already there are read
        back, and ``initial`` applies to a new file only). ``initial``: record 0 is the
        initial state (parent -1)."""
        self.keep = path is not None
        if path is None:   # (unlinked at once: only the open file holds it, so a kill leaves nothing)
            fd, self.path = tempfile.mkstemp(prefix="kvspec-mc-trace-", dir=directory)
            self.f = os.fdopen(fd, "w+b")
            os.unlink(self.path)
        else:
            self.path = path
            self.f = open(path, "a+b")
        self.f.seek(0, os.SEEK_END)
        self.on_disk = self.f.tell() // 16                # records in the file
        fresh = initial and not self.on_disk
        self.parent, self.op = array("q", [-1] if fresh else []), array("i", [-1] if fresh else [])

    def __len__(self) -> int:
        return self.on_disk + len(self.parent)

    def append(self, parent: int, op_index: int) -> int:
        """Record a new state; its number."""
        self.parent.append(parent)
        self.op.append(op_index)
        if len(self.parent) >= _FLUSH:
            self.flush()
        return len(self) - 1

    def flush(self) -> None:
        n = len(self.parent)
        if not n:
            return
        self.f.seek(0, os.SEEK_END)
        rec = array("q", [0]) * (2 * n)
        rec[0::2] = self.parent
        rec[1::2] = array("q", self.op)
        rec.tofile(self.f)
        self.on_disk += n
        self.parent, self.op = array("q"), array("i")

    def record(self, i: int) -> tuple[int, int]:
        """State ``i``'s (parent, op index)."""
        return self._get(i)

    def _get(self, i: int) -> tuple[int, int]:
        if i >= self.on_disk:
            j = i - self.on_disk
            return self.parent[j], self.op[j]
        self.f.seek(16 * i)
        rec = array("q")
        rec.frombytes(self.f.read(16))
        return rec[0], rec[1]

    def indices(self, i: int) -> list[int]:
        """The op indices from the initial state to state ``i``."""
        out = []
        while i > 0:
            i, k = self._get(i)
            out.append(k)
        return out[::-1]

    def close(self) -> None:
        if self.keep:
            self.flush()
            self.f.close()
            return
        self.f.close()

    def __del__(self) -> None:
        if not self.f.closed:
            self.close()


def replay_path(indices: list[int], fresh: Callable[[], Any], ops_of: Callable, extra0: dict,
                next_extra: Callable[[dict, Any], dict]) -> list:
    """The ops of a path given by op indices, replayed from ``fresh()`` (a new session)."""
    s, extra, out = fresh(), extra0, []
    for k in indices:
        ops = ops_of(s, extra)
        op = ops[k]
        s.apply(op, ops.misuses[k])
        extra = next_extra(extra, op)
        out.append(op)
    return out
