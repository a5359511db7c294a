"""Explicit-state model checking: breadth-first search over every reachable state of a
small configuration, returning the shortest failing step list.

The search speaks kvspec's one vocabulary and checks kvspec's one catalogue: the ops
come from ``kvspec.mc.enumerate_ops`` (the valid ops the reference model enables, over
small finite domains, see ``Bounds``), and every transition is run through
``Session.apply``, the same call the Hypothesis machines, the repro files and the
minimizer make, so every invariant is checked after every step of the search.

How a state is stored and revisited
-----------------------------------
The target is driven for real. A state is the whole ``Session`` after a path of ops;
to try each enabled op from it, the search *forks* it:

* ``compact`` (the default where the driver offers it, as impl's do): one live session
  is put back into the saved state *in place* before each transition. The driver's
  ``snapshot()`` (marked ``in_place``) saves its objects' slot values and attribute
  dicts and ``restore(snap)`` writes them back into the same objects, with fresh copies
  of every list and dict (``kvspec.targets.impl_target.GraphSnapshot``); the model, the
  hash history and the shadow KV store are saved the same way. A state that cannot be
  saved so exactly (an object the first snapshot did not see, a list reachable twice)
  is pickled instead;
* ``pickle``: the session's mutable parts (the target's driver, the model, the hash
  history, the shadow KV store) are pickled once when the state is found and unpickled
  once per transition out of it. Modules are pickled by name and the target, config
  and traits are shared. A driver may also define ``snapshot()``/``restore(snap)``
  returning a new driver; the search then calls those instead (``driver-snapshot``);
* ``deepcopy``, where the driver does not pickle;
* ``replay``, where neither works: a fresh session replays the state's op prefix.

``auto`` picks the first that round-trips the initial state faithfully. Every way of
forking sees the same states and transitions (tests/test_mc.py compares them).

Every transition is driven and checked, also those into states seen before: a bug
can live in the step back into a known state (reviving a cached block with ``touch``
always lands on a state that ``alloc`` + ``cache`` reach sooner). The state key is
``kvspec.mc.canonical.state_key``: observation + model + check history, with block ids,
labels, hash values and request ids renamed canonically (the soundness argument is in
that module). A state is expanded once; a transition whose check fails ends the search
with the path to it, which is a shortest counterexample because the search is
breadth-first. The key of an exact (not renamed) state seen before is looked up rather
than rebuilt (``kvspec.mc.canonical.KeyMemo``, on at pool level; ``key_memo=False`` turns
it off): the key is a pure function of the state, so this changes no key. With
``invariant=`` (the minimizer), only a failure of that invariant
ends the search; a transition failing another way is a dead end.

A state checked once, as TLC does (``check_once=True``, the default)
------------------------------------------------------------------
The catalogue splits into *state checks*, which read only the state after the step
(the observation, the model, the hash history, the shadow KV store), and *transition
checks*, which read the step (the observation before, the op, the target's result, the
model's expected result, a misuse, an error) or write the check state (HASH_CHAIN
records each target hash / content pair in the hash history). ``kvspec.mc.split`` reads
the split off each check's compiled code; anything it cannot follow is a transition check.
Every transition runs the transition checks (results against the model, rejects,
held-hash changes, the hash history, EVICTION_ORDER of the returned blocks). The state
checks run when the post-state's key is new, and on any step that already failed (so a
failing step reports exactly ``check_step``'s list, in its order).

Why this finds the same bugs at the same length, with the same counterexample:

1. A state check is a function of the state: it reads nothing of the step, and the
   key is taken after every write to the state (the transition checks, HASH_CHAIN's
   included, run before the key). One that also reads ``comparable`` (made of the
   step) is a function of the state on a comparable step; a step that is not
   comparable runs every check, and only a comparable step marks a key as checked.
2. The key is a canonical form under which the state checks are invariant: it holds
   the observation, the model and the check history *in full*, rewritten under a
   renaming of block ids, labels, hash values and request ids
   (``kvspec.mc.canonical``); the state checks compare these with each other (equal
   ids, equal hashes, counts, membership) and never look at which name a block has
   (the null block is kept fixed). So two states with one key pass or fail the state
   checks alike.
3. Hence a transition into a key seen before would find, from the state checks,
   exactly what they found when that key was first checked, and that was nothing (a
   finding ends the search, or with ``invariant=`` keeps the key unseen, so it is
   checked again next time). Skipping them drops no finding, and every step that does
   find something runs every check. The breadth-first order of transitions is
   unchanged, so the first failing transition, and with it the counterexample and its
   length, are the ones of checking everything after every step.

tests/test_mc_corpus.py runs every corpus bug (pool and cache level) both ways and
compares verdicts, states and counterexamples; tests/test_mc_modes.py the state spaces.

At pool level the transition checks themselves run as one pass
(``kvspec.spec.fast_pool``, asked by ``StepChecker``): it answers "clean" only where
every transition check of the catalogue finds nothing, records HASH_CHAIN's pairs as
that check would, and on any doubt the catalogue's checks run, so every step is still
checked by (the equivalent of) every transition check, and a finding is theirs word
for word (tests/test_fast_pool.py holds the pass to the catalogue and shows each of
its conditions matters). The enabled ops of a pool-level state are remembered under
what ``enabled_pool_ops`` reads of it (``enumerate_ops.pool_ops_key``): the same inputs give the
same (immutable) ops, so the order of transitions does not change.

A state is expanded by ``kvspec.mc.expand`` (the loop over its enabled ops described
above). ``workers=N`` (``kvspec mc --workers N``) runs the same search level by level
over N processes (``kvspec.mc.parallel``), each expanding its states with that same
loop, with the same states and counterexample.

What the model says of each enabled op (``misuse_reason``) is asked once, when the list
of ops is made (``EnabledOps``), and handed to ``Session.apply`` with the op: every op
of the list is applied in the very model state the list was made in (the pool level's
remembered lists: in a state with the same ``enumerate_ops.pool_ops_key``, which holds all that
``misuse_reason`` reads). tests/test_mc_modes.py compares each answer with the model's
own. The search runs with fewer cyclic garbage collections (``kvspec.mc.collector``).

What is kept per state (as TLC keeps it)
---------------------------------------
The seen set holds each canonical key's 64-bit fingerprint (``kvspec.mc.fingerprint``:
xxh3_64 of the marshalled key, in an open-addressing table of 16 to 32 bytes a state);
``MCResult.collision`` gives TLC's two estimates of the odds that two states were merged
(``seen="exact"`` keeps the keys themselves, for tests and for the doubtful). The path to a
state is its parent's number and the op's index in the parent's list of enabled ops, 16
bytes a state in a file (``kvspec.mc.trace``); a counterexample is rebuilt from it by
replaying those ops, which lists the same ops (the enabled ops are a function of the
state). Once the search has grown past ``PACK_AT`` of its memory cap, each level's states
are kept packed, and past ``DISK_AT`` of it they go to a file (from the start with
``frontier="disk"``), read back in order (``kvspec.mc.frontier``). So past that point
memory grows by the seen set only. None of
this changes the order of transitions, so states, levels and counterexamples are the ones
of the exact search (tests/test_mc_fingerprint.py).

Counting: ``states`` are distinct canonical states (the initial one included), each
reached and checked; ``transitions`` are the ops tried, each one a real step of the
target plus its checks (all of them with ``check_once=False``); ``states_per_second`` is states / wall seconds of
the whole search, start-up included.

Stopping: at the depth bound or when no new state appears (the bounded state space
is exhausted) the verdict is ``pass``; at the time cap or the memory cap (resident
memory, read from ``/proc/self/statm``) it is ``incomplete``, never ``pass``, with
how far the search got. The caps are checked before every transition, so a single
state's expansion cannot run past them, and a single call that does is interrupted
(``kvspec.mc.budget``); a configuration whose one state cannot fit the memory cap is
refused before anything is built. Past a quarter of the memory cap the search keeps the states
it finds packed (``PACK_AT``, ``kvspec.mc.pack``), which costs a little time and lets
a large search go further before the cap.

This module is longer than 450 lines because the caps (time, memory, signals) are checked
inside the one BFS loop they bound, and the partial result on every stop is built there.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from kvspec.mc.canonical import KeyMemo, compact, state_key
from kvspec.mc.collector import fewer_collections
from kvspec.spec.config import Config
from kvspec.mc.enumerate_ops import Bounds, EnabledOps, enabled_ops, pool_ops_key, with_misuses
from kvspec.spec.ops import Admit, Finish, Op
from kvspec.check.session import Session, run_steps
from kvspec.targets.base import Target, TargetError
from kvspec.spec.violation import Violation
from kvspec.mc.expand import FOUND, NEW, PRUNED, RECHECKED, Expander
from kvspec.mc.fork import Fork, choose_fork
from kvspec.mc.pack import can_pack, decode, encode, registry
from kvspec.mc.fingerprint import FingerprintSet, collision_odds, fingerprint
from kvspec.mc.frontier import DiskFrontier
from kvspec.mc.parallel import flat_obs, obs_of
from kvspec.mc.trace import ParentLog, replay_path
from kvspec.mc.split import StepChecker
from kvspec.mc.budget import Budget, CapReached, refuse_if_too_large, rss_bytes  # noqa: F401 (rss_bytes: re-exported)

# -- the result ----------------------------------------------------------------------
@dataclass
class MCResult:
    verdict: str                       # "pass", "violation" or "incomplete"
    config: Config
    bounds: Bounds
    max_depth: int
    states: int = 0
    transitions: int = 0
    depth: int = 0                     # levels fully explored (the counterexample's length on a violation)
    seconds: float = 0.0
    exhausted: bool = False            # no new state at the last level: every reachable state was seen
    counterexample: Optional[list[Op]] = None
    violations: list[Violation] = field(default_factory=list)
    reason: Optional[str] = None       # why the search is incomplete
    levels: list[int] = field(default_factory=list)   # new states per depth (index 0: the initial state)
    pruned: int = 0                    # transitions failing another invariant (with ``invariant=``)
    fork: str = ""
    fork_fallbacks: int = 0            # states the ``compact`` fork had to pickle instead
    check_once: bool = False           # state invariants run once per distinct state
    state_checks: int = 0              # how often they ran (the initial state's not counted)
    workers: int = 1                   # processes of a parallel search (kvspec.mc.parallel)
    split_levels: int = 0              # levels it expanded over more than one process
    packed_from: Optional[int] = None  # the depth from which frontier states were kept packed (PACK_AT)
    peak_rss_mib: float = 0.0
    seen: str = "fingerprint"          # how the seen set keeps a state: its 64-bit fingerprint, or its exact key
    seen_bytes: int = 0                # the seen set's own memory (the fingerprint table)
    collision: Optional[dict] = None   # the odds of a fingerprint collision (kvspec.mc.fingerprint.collision_odds)
    disk_from: Optional[int] = None    # the depth from which levels were kept on disk (kvspec.mc.frontier)
    disk_bytes: int = 0                # the largest level's file
    interrupted: Optional[str] = None  # "SIGINT" or "SIGTERM" where a signal stopped the search
    repro: Optional[str] = None
    replayed: Optional[bool] = None    # the counterexample, replayed from scratch, fails the same way

    @property
    def invariant(self) -> Optional[str]:
        return self.violations[0].invariant if self.violations else None

    @property
    def states_per_second(self) -> float:
        return self.states / self.seconds if self.seconds > 0 else 0.0

    @property
    def transitions_per_second(self) -> float:
        return self.transitions / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        v = self.violations[0] if self.violations else None
        return {
            "verdict": self.verdict, "states": self.states, "transitions": self.transitions, "depth": self.depth,
            "max_depth": self.max_depth, "seconds": round(self.seconds, 3),
            "states_per_second": round(self.states_per_second, 1),
            "transitions_per_second": round(self.transitions_per_second, 1),
            "exhausted": self.exhausted, "reason": self.reason,
            "counterexample": None if self.counterexample is None else [op.to_dict() for op in self.counterexample],
            "counterexample_text": None if self.counterexample is None else [repr(op) for op in self.counterexample],
            "invariant": self.invariant, "message": v.message if v else None, "excerpt": v.excerpt if v else None,
            "repro": self.repro, "replayed": self.replayed, "config": self.config.to_dict(),
            "bounds": self.bounds.to_dict(), "levels": self.levels, "pruned": self.pruned, "fork": self.fork,
            "fork_fallbacks": self.fork_fallbacks, "check_once": self.check_once, "state_checks": self.state_checks,
            "workers": self.workers, "split_levels": self.split_levels, "packed_from": self.packed_from,
            "peak_rss_mib": round(self.peak_rss_mib, 1), "interrupted": self.interrupted,
            "seen": self.seen, "seen_bytes": self.seen_bytes, "collision": self.collision,
            "disk_from": self.disk_from, "disk_bytes": self.disk_bytes,
            "complete": self.verdict != "incomplete",
        }


# A saved state (slot values, list and dict copies) takes about 4 KB (tracemalloc, pool
# level); packed as the parallel search sends it (``kvspec.mc.pack``: pickled, the live
# objects it restores into as references) about 1.3 KB, for one pickle round trip per state found
# and expanded. So a search keeps its frontier unpacked until it has grown by this
# fraction of its memory cap, and packs the states it finds from then on: small
# searches run at full speed, large ones reach further before the cap. Packing changes
# no state, transition or counterexample (tests/test_mc_modes.py).
PACK_AT = 0.25
# Writing a level to disk and reading it back costs about a quarter more CPU than keeping it
# packed in memory (pool level, 4 blocks, depth 6, symmetry off: 72-76 s against 57-58 s), so
# ``frontier="auto"`` packs in memory from PACK_AT and goes to disk from this fraction of the cap.
DISK_AT = 0.5
# TLC's second collision estimate sorts the fingerprints (8 bytes each, numpy): up to this many
COLLISION_ACTUAL_UP_TO = 1 << 27


def op_lister(config: Config, bounds: Bounds, unsupported: Any = frozenset()) -> Callable[[Session, dict], EnabledOps]:
    """``ops_of(session, extra)``: a state's enabled ops with the model's misuse answers
    (at pool level remembered under ``pool_ops_key``: the same inputs, the same ops)."""
    cache = config.level == "cache"
    ops_memo: dict = {}

    def ops_of(s: Session, extra: dict) -> EnabledOps:
        if cache:
            return with_misuses(s.model, enabled_ops(s.model, config, bounds, next_request=extra["next_request"],
                                                     prompt_lens=extra["prompt_lens"]), unsupported)
        m = s.model
        mk = pool_ops_key(m, s.hashes.k2t, bounds.labels)
        ops = ops_memo.get(mk) if mk is not None else None
        if ops is None:
            ops = with_misuses(m, enabled_ops(m, config, bounds, used_labels=s.hashes.k2t.keys()), unsupported)
            if mk is not None and len(ops_memo) < 1 << 16:
                ops_memo[mk] = ops
        return ops
    return ops_of


def _next_extra(extra: dict, op: Op) -> dict:
    if isinstance(op, Admit) and op.prompt is not None:
        lens = dict(extra["prompt_lens"])
        lens[op.req] = len(op.prompt)
        return {"next_request": extra["next_request"] + 1, "prompt_lens": lens}
    if isinstance(op, Finish):
        lens = dict(extra["prompt_lens"])
        lens.pop(op.req, None)
        return {"next_request": extra["next_request"], "prompt_lens": lens}
    return extra


class _Progress:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.last = 0.0

    def show(self, now: float, start: float, depth: int, frontier: int, states: int, transitions: int,
             force: bool = False) -> None:
        if not self.enabled or (now - self.last < 0.25 and not force):
            return
        self.last = now
        el = max(now - start, 1e-9)
        sys.stderr.write(f"\r\033[K[mc] depth {depth}  frontier {frontier:,}  states {states:,}  "
                         f"transitions {transitions:,}  {states / el:,.0f} states/s  "
                         f"{transitions / el:,.0f} transitions/s  {el:5.1f}s")
        sys.stderr.flush()

    def done(self) -> None:
        if self.enabled:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()


# -- the search ----------------------------------------------------------------------
@fewer_collections()   # (kvspec.mc.collector: a fifth of the CPU time otherwise)
def model_check(target: Target, config: Config, depth: int, bounds: Optional[Bounds] = None, *,
                time_cap: float = 300.0, mem_cap_gib: float = 2.0, progress: bool = False,
                invariant: Optional[str] = None, fork: str = "auto", key_memo: Optional[bool] = None,
                max_states: Optional[int] = None, check_once: bool = True, workers: int = 1,
                budget: Optional[Budget] = None, partial_on_interrupt: bool = False,
                seen: str = "fingerprint", frontier: str = "auto", spill_dir: Optional[str] = None) -> MCResult:
    """Breadth-first search of every state reachable in at most ``depth`` valid ops.

    Returns the first (so shortest) failing path as ``counterexample``; with
    ``invariant``, only a failure whose first invariant is that one counts.

    Bounded by construction (``kvspec.mc.budget``): a configuration whose one state
    would not fit ``mem_cap_gib`` is refused (``UsageError``); the caps are checked
    before every transition and between the set-up's phases, and a single call that
    runs past them is interrupted. A stop at a cap returns what the search reached,
    verdict ``incomplete`` with the reason. With ``partial_on_interrupt`` (the command
    line), a Ctrl-C or SIGTERM does the same (``MCResult.interrupted`` names the signal);
    otherwise it propagates. ``budget`` replaces the one made from the caps (tests: a
    fake clock or memory reading).

    ``seen``: ``"fingerprint"`` keeps a 64-bit fingerprint per state (``kvspec.mc.fingerprint``;
    ``MCResult.collision`` gives the odds that two states were merged), ``"exact"`` the
    whole canonical key. ``frontier``: ``"disk"`` keeps each level's states in a file
    (``kvspec.mc.frontier``, in ``spill_dir``), ``"memory"`` in a list, ``"auto"`` in a list
    packed from ``PACK_AT`` of its memory cap, and on disk from ``DISK_AT``. Neither
    changes a state, a transition or a counterexample (tests/test_mc_fingerprint.py)."""
    if seen not in ("fingerprint", "exact") or frontier not in ("auto", "disk", "memory"):
        raise ValueError(f"seen={seen!r} / frontier={frontier!r}")
    bounds = bounds or Bounds()
    if config.level not in target.traits.levels:
        raise TargetError(f"target {target.name} does not support the {config.level} level")
    if budget is None:
        refuse_if_too_large(config.num_blocks, mem_cap_gib)
        budget = Budget(time_cap, mem_cap_gib, config.num_blocks)
    res = MCResult("pass", config, bounds, depth, check_once=check_once, seen=seen)
    prog = _Progress(progress)
    run = _Search(target, config, depth, bounds, res, budget, prog, invariant, fork, key_memo, max_states,
                  check_once, workers, frontier, spill_dir)
    try:
        with budget.guard():
            verdict = run.search()
    except CapReached as e:
        res.reason = e.reason
        verdict = "incomplete"
    except KeyboardInterrupt as e:
        if not partial_on_interrupt:
            raise
        res.interrupted = _signal_name(e)
        res.reason = f"interrupted ({res.interrupted}) at depth {budget.depth}"
        verdict = "incomplete"
    finally:
        run.close()
    res.verdict = verdict
    ex, forker = run.ex, run.forker
    if ex is not None:
        res.transitions, res.state_checks = ex.transitions, ex.state_checks
    res.seconds = budget.clock() - budget.start
    res.fork_fallbacks = getattr(forker, "fallbacks", 0) if forker is not None else 0
    budget.sample_rss()
    res.peak_rss_mib = max(res.peak_rss_mib, budget.peak_rss_mib)
    prog.done()
    return res


def _signal_name(e: BaseException) -> str:
    """"SIGINT" or "SIGTERM" (``kvspec.errors.Interrupted``); a plain KeyboardInterrupt is a Ctrl-C."""
    name = str(e) if type(e).__name__ == "Interrupted" else ""
    return name if name.startswith("SIG") else "SIGINT"


class _Search:
    """One search's state, so that a stop anywhere (a cap, an interrupt) leaves in ``res``
    and ``ex`` what it reached."""

    def __init__(self, target: Target, config: Config, depth: int, bounds: Bounds, res: MCResult, budget: Budget,
                 prog: _Progress, invariant: Optional[str], fork: str, key_memo: Optional[bool],
                 max_states: Optional[int], check_once: bool, workers: int, frontier: str = "auto",
                 spill_dir: Optional[str] = None) -> None:
        self.target, self.config, self.depth, self.bounds, self.res = target, config, depth, bounds, res
        self.budget, self.prog, self.invariant, self.fork, self.key_memo = budget, prog, invariant, fork, key_memo
        self.max_states, self.check_once, self.workers = max_states, check_once, workers
        self.ex: Optional[Expander] = None
        self.forker: Optional[Fork] = None
        self.frontier_len = 0
        self.frontier_mode, self.spill_dir = frontier, spill_dir
        self.seen: Any = None
        self.parents: Optional[ParentLog] = None
        self.files: list[DiskFrontier] = []

    def close(self) -> None:
        """The seen set's size and collision odds into ``res``; the files removed."""
        res, seen = self.res, self.seen
        if isinstance(seen, FingerprintSet):
            res.seen_bytes = seen.nbytes
            res.collision = collision_odds(len(seen), seen if len(seen) <= COLLISION_ACTUAL_UP_TO else None)
        for f in self.files:
            res.disk_bytes = max(res.disk_bytes, f.bytes)
            f.close()
        self.files = []
        if self.parents is not None:
            self.parents.close()

    def _poll(self, now: float) -> None:   # progress, from Budget.check (at most every RSS_EVERY_S)
        ex = self.ex
        self.prog.show(now, self.budget.start, self.budget.depth, self.frontier_len, self.res.states,
                       ex.transitions if ex is not None else 0)

    def search(self) -> str:
        target, config, depth, bounds, res, budget = self.target, self.config, self.depth, self.bounds, self.res, self.budget
        invariant, max_states, workers = self.invariant, self.max_states, self.workers
        prog, start = self.prog, budget.start
        budget.on_poll = self._poll
        check = budget.check
        # A full session (not incremental: its live observation cannot be saved in place),
        # so the in-place fork can put it back into each state; the checks are the same.
        s0 = Session(target, config, incremental=False)
        res.states = 1
        res.levels = [1]
        if s0.initial:
            if invariant is None or s0.initial[0].invariant == invariant:
                res.counterexample, res.violations = [], s0.initial
                return "violation"
            return "pass"  # every path starts past another failure: none can end in this one
        check()
        cache = config.level == "cache"
        extra0: dict = {"next_request": 1, "prompt_lens": {}} if cache else {}

        unsupported = getattr(target.traits, "unsupported_ops", frozenset())

        ops_of = op_lister(config, bounds, unsupported)

        sym = bounds.symmetry
        forker = self.forker = choose_fork(s0, ops_of(s0, extra0)[:3], self.fork, check=check)
        res.fork = forker.name
        check()
        checker = StepChecker() if self.check_once else None
        forker.shared["step_check"] = checker
        s0.step_check = checker
        parents = self.parents = ParentLog(self.spill_dir)

        def next_extra(extra: dict, op: Op) -> dict:
            return _next_extra(extra, op) if cache else extra

        def path_to(i: int) -> list[Op]:
            # the ops back from the op indices kept per state (kvspec.mc.trace), replayed
            return replay_path(parents.indices(i), lambda: Session(target, config, incremental=False), ops_of,
                               extra0, next_extra)

        def counterexample(idx: int, op: Op, found: list[Violation], depth: int) -> str:
            res.counterexample = path_to(idx) + [op]
            res.violations = found
            res.depth = depth
            return "violation"

        key_memo = self.key_memo
        if key_memo is None:
            key_memo = not cache   # at pool level most transitions revisit an exact state (see KeyMemo)
        fps = res.seen == "fingerprint"
        if key_memo:
            key_of = KeyMemo(config.level, sym, fingerprints=fps)
        elif fps:
            key_of = lambda s, extra: fingerprint(compact(state_key(s, extra, sym)))   # noqa: E731
        else:
            key_of = lambda s, extra: compact(state_key(s, extra, sym))   # noqa: E731
        seen = self.seen = FingerprintSet() if fps else set()
        seen.add(key_of(s0, extra0))   # the initial state: every check ran in Session()
        check()
        unchecked: set = set()        # keys seen whose state checks have not run on a comparable step
        # Can the saved states be packed: for --workers (they travel between processes so),
        # and past PACK_AT of the memory cap (see PACK_AT). One round trip on s0, asked once.
        packable = can_pack(forker, s0)

        if workers > 1:
            from kvspec.mc.parallel import parallel_search
            if packable:   # states travel between levels packed
                res.workers = workers
                # (not self.ex: the processes' transitions are summed into res level by level)
                pex = Expander(forker, ops_of, key_of, checker, next_extra if cache else None, invariant,
                               check=check)
                return parallel_search(res, workers, depth, forker, s0, extra0, seen, key_of, ops_of, checker,
                                       invariant, next_extra, parents, path_to, budget, max_states, pex)
        ex = self.ex = Expander(forker, ops_of, key_of, checker, next_extra if cache else None, invariant,
                                check=check)
        reg: Optional[dict] = None   # the live objects packed states refer to, once packing is on
        mem_cap = budget.mem_cap

        def packing_from(rss: int) -> Optional[dict]:
            """The registry to pack with, once the search has grown past PACK_AT of its cap."""
            return registry(forker) if packable and mem_cap and rss - budget.rss_at_start > PACK_AT * mem_cap else None

        mode = self.frontier_mode
        if mode == "disk" and packable and reg is None:
            reg = registry(forker)
        frontier: Any = [(forker.save(s0, lambda: []), s0.obs, extra0, 0)]
        del s0   # (an in-place fork keeps it; the others need it no more)
        tick = 0
        for d in range(1, depth + 1):
            budget.depth = d
            self.frontier_len = len(frontier)
            # the next level on disk (never at the depth bound: none kept): always with "disk"; with
            # "auto" once the search has grown past DISK_AT of its cap (see DISK_AT)
            disk = reg is not None and d < depth and (
                mode == "disk" or (mode == "auto" and bool(mem_cap)
                                   and budget.sample_rss() - budget.rss_at_start > DISK_AT * mem_cap))
            if disk:
                nxt: Any = DiskFrontier(self.spill_dir)
                self.files.append(nxt)
                if res.disk_from is None:
                    res.disk_from = d
            else:
                nxt = []
            on_disk = isinstance(frontier, DiskFrontier)
            for j, (saved, obs, extra, idx) in enumerate(frontier):
                if on_disk:
                    obs = obs_of(obs)
                else:
                    frontier[j] = None   # expanded: let the state go (the path to it is in ``parents``)
                if reg is not None:
                    saved = decode(saved, reg)   # (a state saved before packing began passes as it is)
                for i, op, kind, payload in ex.expand(saved, obs, extra, seen, unchecked):
                    if kind == FOUND:
                        return counterexample(idx, op, payload, d)
                    if kind == PRUNED:
                        res.pruned += 1
                    elif kind == RECHECKED:
                        unchecked.discard(payload)
                    else:   # NEW
                        k, checked, s, ex2 = payload
                        payload = None
                        seen.add(k)
                        if not checked:
                            unchecked.add(k)
                        pid = parents.append(idx, i)
                        res.states += 1
                        if max_states is not None and res.states > max_states:
                            # a cap on work, not time: the same on every machine (kvspec check --max-examples)
                            res.reason = f"state cap of {max_states} reached at depth {d}"
                            return "incomplete"
                        if disk:
                            nxt.append((encode(forker, forker.save(s, lambda: path_to(pid)), reg), flat_obs(s.obs),
                                        ex2, pid))
                        elif d < depth:  # states at the depth bound are checked, never expanded: no copy kept
                            kept = forker.save(s, lambda: path_to(pid))
                            nxt.append((kept if reg is None else encode(forker, kept, reg), s.obs, ex2, pid))
                        else:
                            nxt.append(None)
                        s = None   # (a replayed session goes before the next one is built)
                saved = obs = None
                tick += 1
                if tick % 16 == 0:
                    prog.show(time.monotonic(), start, d, len(frontier), res.states, ex.transitions)
                    if reg is None and tick % 64 == 0 and (reg := packing_from(budget.sample_rss())) is not None:
                        res.packed_from = d
            # (also asked once per level: a small search has few memory checks)
            if reg is None and packable and (reg := packing_from(budget.sample_rss())) is not None:
                res.packed_from = d + 1
            res.levels.append(len(nxt))
            res.depth = d
            prog.show(time.monotonic(), start, d, len(nxt), res.states, ex.transitions, force=True)
            if on_disk:   # read: its file goes
                res.disk_bytes = max(res.disk_bytes, frontier.bytes)
                frontier.close()
                self.files.remove(frontier)
            frontier = nxt
            if not nxt:
                res.exhausted = True
                break
        return "pass"


def confirm(target: Target, config: Config, result: MCResult) -> bool:
    """Replay a counterexample from scratch: does it fail, at its last step, the same way?"""
    if result.counterexample is None:
        return False
    out = run_steps(target, config, result.counterexample)
    ok = (out.index == len(result.counterexample) - 1 if result.counterexample else out.index == -1)
    return ok and out.invariant == result.invariant
