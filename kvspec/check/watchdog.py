"""A per-op time limit on target calls (``--op-timeout``): a call that does not return
becomes a ``NO_HANG`` finding instead of hanging kvspec.

On the main thread (``kvspec check``, pytest's own thread) the call runs where it is.
It only records ``(call id, deadline)`` (a tuple assignment and a clock read: well
under a microsecond, where a ``setitimer`` pair per call cost about 10 us); one daemon
thread, started on first use, wakes a few times a second and, when a call is past its
deadline, sends the main thread ``SIGALRM``. The handler raises ``OpTimeout`` only if
that same call is still running, so a late signal is ignored. A sleeping or looping
pure-Python call is interrupted this way; a C call that never releases the GIL cannot
be (nothing in the process can run then).

Elsewhere (a worker thread, or a platform without ``pthread_kill``) the call runs in a
daemon thread joined with the limit. A hung thread cannot be killed: the caller gets
``OpTimeout``, must treat the target as dead (the session stops using it), and the
thread is abandoned; being a daemon it does not keep the process alive.

A target that catches ``OpTimeout`` and goes on hanging is signalled again every
second; after ``GIVE_UP_S`` more seconds the process exits (code 1) with one line on
stderr, so kvspec never hangs.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Optional

DEFAULT_OP_TIMEOUT = 10.0
_default: Optional[float] = DEFAULT_OP_TIMEOUT
POLL_S = 0.25        # how often the watchdog thread looks at the running call
GIVE_UP_S = 10.0     # after the first signal, how long a call that swallows it may go on
_active: Optional[tuple] = None   # (call id, deadline, seconds) of the main thread's running call
_fired: Optional[int] = None      # the call id the last signal was meant for
_seq = 0
_watcher: Optional[threading.Thread] = None


class OpTimeout(BaseException):
    """A target call ran past the op timeout. A BaseException, so that a target's own
    ``except Exception`` cannot swallow it."""

    def __init__(self, seconds: float = 0.0) -> None:
        super().__init__(f"no return within {seconds:g} s")
        self.seconds = seconds


def set_default(seconds: Optional[float]) -> None:
    """The op timeout of every session created from now on (None or <= 0: off)."""
    global _default
    _default = seconds if seconds and seconds > 0 else None


def default() -> Optional[float]:
    return _default


_previous: Any = None  # the SIGALRM handler ours replaced (pytest-timeout's, say): alarms not ours go there


def _on_alarm(signum, frame) -> None:
    a = _active
    if a is not None and a[0] == _fired:
        raise OpTimeout(a[2])
    if callable(_previous):
        _previous(signum, frame)


def _watch(main_ident: int) -> None:
    global _fired
    cur = (None, 0.0, 0.0)  # (call id, first signal, last signal)
    while True:
        a = _active
        now = time.monotonic()
        if a is None or now < a[1]:
            time.sleep(POLL_S if a is None else min(POLL_S, a[1] - now))
            continue
        if cur[0] == a[0]:
            if now - cur[1] > GIVE_UP_S:
                sys.stderr.write(f"kvspec: NO_HANG: a target call did not return within {a[2]:g} s and could not "
                                 f"be interrupted; exiting\n")
                sys.stderr.flush()
                os._exit(1)
            if now - cur[2] < 1.0:  # signalled again each second while the same call goes on
                time.sleep(POLL_S)
                continue
            cur = (a[0], cur[1], now)
        else:
            cur = (a[0], now, now)
        _fired = a[0]
        if signal.getsignal(signal.SIGALRM) is not _on_alarm:
            # Someone replaced our handler since (a test, pytest-timeout): raise in the main
            # thread directly; the signal below still wakes a sleeping call.
            import ctypes
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(main_ident), ctypes.py_object(OpTimeout))
        signal.pthread_kill(main_ident, signal.SIGALRM)


def _main_thread_ok() -> bool:
    global _watcher, _previous
    if not hasattr(signal, "pthread_kill") or threading.current_thread() is not threading.main_thread():
        return False
    current = signal.getsignal(signal.SIGALRM)
    if current is not _on_alarm:
        _previous = current
        signal.signal(signal.SIGALRM, _on_alarm)  # the main thread only: here it is
    if _watcher is None or not _watcher.is_alive():
        _watcher = threading.Thread(target=_watch, args=(threading.get_ident(),), daemon=True,
                                    name="kvspec-watchdog")
        _watcher.start()
    return True


_MAIN = threading.main_thread()
_MAIN_IDENT = _MAIN.ident   # compared with threading.get_ident() on every call (a C call, cheap)
_get_ident = threading.get_ident
_mono = time.monotonic


def _after_fork() -> None:  # a forked child (kvspec check --jobs) has no watchdog thread yet
    global _watcher, _MAIN, _MAIN_IDENT, _active
    _watcher, _active, _MAIN = None, None, threading.main_thread()
    _MAIN_IDENT = _MAIN.ident


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


def guarded(seconds: Optional[float], fn: Callable, *args: Any) -> Any:
    """``fn(*args)``, raising ``OpTimeout`` if it has not returned within ``seconds``."""
    global _active, _seq
    if not seconds:
        return fn(*args)
    if (_watcher is None or _get_ident() != _MAIN_IDENT) and not _main_thread_ok():
        return _in_thread(seconds, fn, args)
    _seq += 1
    _active = (_seq, _mono() + seconds, seconds)
    try:
        return fn(*args)
    finally:
        _active = None


def _in_thread(seconds: float, fn: Callable, args: tuple) -> Any:
    box: dict = {}

    def run() -> None:
        try:
            box["result"] = fn(*args)
        except BaseException as e:  # handed back to the caller's thread
            box["error"] = e

    t = threading.Thread(target=run, daemon=True, name="kvspec-op")
    t.start()
    t.join(seconds)
    if t.is_alive():
        raise OpTimeout(seconds)
    if "error" in box:
        raise box["error"]
    return box.get("result")
