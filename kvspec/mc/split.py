"""The catalogue's checks split by what they read, for checking a state once.

A *transition check* reads something of the step itself: a ``StepContext`` field in
``TRANSITION_FIELDS`` (the observation before, the op, what the target returned, what
the model expected, a misuse or an error). A *state check* reads only the state after
the step: the observation, the model, the hash history, the shadow KV store (and the
fixed config and traits), and possibly ``comparable``. ``comparable`` is made of the
step (op, result, expected, misuse, error), so a state check that reads it is a
function of the post-state *on a comparable step* only: ``StepChecker`` therefore runs
every check, as ``check_step`` does, on a step that is not comparable, and the search
lets only comparable steps mark a state as checked (``last_comparable``).

A check that names the hash history or the shadow KV store (``ctx.hashes``,
``ctx.shadow``) is a transition check: it may write them (HASH_CHAIN records every
target hash / content pair in the hash history, which is part of the state key, so it
must run before the key is taken, on every step).

The split is read from each check's *compiled code* (the names its bytecode uses,
``co_names``, with its nested code and the same-module functions it names), never from
its source file: the code is what runs, while a source file edited during a long
search would describe other code (an early version read the source, and a check edited
under a running search was classified from the wrong lines). A name is not tied to
``ctx`` there, so any use of a step field's name, on any object, makes a transition
check, and so does naming a function of another module (it might be handed ``ctx``):
a doubt always lands on the side that runs every step.

``StepChecker`` is the search's ``Session.step_check``: it runs the transition checks
on every step and keeps the step's context, so that ``state_violations()`` can run the
state checks on it once the search knows the post-state is not yet checked. At pool
level it first asks ``kvspec.spec.fast_pool.pool_transition_clean`` (every transition
check in one pass, answering "clean" only when sure, and recording HASH_CHAIN's pairs
as the check would); on any doubt the catalogue's transition checks run as before, so
a finding and its message are always theirs.
"""
from __future__ import annotations

import types
from typing import Callable, Optional

from kvspec.spec.fast_pool import COVERS, commit, pool_transition_clean
from kvspec.spec.invariants import CHECKS, PRIORITY, StepContext
from kvspec.spec.violation import Violation

# names that make a transition check: the step's fields, and the check history it may write
TRANSITION_FIELDS = frozenset({"prev", "op", "result", "expected", "misuse", "error", "hashes", "shadow"})
UNFOLLOWED = "<names a function of another module>"


def _codes(code: types.CodeType):
    yield code
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            yield from _codes(c)


def _reads(fn: Callable, seen: Optional[set] = None) -> set[str]:
    """The names ``fn``'s code uses, with those of the same-module functions it names;
    ``UNFOLLOWED`` where it names a function of another module."""
    seen = set() if seen is None else seen
    if fn in seen:
        return set()
    seen.add(fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        return {UNFOLLOWED}
    out: set[str] = set()
    g = getattr(fn, "__globals__", {})
    for c in _codes(code):
        for name in c.co_names:
            out.add(name)
            v = g.get(name)
            if isinstance(v, types.FunctionType) and v.__module__ == fn.__module__:
                out |= _reads(v, seen)
            elif callable(v) and not isinstance(v, type):
                out.add(UNFOLLOWED)   # a function of another module, a builtin, a partial ...
    return out


def is_state_check(fn: Callable) -> bool:
    reads = _reads(fn)
    return UNFOLLOWED not in reads and not (reads & TRANSITION_FIELDS)


def split_checks(checks: Optional[list] = None) -> tuple[list[int], list[int]]:
    """Indexes into ``checks`` (default ``CHECKS``): (state checks, transition checks)."""
    checks = CHECKS if checks is None else checks
    state = [i for i, fn in enumerate(checks) if is_state_check(fn)]
    return state, [i for i in range(len(checks)) if i not in state]


def _ordered(per_check: dict[int, list[Violation]]) -> list[Violation]:
    # exactly check_step's order: catalogue order, then a stable sort by PRIORITY
    found = [v for i in sorted(per_check) for v in per_check[i]]
    return sorted(found, key=lambda v: PRIORITY.index(v.invariant))


class StepChecker:
    """``Session.step_check`` for the search: transition checks now, state checks on demand."""

    def __init__(self, fast: bool = True) -> None:
        self.state_idx, self.transition_idx = split_checks()
        self.ctx: Optional[StepContext] = None
        self.found: dict[int, list[Violation]] = {}
        self.last_comparable = False   # the last step was comparable (and its state checks are pending)
        # the pool level's transition checks in one pass (kvspec.spec.fast_pool): used only
        # while it stands for every transition check of the catalogue
        self.fast = pool_transition_clean if fast else None
        # transition checks the one pass does not repeat (none today: a check added to the
        # catalogue later): run as they are beside it, so it stands for every transition
        # check; at most a few, or the fast pass is not worth it
        self.beside = [i for i in self.transition_idx if CHECKS[i].__name__ not in COVERS]
        if len(self.beside) > 2:
            self.fast = None
        self.fast_steps = 0

    def __call__(self, ctx: StepContext) -> list[Violation]:
        if self.fast is not None:
            pairs = self.fast(ctx)
            if pairs is not None and self.beside and any(CHECKS[i](ctx) for i in self.beside):
                pairs = None  # a finding: the full path below reports it in the catalogue's order
            if pairs is not None:
                # every transition check finds nothing (so the step is comparable); the
                # state checks stay pending, exactly as below
                if pairs:
                    commit(ctx.hashes, pairs)
                self.ctx, self.last_comparable, self.found = ctx, True, {}
                self.fast_steps += 1
                return []
        if not ctx.comparable:
            # a state check reading ``comparable`` is a function of the state only on a
            # comparable step: here every check runs, exactly check_step
            self.ctx, self.last_comparable = None, False
            return _ordered({i: fn(ctx) for i, fn in enumerate(CHECKS)})
        self.ctx, self.last_comparable = ctx, True
        self.found = {i: CHECKS[i](ctx) for i in self.transition_idx}
        return _ordered(self.found)

    def state_violations(self) -> list[Violation]:
        """The whole step's findings (``check_step``'s list) once the state checks ran too;
        [] when they already ran with the rest (a step that was not comparable) or the
        step went the incremental way (which checked everything)."""
        if self.ctx is None:
            return []
        per = dict(self.found)
        per.update({i: CHECKS[i](self.ctx) for i in self.state_idx})
        self.ctx = None
        return _ordered(per)

    def reset(self) -> None:
        self.ctx, self.last_comparable = None, False

    def names(self) -> dict[str, list[str]]:
        return {"state": [CHECKS[i].__name__ for i in self.state_idx],
                "transition": [CHECKS[i].__name__ for i in self.transition_idx]}
