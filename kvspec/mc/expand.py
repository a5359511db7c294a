"""One state's expansion: every enabled op driven from it, checked and keyed. The one
loop that both the one-process search (``kvspec.mc.search``) and each process of the
parallel one (``kvspec.mc.parallel``) run, so they try the same transitions in the same
order and decide alike what each one found.

``Expander.expand`` yields only the transitions that matter to the caller, in op order:

* ``FOUND``: a check failed and the failure ends the search (without ``invariant=``
  any failure does; with it only that invariant's): the caller stops there;
* ``PRUNED``: a check failed on another invariant (``invariant=``): a dead end;
* ``NEW``: the post-state's key is not yet known: ``(key, checked, session, extra)``,
  the session live *until the generator is resumed* (the caller saves it first);
* ``RECHECKED``: a known key whose state checks were pending (``unchecked``) ran them
  now, on a comparable step, and they found nothing.

A transition into a known key whose checks already ran yields nothing. The state checks
run once per key, as ``kvspec.mc.search``'s docstring argues: where the key is new, or
pending, and the step is comparable. ``checked`` in a ``NEW`` record is False where the
step was not comparable (every check ran, but the key stays pending). Which keys are
known is the caller's: the search's seen set, or a parallel process's seen set plus
what it found this level (``also_seen``). ``transitions`` and ``state_checks`` count what ran.
"""
from __future__ import annotations

from typing import Any, Callable, Collection, Iterator, Optional

from kvspec.mc.fork import Fork
from kvspec.spec.violation import Violation

FOUND, PRUNED, NEW, RECHECKED = "found", "pruned", "new", "rechecked"


class Expander:
    """The per-search parts of an expansion, and its counters."""

    def __init__(self, forker: Fork, ops_of: Callable, key_of: Callable, checker: Any,
                 next_extra: Optional[Callable[[dict, Any], dict]], invariant: Optional[str],
                 check: Optional[Callable[[], None]] = None) -> None:
        self.forker, self.ops_of, self.key_of, self.checker = forker, ops_of, key_of, checker
        # ``next_extra`` None: the extra never changes (the pool level), so no call per transition
        self.next_extra, self.invariant = next_extra, invariant
        # the caps (kvspec.mc.budget.Budget.check), asked before each transition: one
        # state's expansion can be long (thousands of ops) or large (each op a whole state)
        self.check = check if check is not None else _no_check
        self.transitions = 0     # ops tried (each a real step of the target plus its checks)
        self.state_checks = 0    # state checks run once per key (a failing step's full list not counted)

    def _ends(self, found: list[Violation]) -> str:
        return FOUND if self.invariant is None or found[0].invariant == self.invariant else PRUNED

    def expand(self, saved: Any, obs: Any, extra: dict, seen: set, unchecked: set,
               also_seen: Collection = ()) -> Iterator[tuple]:
        """``(op index, op, kind, payload)`` for each transition that matters (see above).
        A key is known when it is in ``seen`` or ``also_seen``."""
        fk, checker, key_of, next_extra, cap = self.forker, self.checker, self.key_of, self.next_extra, self.check
        cap()
        s: Any = fk.load(saved, obs)
        ops = self.ops_of(s, extra)
        misuses = ops.misuses
        t0 = self.transitions   # (kept current before each op, so a stop mid-state counts what ran)
        for i, op in enumerate(ops):
            self.transitions = t0 + i
            if i:
                s = None   # (a session built by the fork goes before the next one is built)
                cap()
                s = fk.load(saved, obs)   # each op from the saved state
            if checker is not None:
                checker.reset()
            found = s.apply(op, misuses[i])
            if found and checker is not None:
                found = checker.state_violations() or found   # a failing step: every check, as check_step
            if found:
                self.transitions = t0 + i + 1
                yield i, op, self._ends(found), found
                continue
            ex2 = extra if next_extra is None else next_extra(extra, op)
            k = key_of(s, ex2)
            new = k not in seen and k not in also_seen
            checked = True
            if checker is not None and (new or k in unchecked):
                # the state checks, once per key (see kvspec.mc.search's docstring)
                if checker.last_comparable:
                    self.state_checks += 1
                    found = checker.state_violations()
                    if found:
                        self.transitions = t0 + i + 1
                        yield i, op, self._ends(found), found
                        continue
                else:
                    checked = False   # every check ran, but on a step that was not comparable
            if new:
                self.transitions = t0 + i + 1
                yield i, op, NEW, (k, checked, s, ex2)
            elif checked and k in unchecked:
                self.transitions = t0 + i + 1
                yield i, op, RECHECKED, k
        self.transitions = t0 + len(ops)


def _no_check() -> None:
    pass
