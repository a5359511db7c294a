"""Where a target's exception came from: the innermost frame of the target's own code,
and, when a callee inside the target rejected a value (a caller bug), the frame that
passed it.

Under valid use every value kvspec passes is valid, so a callee deep inside the target
that rejects its arguments (a documented misuse error of the target, or ``ValueError``
/ ``TypeError``) was handed a bad value by other code of the target: the manager that
computed a negative block count and passed it to ``BlockPool.get_new_blocks``. That is
a bug of the caller, not a misuse, and the finding names it.

The target's frames are those of the exception's traceback that are not kvspec's own
(modules ``kvspec.*`` but the reference allocator ``kvspec.impl``) and not the standard
library. The callee is the innermost of them together with its outward frames on the
same object (``self``), or, for a plain function, in the same file (a module's own
validation helper is part of the method that calls it); the caller is the next frame
out. A rejection raised by the very call kvspec made has no caller in the target: the
target refused a valid operation, its own bug, not a caller's.
"""
from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import Any, Optional

REJECTIONS: tuple[type[BaseException], ...] = (ValueError, TypeError)  # Python's "bad argument" classes

_STDLIB = tuple(os.path.realpath(p) for p in {sysconfig.get_paths().get(k, "") for k in ("stdlib", "platstdlib")} if p)


@dataclass(frozen=True)
class Frame:
    function: str  # qualified name: BlockPool.get_new_blocks
    file: str      # the file's base name
    line: int

    def __str__(self) -> str:
        return f"{self.function} ({self.file}:{self.line})"


@dataclass(frozen=True)
class Blame:
    raised_at: Optional[Frame]  # the innermost frame of the target's code (None: none in the traceback)
    caller: Optional[Frame]     # a caller bug: the target frame that passed the rejected value
    callee: Optional[Frame]     # ... and the outermost frame of the code that rejected it


def _own(frame: FrameType) -> bool:
    """kvspec's own code or the standard library: not the target's."""
    name = str(frame.f_globals.get("__name__", ""))
    if name == "kvspec" or (name.startswith("kvspec.") and not name.startswith("kvspec.impl")):
        return True
    path = frame.f_code.co_filename
    if path.startswith("<"):
        return True  # <frozen ...>, <string>
    real = os.path.realpath(path)
    return any(real.startswith(p + os.sep) for p in _STDLIB) and "-packages" not in real


def _frame(f: FrameType, line: int) -> Frame:
    code = f.f_code
    return Frame(getattr(code, "co_qualname", code.co_name), os.path.basename(code.co_filename), line)


def _self(f: FrameType) -> Any:
    try:
        return f.f_locals.get("self")
    except Exception:
        return None


def target_frames(tb: Optional[TracebackType]) -> list[tuple[FrameType, int]]:
    out = []
    while tb is not None:
        if not _own(tb.tb_frame):
            out.append((tb.tb_frame, tb.tb_lineno))
        tb = tb.tb_next
    return out


class PreconditionBroken(ValueError):
    """A precondition of a target callee that the callee itself does not check (vLLM's
    ``BlockPool.get_new_blocks`` takes a negative count and corrupts its free count),
    checked by a driver at the call: raised with the blame already known, the caller
    being the target frame that made the call (issue 37 part 6)."""

    def __init__(self, message: str, callee: Any, caller: FrameType) -> None:
        super().__init__(message)
        code = getattr(callee, "__func__", callee).__code__   # the callee: a (bound) function of the target
        where = Frame(getattr(code, "co_qualname", code.co_name), os.path.basename(code.co_filename),
                      code.co_firstlineno)
        self.blame = Blame(raised_at=where, caller=_frame(caller, caller.f_lineno), callee=where)


def blame(exc: BaseException, documented: tuple = ()) -> Blame:
    """Where ``exc`` (raised by the target on a valid operation) came from; ``documented``:
    the target's documented misuse error classes (also rejections)."""
    if isinstance(exc, PreconditionBroken):
        return exc.blame
    frames = target_frames(exc.__traceback__)
    if not frames:
        return Blame(None, None, None)
    inner, line = frames[-1]
    raised_at = _frame(inner, line)
    if not isinstance(exc, REJECTIONS + tuple(documented)):
        return Blame(raised_at, None, None)
    obj, file = _self(inner), inner.f_code.co_filename
    callee = raised_at
    for f, ln in reversed(frames[:-1]):
        same = _self(f) is obj if obj is not None else f.f_code.co_filename == file
        if not same:
            return Blame(raised_at, _frame(f, ln), callee)
        callee = _frame(f, ln)
    return Blame(raised_at, None, None)  # raised by the call kvspec made: the target refused a valid op


def crash_words(exc: BaseException, documented: tuple = ()) -> tuple[str, str, str]:
    """(the words a NO_CRASH message adds, ``Violation.where``, ``Violation.caller``)."""
    b = blame(exc, documented)
    if b.raised_at is None:
        return "", "", ""
    if b.caller is None:
        return f" (in {b.raised_at})", str(b.raised_at), ""
    return (f" (in {b.raised_at}); a caller bug, not a misuse: {b.caller} passed "
            f"{b.callee.function} a value it rejects", str(b.raised_at), str(b.caller))
