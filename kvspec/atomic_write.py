"""Write a report file atomically: to a temporary file in the same directory, then
``os.replace`` onto the name. A reader (or a second run writing the same report
directory) sees the old file or the new one, never a torn one.

A leaf module (it imports nothing from kvspec): report, check, mc, corpus and campaign
all write through it.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Iterator, Union

# The mode a plain open() would give a new file: mkstemp's 0600 would hide reports from
# other users. Read once; os.umask can only be read by setting it.
_UMASK = os.umask(0o022)
os.umask(_UMASK)


@contextlib.contextmanager
def replacing(path: Union[str, os.PathLike]) -> Iterator[Path]:
    """``with replacing(p) as tmp: write tmp``: ``tmp`` becomes ``p`` at once when the
    block ends, and is removed if it raises."""
    p = Path(path)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)
    except OSError:
        pass
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_atomic(path: Union[str, os.PathLike], data: Union[str, bytes]) -> Path:
    """Write ``data`` (text as UTF-8) to ``path`` atomically; returns the path."""
    with replacing(path) as tmp:
        if isinstance(data, str):
            tmp.write_text(data, encoding="utf-8")
        else:
            tmp.write_bytes(data)
    return Path(path)
