"""What both machines share: a Session per example, failures as exceptions that
Hypothesis can shrink without sliding from one invariant to another, and the
bookkeeping for robustness findings on targets that document no misuse defence."""
from __future__ import annotations

import re
from functools import lru_cache
from typing import Callable, Optional

from hypothesis.stateful import RuleBasedStateMachine
from hypothesis import strategies as st

from kvspec.spec.config import Config
from kvspec.spec.misuse import documented_errors
from kvspec.spec.ops import Op
from kvspec.check.coverage import note_op
from kvspec.check.session import Session
from kvspec.targets.base import Target
from kvspec.spec.violation import Violation, signature


# Strategies built once per argument (bounded caches): a strategy built per draw is
# validated and labelled again each time, which cost more than the draw (about a tenth of
# a cache-level example, benchmarks/bench_ttf.py). A strategy drawn from is not changed
# by the draw, so the choices, their labels and every example are the same as before.
@lru_cache(maxsize=4096)
def sampled(items: tuple) -> st.SearchStrategy:
    """``st.sampled_from(items)``, once per tuple of items."""
    return st.sampled_from(items)


@lru_cache(maxsize=1024)
def ints(lo: int, hi: int) -> st.SearchStrategy:
    """``st.integers(lo, hi)``, once per range."""
    return st.integers(lo, hi)


_CACHING = st.sampled_from((True, True, True, False))


class InvariantViolation(AssertionError):
    """Raised by a machine when a step breaks an invariant. Carries the evidence."""

    def __init__(self, violations: list[Violation], steps: list[Op], config: Config) -> None:
        self.violations = violations
        self.steps = steps
        self.config = config
        super().__init__(f"{violations[0]}  [after {len(steps)} steps; state: {violations[0].excerpt}]")

    @property
    def invariant(self) -> str:
        return self.violations[0].invariant


_ERRORS: dict[str, type] = {}


def violation_error(invariant: str) -> type:
    # One exception class per invariant id: Hypothesis keys distinct failures on the
    # exception type, so shrinking keeps the invariant it started from.
    if invariant not in _ERRORS:
        _ERRORS[invariant] = type(f"{invariant}Violation", (InvariantViolation,), {})
    return _ERRORS[invariant]


# A directory part of a path inside a target's name: everything up to the last slash of
# a run without spaces, ':' (FILE.py:NAME) or '+' (impl+PATCH).
_DIRECTORIES = re.compile(r"[^\s:+]*[/\\]")


def machine_class_name(kind: str, target: Target) -> str:
    """The name of a machine class bound to ``target``: ``kind`` and the target's name
    with every directory dropped (``CacheMachine_impl+policy_fifo.diff``).

    Hypothesis cannot read the source of a class built at run time, so it digests the
    class's name instead, and that digest seeds a derandomized run (``derandomize=True``,
    the ``ci`` profile) and keys the example database. A name carrying a path
    (``impl+/home/me/kvspec/corpus/impl/x.diff``, ``/abs/bm.py:BlockManager``) drew
    other examples in another checkout, or for another spelling of the same file: the
    same test passed here and failed on a fresh clone. The file names stay, so two
    different patches or files still draw apart."""
    return f"{kind}_{_DIRECTORIES.sub('', target.name)}"


# (violations, steps, config) for a misuse the target has no documented defence for.
# Called with the findings, the steps, the configuration and the misuse reason (the
# model's one-line account of why the last op was a misuse).
RobustnessSink = Callable[[list[Violation], list[Op], Config, str], None]


class KVMachine(RuleBasedStateMachine):
    """Base: subclasses build ``self.session`` in an @initialize rule and call ``run``."""

    target: Target
    misuse: bool = False
    on_robustness: Optional[RobustnessSink] = None
    counters: dict = {"examples": 0, "steps": 0}
    # signatures (kvspec.spec.violation.signature) of bugs already reported: a step that
    # breaks one of them ends its example unreported (kvspec check goes on past a finding)
    excluded: frozenset = frozenset()

    def __init__(self) -> None:
        super().__init__()
        self.session: Optional[Session] = None
        self.tainted = False  # a robustness finding left the target off the model
        type(self).counters["examples"] += 1

    def draw_caching(self, data) -> bool:
        """Prefix caching on or off for this example, from the modes the target declares
        (mostly on where it supports both: most of the catalogue needs a cache)."""
        modes = getattr(self.target.traits, "caching_modes", (True,))
        if len(modes) == 1:
            return modes[0]  # nothing drawn: a one-mode target's examples stay as they were
        return data.draw(_CACHING, label="caching")

    def start(self, config: Config) -> None:
        self.session = Session(self.target, config)
        if self.session.initial and self._known(self.session.initial, None):
            self.tainted = True
        elif self.session.initial:
            raise violation_error(self.session.initial[0].invariant)(self.session.initial, [], config)

    def supports(self, op_name: str) -> bool:
        """Whether the target has an API for this op (``Traits.unsupported_ops``)."""
        return op_name not in getattr(self.target.traits, "unsupported_ops", ())

    def run(self, op: Op) -> None:
        s = self.session
        if s is None or self.tainted:
            return
        if type(op).__name__ in getattr(s.traits, "unsupported_ops", ()):
            return  # the target has no API for it (Traits.unsupported_ops)
        type(self).counters["steps"] += 1
        note_op(op)  # what the run drew (kvspec.check.coverage)
        misuse = s.misuse_reason(op)
        found = s.apply(op)
        if not found:
            return
        # a misuse the target documents no defence for (per kind: vLLM documents one)
        if misuse is not None and not documented_errors(s.traits, misuse) and self.on_robustness is not None \
                and found[0].invariant != "NO_HANG":  # a hang is never a misuse's fair answer
            self.on_robustness(found, list(s.steps), s.config, misuse)
            self.tainted = True
            return
        if self._known(found, op):
            self.tainted = True  # a bug already reported: the rest of this example is not run
            return
        raise violation_error(found[0].invariant)(found, list(s.steps), s.config)

    def _known(self, found: list[Violation], op: Optional[Op]) -> bool:
        return bool(self.excluded) and any(signature(v, op) in self.excluded for v in found)
