"""The errors that end a kvspec command with exit code 2 and one line on stderr.

Every package raises these and the CLI catches them; this module imports nothing from
kvspec, so no import runs back up to the command line.
"""
from __future__ import annotations


class KvspecError(Exception):
    """A usage or target error: the message is one line, shown without a traceback."""


class UsageError(KvspecError):
    """Bad arguments or options."""


class TargetError(KvspecError):
    """A target that cannot be loaded or driven: a usage error (exit code 2), never a
    finding against the target."""


class PatchError(KvspecError):
    """A diff that cannot be parsed or does not apply; the message is one line."""


class Interrupted(KeyboardInterrupt):
    """kvspec itself was told to stop: a real Ctrl-C (SIGINT) or a SIGTERM, delivered
    while ``interrupt_handlers`` is active. A KeyboardInterrupt a *target* raises is not
    one of these, so code that runs target calls can tell the two apart."""

    def __init__(self, signum: int) -> None:
        import signal

        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.exit_code = 128 + signum  # the shell's convention: 130 for SIGINT, 143 for SIGTERM


class interrupt_handlers:
    """``with interrupt_handlers(): ...``: SIGINT and SIGTERM raise ``Interrupted`` in the
    main thread (so a command can print what it reached); the old handlers come back
    on exit. Outside the main thread it does nothing (signals cannot be set there)."""

    def __enter__(self) -> "interrupt_handlers":
        import signal
        import threading

        self.saved: dict = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.saved[sig] = signal.signal(sig, raise_interrupted)
        return self

    def __exit__(self, *exc: object) -> None:
        import signal

        for sig, old in self.saved.items():
            signal.signal(sig, old)


def raise_interrupted(signum: int, frame: object) -> None:
    raise Interrupted(signum)

