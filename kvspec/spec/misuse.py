"""Kinds of misuse, and the error class a target documents for each.

The reference models state why an op is a misuse as one line of text (their
``misuse_reason``); ``misuse_kind`` names the kind of that reason, so a target can
document one exception class per kind (``Traits.misuse_error_map``) and ATOMIC_REJECT
can hold it to that class.
"""
from __future__ import annotations

import re
from typing import Any, Optional

MISUSE_KINDS: dict[str, str] = {
    "bad_count": "allocating a negative number of blocks",
    "over_alloc": "allocating more blocks than are free",
    "null_block": "freeing, touching or caching the null block",
    "no_such_block": "naming a block id outside the pool",
    "double_free": "freeing a block more times than it is held",
    "free_unheld": "freeing a block nobody holds",
    "foreign_free": "freeing a block of another pool",
    "touch_unheld": "touching a block that is neither held nor cached",
    "cache_partial": "caching a block that is not full",
    "cache_unheld": "caching a block nobody holds",
    "cache_rehash": "caching a block that already has a hash, or the same block twice in one call",
    "duplicate_request": "admitting a request id that already exists",
    "empty_prompt": "admitting an empty prompt",
    "not_waiting": "re-admitting a request that is not waiting",
    "not_running": "stepping or preempting a request that is not running",
    "unknown_request": "finishing a request that does not exist",
}

# The models' reason texts (kvspec.spec.model.{pool,cache}.misuse_reason), first match wins.
_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"^negative count", "bad_count"),
    (r"^count .* exceeds", "over_alloc"),
    (r"of the null block$", "null_block"),
    (r"which does not exist$", "no_such_block"),
    (r"^double free", "double_free"),
    (r"^free of block .*, which is not held$", "free_unheld"),
    (r"of another pool$", "foreign_free"),
    (r"^touch of block .*neither held nor cached$", "touch_unheld"),
    (r"which is not full$", "cache_partial"),
    (r"^caching block .*, which is not held$", "cache_unheld"),
    (r"already has a hash$|^caching the same block twice$", "cache_rehash"),
    (r"already exists$", "duplicate_request"),
    (r"^empty prompt$", "empty_prompt"),
    (r"is not waiting$", "not_waiting"),
    (r"which is not running$", "not_running"),
)


def misuse_kind(reason: Optional[str]) -> Optional[str]:
    """The kind of a model's misuse reason (None for None; "other" if none matches)."""
    if reason is None:
        return None
    if reason.startswith("finish of request"):
        return "unknown_request"
    for pattern, kind in _PATTERNS:
        if re.search(pattern, reason):
            return kind
    return "other"


def documented_errors(traits: Any, reason: Optional[str]) -> tuple[type[BaseException], ...]:
    """The error classes ``traits`` document for the misuse ``reason``: the class mapped
    to its kind, else the one mapped to "*"; without a map, every documented class. None:
    the target documents no defence for this misuse, and its findings for it are
    robustness findings. A map without "*" documents only the kinds it names (vLLM
    documents one: ``over_alloc`` raises ValueError), as the ``misuse_errors`` key says."""
    pairs = dict(getattr(traits, "misuse_error_map", ()) or ())
    if pairs:
        cls = pairs.get(misuse_kind(reason) or "") or pairs.get("*")
        return () if cls is None else (cls,)
    return tuple(getattr(traits, "misuse_errors", ()) or ())
