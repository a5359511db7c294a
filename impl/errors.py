"""The documented exceptions of the reference allocator.

Every misuse raises one of these *before* any state is touched, so a caller that
catches the error sees the pool exactly as it was (kvspec's ATOMIC_REJECT).
"""


class KVCacheError(Exception):
    """Base class of every misuse the reference allocator rejects."""


class InvalidCountError(KVCacheError, ValueError):
    """A block count that is negative or not an int."""


class OutOfBlocksError(KVCacheError, ValueError):
    """More blocks were asked for than the free queue holds."""


class DoubleFreeError(KVCacheError):
    """A block was freed more times than it is held (ref_cnt would go negative)."""


class NullBlockError(KVCacheError):
    """The null block (id 0) was freed, touched or cached: it is never pooled."""


class ForeignBlockError(KVCacheError):
    """A block that belongs to another pool (or to no pool) was passed in."""


class PartialBlockError(KVCacheError):
    """A block without a full-block hash was asked to be cached."""


class HashAlreadySetError(KVCacheError):
    """A block that already carries a hash was cached again (a hash is set once)."""


class UnknownRequestError(KVCacheError, KeyError):
    """A request the manager does not hold blocks for was freed."""


class RequestStateError(KVCacheError, ValueError):
    """A request was looked up for admission while it already holds blocks (it is
    running: a scheduler admits only waiting requests), or with an empty prompt."""
