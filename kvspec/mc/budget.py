"""The model checker's time and memory caps, checked inside a state's expansion.

A search is bounded by construction:

* before it builds anything, ``refuse_if_too_large`` estimates what one state costs
  (``state_bytes``) and refuses, with one line, a configuration whose single state
  would not fit the memory cap;
* ``Budget.check`` runs before every transition (``kvspec.mc.expand``) and between the
  phases of setting a search up (the initial state, its key, choosing a fork). It stops
  the search (``CapReached``) when the time cap has passed, or when the search has grown
  so far that one more state would not fit (growth + ``state_bytes`` > the cap), so a
  transition that builds or copies a whole state cannot carry the process past its cap;
* ``Budget.guard`` is the backstop for the one thing that cannot be checked from inside:
  a single call that runs long or grows large (building a driver of a million blocks,
  its first observation and check). A watch thread looks every ``WATCH_S`` and, once
  the search is past its time cap by ``GRACE_S`` or past its memory cap itself, sends
  the main thread ``SIGUSR2``, whose handler raises ``CapReached`` there.

``CapReached`` is a ``BaseException``, so a target's ``except Exception`` cannot swallow
it, and not a ``KeyboardInterrupt`` or ``SystemExit``, so ``Session`` does not take it
for the target's own escape (a finding). The search catches it and reports what it
reached, marked incomplete (``kvspec.mc.search``).
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

from kvspec.errors import UsageError

# What one state costs, per block of the pool: the live session (driver, model, hash
# history), its observation and its state key, as the search holds them. Measured once
# as the growth of resident memory (/proc/self/statm, no tracemalloc: it inflates what
# it measures) while building a full Session of impl, reading its observation and taking
# its key (kvspec.mc.canonical): 351 bytes a block at pool level and 335 at cache level
# with 100,000 blocks, 281 with 1,000,000 (the session alone 229-256, the key 33-36); a
# second session (the replay fork builds one per transition) adds about 210. vLLM's
# BlockPool (target vllm, 20,000 blocks): 486. Rounded up to 512 bytes a block, plus a
# fixed part for what does not grow with the pool. A target whose blocks cost more is
# still bounded by the checks before each transition (``Budget.check``) and the watch
# thread.
STATE_BYTES_PER_BLOCK = 512
STATE_BYTES_FIXED = 256 * 1024

WATCH_S = 0.1          # how often the watch thread looks at the clock and the resident memory
GRACE_S = 2.0          # past the time cap, how long a single call may run before it is interrupted
RSS_EVERY_S = 0.02     # Budget.check reads /proc at most this often (the clock every time)


class CapReached(BaseException):
    """The search reached its time or memory cap; ``reason`` says which, in words."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def rss_bytes() -> int:
    """Resident memory of this process (Linux ``/proc/self/statm``; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def state_bytes(num_blocks: int) -> int:
    """About what one state of a pool of ``num_blocks`` blocks costs (see
    ``STATE_BYTES_PER_BLOCK``)."""
    return STATE_BYTES_FIXED + STATE_BYTES_PER_BLOCK * max(num_blocks, 0)


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"


def refuse_if_too_large(num_blocks: int, mem_cap_gib: float) -> None:
    """A ``UsageError`` (one line, exit 2) where one state would not fit the memory cap."""
    need = state_bytes(num_blocks)
    if need > mem_cap_gib * 2**30:
        raise UsageError(f"kvspec mc: one state of {num_blocks:,} blocks takes about {_gib(need)} "
                         f"(about {STATE_BYTES_PER_BLOCK:,} bytes a block), more than --mem-cap {mem_cap_gib:g} GiB: "
                         f"use fewer --blocks or a larger --mem-cap")


class Budget:
    """A search's caps: ``check()`` before each transition; ``where`` names the depth
    being explored, for the reason a stop gives."""

    def __init__(self, time_cap: float, mem_cap_gib: float, num_blocks: int = 0,
                 clock: Callable[[], float] = time.monotonic, rss: Optional[Callable[[], int]] = None) -> None:
        # rss_bytes looked up at each read (not bound at definition), so a test can replace it
        self.clock, self.rss = clock, (rss if rss is not None else lambda: rss_bytes())
        self.time_cap, self.mem_cap_gib = time_cap, mem_cap_gib
        self.start = clock()
        self.deadline = self.start + time_cap
        # The cap is on what the search itself adds: a process that loaded torch and vLLM, or a
        # long-lived test worker, must get the same verdict as a fresh one.
        self.mem_cap = int(mem_cap_gib * 2**30)
        self.rss_at_start = self.rss()
        self.peak = self.rss_at_start
        self.headroom = state_bytes(num_blocks)   # room one more state needs
        self.depth = 0
        self.on_poll: Optional[Callable[[float], None]] = None   # progress, in the searching process
        self._last_rss = float("-inf")
        self._pid = os.getpid()
        self.stopped: Optional[str] = None

    # -- the checks ----------------------------------------------------------------
    def time_reason(self) -> str:
        return f"time cap of {self.time_cap:g} s reached at depth {self.depth}"

    def mem_reason(self, room: bool) -> str:
        return (f"memory cap of {self.mem_cap_gib:g} GiB (grown by the search) reached at depth {self.depth}"
                + (f" (no room for another state of about {_gib(self.headroom)})" if room else ""))

    def sample_rss(self) -> int:
        r = self.rss()
        if r > self.peak:
            self.peak = r
        return r

    def check(self) -> None:
        """Raise ``CapReached`` past the time cap, or where one more state would not fit."""
        now = self.clock()
        if now > self.deadline:
            raise CapReached(self.time_reason())
        if now - self._last_rss >= RSS_EVERY_S or self.headroom * 64 > self.mem_cap:
            # (a state that is a sizeable part of the cap: memory read before every transition)
            self._last_rss = now
            grown = self.sample_rss() - self.rss_at_start
            if self.mem_cap and grown + self.headroom > self.mem_cap:
                raise CapReached(self.mem_reason(grown <= self.mem_cap))
            if self.on_poll is not None and os.getpid() == self._pid:
                self.on_poll(now)

    @property
    def peak_rss_mib(self) -> float:
        return self.peak / 2**20

    # -- the backstop --------------------------------------------------------------
    @contextmanager
    def guard(self) -> Iterator["Budget"]:
        """Interrupt a single call that runs past the caps (see the module docstring).
        On the main thread only, where ``SIGUSR2`` is not taken, and on the real clock (a
        test's made-up clock is for ``check``); elsewhere it only yields."""
        if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_kill") \
                or signal.getsignal(signal.SIGUSR2) not in (signal.SIG_DFL, None) or self.clock is not time.monotonic:
            yield self
            return
        done = threading.Event()
        main = threading.get_ident()
        pending: list[str] = []
        fired: list[bool] = []   # raised once; again only if Python swallowed it (``unraisable``)

        def on_signal(signum: int, frame: Any) -> None:
            if pending and not fired and not done.is_set() and _can_raise_in(frame):
                fired.append(True)
                raise CapReached(pending[-1])

        def watch() -> None:
            while not done.wait(WATCH_S):
                now = self.clock()
                reason = None
                if now > self.deadline + GRACE_S:
                    reason = self.time_reason()
                elif self.mem_cap and self.sample_rss() - self.rss_at_start > self.mem_cap:
                    reason = self.mem_reason(False)
                if reason is not None and not done.is_set():
                    pending.append(reason)
                    signal.pthread_kill(main, signal.SIGUSR2)   # again each WATCH_S until it lands

        old_hook = sys.unraisablehook

        def unraisable(info: Any) -> None:   # raised where Python would only print it: dropped, sent again
            if isinstance(info.exc_value, CapReached):
                fired.clear()
            else:
                old_hook(info)

        signal.signal(signal.SIGUSR2, on_signal)
        sys.unraisablehook = unraisable
        t = threading.Thread(target=watch, name="kvspec-mc-caps", daemon=True)
        t.start()
        try:
            yield self
        finally:
            done.set()
            t.join()
            signal.signal(signal.SIGUSR2, signal.SIG_DFL)
            if sys.unraisablehook is unraisable:
                sys.unraisablehook = old_hook


def _can_raise_in(frame: Any) -> bool:
    """Not inside a ``__del__`` or a gc callback, where Python would swallow the exception
    (the watch thread signals again a moment later)."""
    import gc

    codes = {getattr(cb, "__code__", None) for cb in gc.callbacks}
    f = frame
    for _ in range(8):
        if f is None:
            break
        if f.f_code.co_name == "__del__" or f.f_code in codes:
            return False
        f = f.f_back
    return True
