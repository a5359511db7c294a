"""Fewer cyclic garbage collections while a search runs.

A search allocates a few container objects per transition (observations, contexts,
saved states) and keeps a growing heap of them (the frontier, the keys seen). CPython
runs its cyclic collector every 700 net container allocations by default, and each
run walks the young objects; over a search that was about a fifth of the CPU time
(``model_check`` on pool, 4 blocks, depth 8, no symmetry, side by side: 31.0 CPU s with
the default thresholds, 25.5 s with these, 25.0 s with the collector off).

Almost nothing a search makes is cyclic garbage, so the collector has little to find:
``fewer_collections`` (a context manager, or a decorator as on ``model_check``) raises
the first generation's threshold to ``GEN0`` and the older generations' to at least 50
and 100 for the duration of the search, and puts the old thresholds back afterwards,
also on an exception. The collector
stays on, so cycles are still reclaimed (at most about ``GEN0`` young objects later),
and a forked worker inherits the setting from the search that forked it.
``KVSPEC_GC_THRESHOLD`` overrides ``GEN0`` (``0``: leave the thresholds alone).
"""
from __future__ import annotations

import contextlib
import gc
import os
from typing import Iterator

GEN0 = 100_000


def _gen0() -> int:
    raw = os.environ.get("KVSPEC_GC_THRESHOLD", "").strip()
    try:
        return int(raw) if raw else GEN0
    except ValueError:
        return GEN0


@contextlib.contextmanager
def fewer_collections() -> Iterator[None]:
    """Run the block with the first-generation threshold at ``GEN0`` (never lowered)."""
    old = gc.get_threshold()
    gen0 = _gen0()
    if gen0 <= old[0]:   # 0, or someone already asked for fewer collections: keep theirs
        yield
        return
    gc.set_threshold(gen0, max(old[1], 50), max(old[2], 100))
    try:
        yield
    finally:
        gc.set_threshold(*old)
