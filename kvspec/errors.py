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
