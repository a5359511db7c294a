"""What a target prints, kept apart from what kvspec prints.

A target that calls ``print()`` must not break ``--json`` (stdout is one JSON object)
or bury kvspec's own lines, yet what it printed is often the best clue to a finding.
So every target call runs with ``sys.stdout`` and ``sys.stderr`` pointing at a
``Tail``: a write-only text stream that keeps the last ``LIMIT`` characters, in the
order written (stdout and stderr interleaved, as a terminal would show them). The
session attaches the tail to the findings it returns (``Violation.target_output``).

Cost. Swapping the two ``sys`` attributes before a call and back after is four
attribute stores, a fraction of a microsecond, against hundreds of microseconds per
step (see ``tests/test_target_isolation.py``'s docstring for the measurement); a
``contextlib.redirect_stdout`` pair costs several times that, and an fd-level capture
(``dup2``, a pipe to drain) far more, so neither is used.

What it does not catch: writes made straight to file descriptors 1 and 2 (a C
extension's ``printf``, ``os.write(1, ...)``) or to ``sys.__stdout__``; and writes from
threads other than the one making the call (kvspec's own progress line runs in one and
must get through). Those go where they always went.
"""
from __future__ import annotations

import io
import sys
import threading
from contextlib import contextmanager
from typing import Any, Iterator

LIMIT = 4096   # characters kept per session: the last ones, which are the ones next to the finding


class Tail:
    """The last ``limit`` characters a target wrote, stdout and stderr together."""

    def __init__(self, limit: int = LIMIT) -> None:
        self.limit = limit
        self._chunks: list[str] = []
        self._size = 0
        self.total = 0   # characters ever written (the tail may hold fewer)

    def add(self, s: str) -> None:
        self._chunks.append(s)
        self._size += len(s)
        self.total += len(s)
        if self._size > 2 * self.limit:
            self._trim()

    def _trim(self) -> None:
        text = "".join(self._chunks)[-self.limit:]
        self._chunks, self._size = [text], len(text)

    def text(self) -> str:
        """The last ``limit`` characters written, after a note when more came before."""
        if not self.total:
            return ""
        self._trim()
        text = self._chunks[0]
        if self.total > len(text):
            return f"[... {self.total - len(text)} earlier characters not kept]\n" + text
        return text


class Stream(io.TextIOBase):
    """What ``sys.stdout`` / ``sys.stderr`` are during a target call: writes from the
    thread that made the stream go to ``tail``; any other thread's (kvspec's progress
    line) pass through to ``passthrough``, the stream it replaced."""

    encoding = "utf-8"
    errors = "replace"

    def __init__(self, tail: Tail, passthrough: Any, name: str) -> None:
        super().__init__()
        self.tail = tail
        self.passthrough = passthrough
        self.name = name
        self.owner = threading.get_ident()

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        if threading.get_ident() != self.owner:
            return self.passthrough.write(s) if self.passthrough is not None else len(s)
        if not isinstance(s, str):
            raise TypeError(f"write() argument must be str, not {type(s).__name__}")
        self.tail.add(s)
        return len(s)

    def isatty(self) -> bool:
        return False


def streams(tail: Tail) -> tuple[Stream, Stream]:
    """(stdout, stderr) writing to ``tail``, passing other threads' writes to today's sys streams."""
    return Stream(tail, sys.stdout, "<target stdout>"), Stream(tail, sys.stderr, "<target stderr>")


@contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """During the block, ``sys.stdout`` is ``sys.stderr``: for target code kvspec runs
    outside a session (importing the target's module, probing a factory), whose prints
    the user should still see but never in stdout, which under ``--json`` is one JSON object."""
    saved = sys.stdout
    sys.stdout = sys.stderr
    try:
        yield
    finally:
        sys.stdout = saved
