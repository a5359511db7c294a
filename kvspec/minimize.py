"""Cut a failing step list down: delta debugging (ddmin) over the steps, keeping
only candidates that fail with the same invariant id and, for a finding under
valid use, contain no misuse before the failing step."""
from __future__ import annotations

import time
from typing import Optional, Sequence

from .config import Config
from .ops import Op
from .session import Session
from .targets.base import Target


def fails_with(target: Target, config: Config, steps: Sequence[Op], invariant: str, allow_misuse: bool) -> bool:
    """Does ``steps`` fail, at its last step, with ``invariant`` first?"""
    s = Session(target, config)
    if s.initial:
        return s.initial[0].invariant == invariant and not steps
    for i, op in enumerate(steps):
        if not allow_misuse and s.misuse_reason(op) is not None:
            return False
        found = s.apply(op)
        if found:
            return i == len(steps) - 1 and found[0].invariant == invariant
    return False


def ddmin(target: Target, config: Config, steps: Sequence[Op], invariant: str, allow_misuse: bool = False,
          budget_s: float = 10.0) -> list[Op]:
    """Zeller's ddmin: a 1-minimal sub-list that still fails with ``invariant``."""
    deadline = time.monotonic() + budget_s
    cur = list(steps)
    n = 2
    while len(cur) >= 2 and time.monotonic() < deadline:
        chunk = max(len(cur) // n, 1)
        parts = [cur[i:i + chunk] for i in range(0, len(cur), chunk)]
        reduced = False
        for i in range(len(parts)):
            # Try each complement (drop one part); the failing step must stay last.
            cand = [op for j, p in enumerate(parts) if j != i for op in p]
            if cand and fails_with(target, config, cand, invariant, allow_misuse):
                cur, n, reduced = cand, max(n - 1, 2), True
                break
        if not reduced:
            if n >= len(cur):
                break
            n = min(n * 2, len(cur))
    return cur


def minimize(target: Target, config: Config, steps: Sequence[Op], invariant: str, allow_misuse: bool = False,
             budget_s: float = 10.0) -> tuple[list[Op], Optional[bool]]:
    """(shortest steps found, minimal?) where minimal is True only when proven."""
    steps = list(steps)
    if not fails_with(target, config, steps, invariant, allow_misuse):
        return steps, None  # not reproducible in isolation: keep what Hypothesis gave
    return ddmin(target, config, steps, invariant, allow_misuse, budget_s), None
