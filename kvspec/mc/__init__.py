"""Explicit-state model checking (``kvspec mc``): breadth-first ``search`` over every
state of a small configuration, the ops a state enables (``enumerate_ops``; the cache
features' small domains in ``cache_features``), canonical
state keys under symmetry (``canonical``), the ways to fork a session (``fork``), the
catalogue split into state and transition checks (``split``), the parallel search
(``parallel``) and the ``command``.

May import: spec, targets, errors, ``kvspec.check.session`` and ``kvspec.check.repro``.
"""
from __future__ import annotations

from .enumerate_ops import Bounds
from .search import MCResult, confirm, model_check

__all__ = ["Bounds", "MCResult", "confirm", "model_check"]
