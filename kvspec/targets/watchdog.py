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

Never after the call returned. The handler raises only into the call it was sent for
(not when ``_active`` names another call, or none), and not inside a context that
would swallow the exception and print "Exception ignored in ..." after the call went
on and returned (a ``gc`` callback such as Hypothesis's, a ``__del__``): there it sets
a one-frame trace that raises at the next line of the frame the callback interrupted
(``_set_trap``), or, when something else traces (a debugger, coverage), asks the
watchdog to signal again within ``RETRY_S``. ``sys.unraisablehook`` drops
any ``OpTimeout`` swallowed anyway (a weakref callback, say) and asks for the same
retry. A late signal of ours is dropped, never passed on to a SIGALRM handler we
replaced (pytest-timeout's would fail the test).

Bounding a block. ``bounded(seconds)`` is the same limit as a ``with`` block on the
main thread (an import that hangs, say); ``guarded(seconds, fn)`` works on any thread.

Ctrl-C. A ``KeyboardInterrupt`` out of a target call is the target's own (a finding)
unless SIGINT really reached the process: ``note_sigint()`` wraps Python's default
SIGINT handler so that it records the signal before raising, and
``real_interrupt(exc)`` says which it was (``kvspec.errors.Interrupted``, raised by the
CLI's handlers, is always real).
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

DEFAULT_OP_TIMEOUT = 10.0
_default: Optional[float] = DEFAULT_OP_TIMEOUT
POLL_S = 0.25        # how often the watchdog thread looks at the running call
GIVE_UP_S = 10.0     # after the first signal, how long a call that swallows it may go on
RETRY_S = 0.01       # how soon to signal again when the handler could not raise where it landed
_active: Optional[tuple] = None   # (call id, deadline, seconds) of the main thread's running call
_fired: Optional[int] = None      # the call id the last signal was meant for
_pending = False                  # a signal of ours is on its way (so the handler knows it is ours)
_retry = False                    # the handler could not raise where it landed: signal again soon
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
    global _pending, _retry
    if not _pending:  # not ours (an alarm() of someone else's): theirs to handle
        if callable(_previous):
            _previous(signum, frame)
        return
    _pending = False
    a = _active
    if a is None or a[0] != _fired:
        return  # ours, but that call has returned: dropped
    outside = _outside(frame)
    if outside is frame:
        raise OpTimeout(a[2])
    if outside is None or not _set_trap(outside, a):
        _retry = True  # the watchdog signals again soon


_gc_codes: tuple = ()   # the code objects of gc.callbacks, refreshed when that list changes
_gc_seen: tuple = ()


def _swallowing(f) -> bool:
    """Is ``f`` code whose exceptions Python swallows ("Exception ignored in ...")?
    A gc callback (Hypothesis registers one) or a ``__del__``."""
    global _gc_codes, _gc_seen
    code = f.f_code
    if code.co_name == "__del__":
        return True
    import gc
    cbs = tuple(gc.callbacks)
    if cbs != _gc_seen:
        _gc_seen = cbs
        _gc_codes = tuple(c for c in (getattr(cb, "__code__", None) or
                                      getattr(getattr(cb, "__func__", None), "__code__", None) for cb in cbs) if c)
    return code in _gc_codes


def _outside(frame):
    """The frame an exception raised now should be raised in: ``frame`` itself, or, when
    ``frame`` is inside a gc callback or ``__del__`` (or a few calls below one), the frame
    that callback interrupted."""
    f, target = frame, frame
    for _ in range(8):
        if f is None:
            break
        if _swallowing(f):
            target = f.f_back
        f = f.f_back
    return target


_trap: Optional[tuple] = None   # (call id, frame) while an OpTimeout waits for that frame's next event


def _set_trap(frame, a: tuple) -> bool:
    """Raise ``OpTimeout`` at ``frame``'s next line (once the callback the signal landed in
    has returned), through a frame trace function. Only when no one else traces (a
    debugger, coverage): then the caller falls back to signalling again."""
    global _trap
    if _trap is not None or sys.gettrace() is not None:
        return False
    _trap = (a[0], frame)

    def at_next_event(f, event, arg):
        if _trap is None or f is not _trap[1]:
            return None
        _clear_trap()
        cur = _active
        if cur is not None and cur[0] == a[0]:
            raise OpTimeout(a[2])
        return None

    sys.settrace(_no_new_frames)   # line events are delivered only while the thread traces
    frame.f_trace_lines = True
    frame.f_trace = at_next_event
    return True


def _no_new_frames(frame, event, arg):
    return None  # the trap traces one frame, no other


def _clear_trap() -> None:
    global _trap
    t, _trap = _trap, None
    if t is not None:
        t[1].f_trace = None
        if sys.gettrace() is _no_new_frames:
            sys.settrace(None)


def _unraisable(info) -> None:
    """Python swallowed an exception raised where it could not propagate (a gc or
    weakref callback, a ``__del__``). An ``OpTimeout``: dropped, and the watchdog signals
    again. The CLI's ``kvspec.errors.Interrupted`` (a Ctrl-C or SIGTERM that landed in
    such a callback, and would otherwise be lost: the run went on to its budget): the
    same signal is delivered again a moment later. Everything else goes to the hook before."""
    global _retry
    e = info.exc_value
    if isinstance(e, OpTimeout):
        _retry = True
        return
    if type(e).__name__ == "Interrupted" and type(e).__module__ == "kvspec.errors" and getattr(e, "signum", None):
        t = threading.Timer(RETRY_S, signal.pthread_kill, (_MAIN_IDENT, e.signum))
        t.daemon = True
        t.start()
        return
    _previous_unraisable(info)


_previous_unraisable: Callable = sys.unraisablehook


def _watch(main_ident: int) -> None:
    global _fired, _pending, _retry
    cur = (None, 0.0, 0.0)  # (call id, first signal, last signal)
    while True:
        a = _active
        now = time.monotonic()
        if a is None or now < a[1]:
            time.sleep(POLL_S if a is None else min(POLL_S, a[1] - now))
            continue
        if cur[0] == a[0]:
            if now - cur[1] > GIVE_UP_S:
                err = sys.__stderr__ or sys.stderr  # not a target's captured stream
                err.write(f"kvspec: NO_HANG: a target call did not return within {a[2]:g} s and could not "
                          f"be interrupted; exiting\n")
                err.flush()
                os._exit(1)
            wait = RETRY_S if _retry else 1.0  # signalled again each second while the same call goes on
            if now - cur[2] < wait:
                time.sleep(min(POLL_S, wait))
                continue
            cur = (a[0], cur[1], now)
        else:
            cur = (a[0], now, now)
        _retry = False
        _fired = a[0]
        _pending = True
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
    _hook_unraisable()
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


class TargetCalledExit(SystemExit):
    """The target called ``os._exit(code)`` inside a guarded call. Raised in its place,
    so the process lives and the call is a finding (as ``sys.exit()`` is): an
    ``os._exit(0)`` must never end kvspec, or a pytest run of it, with status 0."""

    def __init__(self, code: Any) -> None:
        super().__init__(code)
        self.code = code

    def __str__(self) -> str:
        return f"called os._exit({self.code!r})"


def _target_exit(code: Any = 0) -> None:
    raise TargetCalledExit(code)


def guarded(seconds: Optional[float], fn: Callable, *args: Any) -> Any:
    """``fn(*args)`` with ``os._exit`` turned into ``TargetCalledExit`` while it runs,
    raising ``OpTimeout`` if it has not returned within ``seconds``.

    A call that returns, but after its deadline, raises ``OpTimeout`` too, here, where
    the caller gets it (one clock read): the watchdog thread wakes only every few
    milliseconds, so without this a limit shorter than that (``--op-timeout 0.000001``)
    would catch a call or not by chance, and a replay of the same steps could end
    elsewhere. With it, every call longer than the limit is one, every time.

    One function (no inner call): it runs twice per step of every session, and the model
    checker's steps are a few tens of microseconds."""
    global _active, _seq
    real_exit = os._exit
    os._exit = _target_exit  # the attribute, as `os._exit(0)` looks it up (a copy taken at import escapes this)
    try:
        if not seconds:
            return fn(*args)
        if (_watcher is None or _get_ident() != _MAIN_IDENT) and not _main_thread_ok():
            return _in_thread(seconds, fn, args)
        outer = _active  # a call inside a bounded() block: the block's limit comes back after it
        _seq += 1
        deadline = _mono() + seconds
        _active = (_seq, deadline, seconds)
        try:
            result = fn(*args)
        finally:
            _active = outer
            if _trap is not None:  # a raise that waited for a frame which returned first
                _clear_trap()
        if _mono() > deadline:
            raise OpTimeout(seconds)
        return result
    finally:
        os._exit = real_exit


def _in_thread(seconds: float, fn: Callable, args: tuple) -> Any:
    box: dict = {}

    def run() -> None:
        try:
            box["result"] = fn(*args)
        except BaseException as e:  # handed back to the caller's thread
            box["error"] = e

    t = threading.Thread(target=run, daemon=True, name="kvspec-op")
    deadline = _mono() + seconds
    t.start()
    t.join(seconds)
    if t.is_alive() or _mono() > deadline:
        raise OpTimeout(seconds)
    if "error" in box:
        raise box["error"]
    return box.get("result")


def _hook_unraisable() -> None:
    global _previous_unraisable
    if sys.unraisablehook is not _unraisable:
        _previous_unraisable = sys.unraisablehook
        sys.unraisablehook = _unraisable


@contextmanager
def bounded(seconds: Optional[float] = None) -> Iterator[None]:
    """``with bounded(s): ...``: the block raises ``OpTimeout`` if it runs past ``s``
    seconds (None: the op timeout, ``default()``; 0 or off: no limit). For a block of
    code that calls into the target outside a session, such as importing the target's
    module (which may hang at import). Only the main thread can be interrupted this
    way; elsewhere the block runs unbounded (wrap a function with ``guarded`` there:
    it runs in a joined thread). The caller turns ``OpTimeout`` into its own error."""
    global _active, _seq
    seconds = _default if seconds is None else seconds
    if not seconds or seconds <= 0 or not _main_thread_ok():
        yield
        return
    outer = _active
    _seq += 1
    _active = (_seq, _mono() + seconds, seconds)
    try:
        yield
    finally:
        _active = outer


# -- Ctrl-C ----------------------------------------------------------------------------
_sigints = 0       # SIGINTs Python's default handler has seen since note_sigint()
_sigints_taken = 0


def _noting_int_handler(signum, frame) -> None:
    global _sigints
    _sigints += 1
    signal.default_int_handler(signum, frame)  # raises KeyboardInterrupt, as before


def note_sigint() -> None:
    """Make Python's default SIGINT handler record the signal before raising
    KeyboardInterrupt (so ``real_interrupt`` can tell a Ctrl-C from a target that
    raises KeyboardInterrupt itself). Any other handler is left as it is: the CLI's
    raises ``kvspec.errors.Interrupted``, which tells it apart by type. Main thread only."""
    if threading.current_thread() is not threading.main_thread():
        return
    _hook_unraisable()  # a Ctrl-C raised inside a gc/weakref callback is delivered again (_unraisable)
    try:
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, _noting_int_handler)
    except (ValueError, OSError):  # no signals here (an embedded interpreter)
        pass


def real_interrupt(exc: BaseException) -> bool:
    """Was this KeyboardInterrupt a real Ctrl-C (SIGINT delivered to the process) rather
    than one a target raised? Consumes the record of the SIGINT it accounts for."""
    global _sigints_taken
    from kvspec.errors import Interrupted
    if isinstance(exc, Interrupted):
        return True
    if _sigints != _sigints_taken:
        _sigints_taken = _sigints
        return True
    current = signal.getsignal(signal.SIGINT)
    if current in (_noting_int_handler, signal.default_int_handler, signal.SIG_IGN, signal.SIG_DFL, None):
        return False
    # The CLI's handlers (kvspec.errors.interrupt_handlers) raise Interrupted, checked above.
    # Anyone else's may raise a plain KeyboardInterrupt on a real Ctrl-C without telling
    # us, so there the safe answer is "real" (kvspec stops).
    return getattr(current, "__module__", None) != "kvspec.errors"
