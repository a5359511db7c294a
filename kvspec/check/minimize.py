"""Cut a failing step list down to a short, readable, and where possible provably
shortest repro.

1. **ddmin** (Zeller's delta debugging) over the steps, keeping only candidates that
   fail with the same invariant id at their last step and, for a finding under valid
   use, contain no misuse before it.
2. **Canonical names**: requests become ``r1, r2, ...`` and hash labels ``a, b, ...``
   in order of first appearance (kept only if the renamed list still fails the same
   way), so the repro reads simply.
3. **Bounded BFS** (``kvspec.mc``), for findings under valid use, by iterative
   deepening: depth 1 on every configuration of the same level and block size (the
   smallest pool first, up to the failing one), then depth 2 on every one, and so on
   up to the ddmin result's length, stopping at the first failure of the same
   invariant. So the repro is the shortest there is on any of those pools, on the
   smallest pool that has one that short. Deepening matters: a pool too small for the
   bug would otherwise be searched to the full ddmin length first, which at cache
   level can take the whole budget (touch_after_alloc: ddmin leaves 14 steps on 11
   blocks; deepening proves 5 in under 2 s). The search first uses ``mc``'s own
   domains (the cache features' ops included where the target has them), so the repro
   is exactly what ``kvspec mc`` finds on its configuration; only when that finds
   nothing as short as the ddmin result, and the ddmin result uses arguments outside
   them, are the domains widened to include every one (its prompts, tokens, extra
   keys, chunks, connector tokens, drafts, prefill counts, set sizes, ref counts,
   labels and requests).

``minimal`` is True only when a search that ran to completion proves it: no
sequence of fewer steps over the domains searched fails with this invariant on the
repro's configuration. It is None when no search could say (a misuse finding, or the budget
ran out), never a guess.

A hang (``NO_HANG``) is cut down differently, because every replay that reaches the
hanging call waits out the op timeout again (``minimize_hang``): ddmin over the steps
*before* the hanging call, with the reference model as the judge (the shorter prefix
must run clean and leave the hanging call as valid, or as much a misuse of the same
kind, as it was), never calling the hanging op; then at most ONE replay of the cut-down
repro to confirm that it really hangs, and only if that wait ends by ``confirm_by``
(``kvspec check`` passes the end of its budget; None: always). Unconfirmed, or not
hanging, the repro is the steps as found: the observed hang is their confirmation.
``minimal`` stays None: nothing shorter was ruled out.
"""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable, Optional, Sequence

from kvspec.spec.config import Config
from kvspec.spec.ops import (Abort, Admit, Arrive, Cache, CachePartial, Finish, Lookup, Op, Prefill, Preempt, Step,
                             StreamInput, Verify)
from kvspec.check.session import Session, run_steps
from kvspec.spec.violation import signature
from kvspec.targets.base import Target

BFS_BUDGET_S = 45.0     # at most these seconds of bounded BFS per finding, all configurations together
                        # (besides BFS_MAX_STATES): a first run should show the proved-minimal repro
BFS_MAX_DEPTH = 12      # a ddmin result longer than this is not searched
BFS_MAX_STATES = 30_000   # deterministic mode: states of bounded BFS per finding instead of seconds
DDMIN_MAX_TESTS = 1_000   # deterministic mode: candidate replays of ddmin instead of seconds


def fails_with(target: Target, config: Config, steps: Sequence[Op], invariant: str, allow_misuse: bool,
               avoid: frozenset = frozenset()) -> bool:
    """Does ``steps`` fail, at its last step, with ``invariant`` first, and with no
    violation whose signature is in ``avoid`` (another finding's bug: the run's other
    distinct findings, ``kvspec.check.search.run_check``)?"""
    s = Session(target, config)
    if s.initial:
        return s.initial[0].invariant == invariant and not steps and not _known(s.initial, None, avoid)
    for i, op in enumerate(steps):
        if not allow_misuse and s.misuse_reason(op) is not None:
            return False
        found = s.apply(op)
        if found:
            return i == len(steps) - 1 and found[0].invariant == invariant and not _known(found, op, avoid)
    return False


def _known(found: Sequence, op: Optional[Op], avoid: frozenset) -> bool:
    return bool(avoid) and any(signature(v, op) in avoid for v in found)


def ddmin(target: Target, config: Config, steps: Sequence[Op], invariant: str, allow_misuse: bool = False,
          budget_s: float = 10.0, max_tests: Optional[int] = None, avoid: frozenset = frozenset()) -> list[Op]:
    """Zeller's ddmin: a 1-minimal sub-list that still fails with ``invariant`` (unless
    ``budget_s`` seconds or ``max_tests`` candidate replays run out first), never into a
    signature of ``avoid``."""
    deadline = time.monotonic() + budget_s
    return reduce_list(list(steps), lambda cand: bool(cand) and fails_with(target, config, cand, invariant,
                                                                           allow_misuse, avoid),
                       max_tests=max_tests, deadline=deadline)


def reduce_list(cur: list, keeps: Callable[[list], bool], max_tests: Optional[int] = None,
                deadline: Optional[float] = None) -> list:
    """ddmin's loop: drop one of n parts while ``keeps(candidate)`` holds, halving the
    parts when none can go, until 1-minimal or ``max_tests`` / ``deadline`` run out.
    Shared by ``ddmin`` and ``minimize_hang`` (which only asks another question)."""
    n, tests = 2, 0
    while len(cur) >= 2 and (deadline is None or time.monotonic() < deadline) \
            and (max_tests is None or tests < max_tests):
        chunk = max(len(cur) // n, 1)
        parts = [cur[i:i + chunk] for i in range(0, len(cur), chunk)]
        reduced = False
        for i in range(len(parts)):
            # Try each complement (drop one part); the failing step must stay last.
            cand = [op for j, p in enumerate(parts) if j != i for op in p]
            tests += 1
            if keeps(cand):
                cur, n, reduced = cand, max(n - 1, 2), True
                break
        if not reduced:
            if n >= len(cur):
                break
            n = min(n * 2, len(cur))
    return cur


# -- canonical names -------------------------------------------------------------------
def _label_name(i: int) -> str:
    letters = "abcdefghijklmnopqrstuvwxyz"
    return letters[i] if i < len(letters) else f"h{i}"


def rename(steps: Sequence[Op]) -> list[Op]:
    """Requests ``r1, r2, ...`` and hash labels ``a, b, ...`` in order of first appearance."""
    reqs: dict[str, str] = {}
    labels: dict[str, str] = {}

    def req(r: str) -> str:
        return reqs.setdefault(r, f"r{len(reqs) + 1}")

    def lab(h: str) -> str:
        return labels.setdefault(h, _label_name(len(labels)))

    out: list[Op] = []
    for op in steps:
        if isinstance(op, (Admit, Step, Preempt, Finish, Prefill, Verify, Arrive, Abort, StreamInput)):
            op = replace(op, req=req(op.req))
        elif isinstance(op, (Cache, CachePartial)):
            op = replace(op, hashes=tuple(lab(h) for h in op.hashes))
        elif isinstance(op, Lookup):
            op = replace(op, hash=lab(op.hash))
        out.append(op)
    return out


# -- bounded BFS -----------------------------------------------------------------------
def _smaller_configs(config: Config, null_block: bool) -> list[Config]:
    """Same level, block size and caching; from one usable block up to ``config``'s pool."""
    lo = 2 if null_block else 1
    return [replace(config, num_blocks=n) for n in range(lo, config.num_blocks + 1)]


def deepening_search(target: Target, configs: Sequence[Config], max_depth: int, invariant: str,
                     deadline: float, bounds_for=None, max_states: Optional[int] = None
                     ) -> tuple[Optional[list[Op]], Optional[Config], bool]:
    """Iterative-deepening BFS over ``configs`` (in order) up to ``max_depth`` steps:
    (the first counterexample, its config, complete). ``complete`` is True when every
    shallower search ran to the end, i.e. nothing shorter fails on any of ``configs``.
    ``max_states``: a cap on the states of all the searches together (a bound on work
    that, unlike ``deadline``, gives the same result on every machine)."""
    from kvspec.mc.enumerate_ops import Bounds
    from kvspec.mc.search import model_check

    bounds_for = bounds_for or (lambda cfg: Bounds())
    complete = True
    live = list(configs)
    for depth in range(1, max_depth + 1):
        for cfg in list(live):
            left = deadline - time.monotonic()
            if left <= 0 or (max_states is not None and max_states <= 0):
                return None, None, False
            try:
                r = model_check(target, cfg, depth, bounds_for(cfg), time_cap=left, mem_cap_gib=1.0,
                                invariant=invariant, max_states=max_states)
                if max_states is not None:
                    max_states -= r.states
            except Exception:  # a configuration the target cannot build
                r = None
            if r is not None and r.verdict == "violation" and r.counterexample is not None:
                return list(r.counterexample), cfg, complete
            if r is None or r.verdict != "pass":
                # unbuildable, or out of memory (or time): deeper searches of it would be
                # too. The others go on, but nothing found later is proven shortest.
                complete = False
                live.remove(cfg)
    return None, None, complete


def bounds_fors(steps: Sequence[Op], config: Config) -> list:
    """The domains a search for a shorter ``steps`` goes over, per pool: mc's own, then,
    where ``steps`` uses anything outside them, mc's own widened by its arguments."""
    from kvspec.mc.enumerate_ops import Bounds

    out = [lambda c: Bounds()]
    if Bounds().widened(steps, config) != Bounds().widened([], config):
        out.append(lambda c: Bounds().widened(steps, c))
    return out


def bfs_shortest(target: Target, config: Config, steps: Sequence[Op], invariant: str,
                 budget_s: float = BFS_BUDGET_S, shrink_config: bool = True, max_states: Optional[int] = None
                 ) -> tuple[list[Op], Optional[bool], Config]:
    """Step 3 of the module doc: (steps, minimal, config)."""
    steps = list(steps)
    deadline = time.monotonic() + budget_s
    configs = _smaller_configs(config, target.traits.null_block) if shrink_config else [config]
    max_depth = min(len(steps), BFS_MAX_DEPTH)
    for i, bounds_for in enumerate(bounds_fors(steps, config)):
        # The widened domains get at least half the budget again: a bug mc's own prompts
        # cannot reach in a few steps (nano-vllm-voxcpm's stale index needs one block behind
        # two prefixes; a max_model_len past mc's longest prompt) would otherwise leave them
        # no time, and they hold a short repro.
        until = max(deadline, time.monotonic() + budget_s / 2) if i else deadline
        found, cfg, complete = deepening_search(target, configs, max_depth, invariant, until, bounds_for,
                                                max_states)
        if found is not None:
            return found, (True if complete else None), cfg
    return steps, None, config


# -- hangs -----------------------------------------------------------------------------
def _misuse_kind(reason: Optional[str]) -> Optional[str]:
    """A misuse reason with its numbers blanked (a double free of block 3 or of block 5: one kind)."""
    import re
    return None if reason is None else re.sub(r"-?\d+", "N", reason)


def _leads_to(target: Target, config: Config, prefix: Sequence[Op], last: Op, allow_misuse: bool,
              want: Optional[str]) -> bool:
    """The model's stand-in for "does prefix + [last] hang?", without calling ``last``:
    ``prefix`` runs with no finding (and no misuse, unless allowed), and ``last`` is then
    as valid (``want`` None) or a misuse of the same kind as it was where it hung."""
    s = Session(target, config)
    if s.initial:
        return False
    for op in prefix:
        if not allow_misuse and s.misuse_reason(op) is not None:
            return False
        if s.apply(op):
            return False
    return _misuse_kind(s.misuse_reason(last)) == want


def minimize_hang(target: Target, config: Config, steps: Sequence[Op], allow_misuse: bool = False,
                  confirm_by: Optional[float] = None, max_tests: int = DDMIN_MAX_TESTS) -> list[Op]:
    """A shorter list of steps ending in the same hanging call, or ``steps`` itself (the
    module doc: the hanging op is called at most once more, to confirm)."""
    from kvspec.targets import watchdog

    steps = list(steps)
    if len(steps) < 2:
        return steps
    prefix, last = steps[:-1], steps[-1]
    s = Session(target, config)
    for op in prefix:
        s.apply(op)
    want = _misuse_kind(s.misuse_reason(last))
    cur = prefix
    if _leads_to(target, config, [], last, allow_misuse, want):  # the hanging call alone
        cur = []
    cur = reduce_list(cur, lambda cand: _leads_to(target, config, cand, last, allow_misuse, want),
                      max_tests=max_tests)  # ddmin over the prefix
    cand = cur + [last]
    renamed = rename(cand)
    if renamed != cand and _leads_to(target, config, renamed[:-1], renamed[-1], allow_misuse, want):
        cand = renamed
    if cand == steps:
        return steps
    wait = watchdog.default() or 0.0
    if confirm_by is not None and time.monotonic() + wait > confirm_by:
        return steps  # no time left to wait for one more hang: the observed one stands
    return cand if fails_with(target, config, cand, "NO_HANG", allow_misuse=True) else steps


def minimize_finding(target: Target, config: Config, steps: Sequence[Op], invariant: str,
                     allow_misuse: bool = False, budget_s: float = 10.0, bfs_budget_s: float = BFS_BUDGET_S,
                     shrink_config: bool = True, deterministic: bool = False,
                     confirm_by: Optional[float] = None, avoid: frozenset = frozenset(), bfs: bool = True
                     ) -> tuple[list[Op], Optional[bool], Config]:
    """(steps, minimal, config): the module doc's three steps. ``config`` may be a
    smaller pool than the one given, when a repro as short or shorter fails there.
    ``deterministic``: no step is cut short by the clock (ddmin is capped at
    ``DDMIN_MAX_TESTS`` replays, the BFS at ``BFS_MAX_STATES`` states), so the repro is the
    same on any machine. ``confirm_by``: for a NO_HANG finding, the monotonic time by
    which a confirming hang must end (``minimize_hang``; None: no limit). ``avoid``: the
    signatures of the run's other findings, which no cut-down candidate may fail with (a
    shortest repro the BFS finds that does is dropped for the ddmin result: not proven).
    ``bfs=False``: ddmin only, nothing proven (``kvspec check --minimize ddmin``)."""
    if invariant == "NO_HANG":
        return minimize_hang(target, config, steps, allow_misuse, confirm_by), None, config
    max_states, max_tests = BFS_MAX_STATES, None  # the clock only caps what the state count allows
    if deterministic:
        budget_s, bfs_budget_s, max_states, max_tests = float("inf"), float("inf"), BFS_MAX_STATES, DDMIN_MAX_TESTS
    steps = list(steps)
    if not fails_with(target, config, steps, invariant, allow_misuse, avoid):
        return steps, None, config  # not reproducible in isolation: keep what Hypothesis gave
    steps = ddmin(target, config, steps, invariant, allow_misuse, budget_s, max_tests, avoid)
    renamed = rename(steps)
    if renamed != steps and fails_with(target, config, renamed, invariant, allow_misuse, avoid):
        steps = renamed
    if not steps:
        # Fails at construction: the smallest pool that does so too; nothing is shorter.
        for cfg in (_smaller_configs(config, target.traits.null_block) if shrink_config else [config]):
            out = run_steps(target, cfg, [])
            if out.index == -1 and out.invariant == invariant:
                return [], True, cfg
        return [], True, config
    if allow_misuse or config.level == "engine" or not bfs:
        return steps, None, config  # the search enumerates valid cache/pool ops only
    short, minimal, cfg = bfs_shortest(target, config, steps, invariant, bfs_budget_s, shrink_config, max_states)
    if avoid and short != steps and not fails_with(target, cfg, short, invariant, allow_misuse, avoid):
        return steps, None, config  # the BFS's shortest is another finding's bug: keep ddmin's
    return short, minimal, cfg


def minimize(target: Target, config: Config, steps: Sequence[Op], invariant: str, allow_misuse: bool = False,
             budget_s: float = 10.0) -> tuple[list[Op], Optional[bool]]:
    """(shortest steps found, minimal?) on ``config`` itself; minimal is True only when proven."""
    steps, minimal, _ = minimize_finding(target, config, steps, invariant, allow_misuse, budget_s,
                                         shrink_config=False)
    return steps, minimal
