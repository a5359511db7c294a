"""One run of a target against the reference model: apply an op to both, observe,
check every invariant. The stateful machines, the model checker, ``replay`` (repro
files) and the minimizer all drive targets through this class and nothing else.

Incremental checking
--------------------
Observing the whole pool and checking every block after every step costs O(pool) per
step. When the driver can report what an op wrote (``track_changes()`` and
``observe_delta()``, see ``kvspec.targets.impl_target``), the session keeps the
observation up to date from those deltas (``LiveObservation``), notes which blocks the
reference model changed (``TrackedList``), and asks ``invariants.fast_check`` whether
the step is clean, looking only at the blocks either side changed and at running
counts. A step it cannot vouch for (a misuse, an exception, a target that decided
differently from the model, a queue that is not a clean list, any finding at all) is
observed and checked in full, exactly as without deltas, so the findings and their
messages are the full checker's, word for word. The full path stays the reference
(``incremental=False``); tests/test_incremental.py holds the two to the same findings.

``incremental=None`` (the default) uses deltas where the driver offers them and the
pool has at least ``INCREMENTAL_MIN_BLOCKS`` blocks, below which the full path is as
fast; ``KVSPEC_INCREMENTAL=1`` / ``=0`` forces it on / off.

The target cannot hijack kvspec
-------------------------------
Every call into the target (building it, an op, a full observation) goes through
``_call``: under the op timeout (``kvspec.targets.watchdog``), with ``sys.stdout`` and
``sys.stderr`` pointed at the session's ``Tail`` (``kvspec.targets.target_output``), and
with ``SystemExit`` and ``KeyboardInterrupt`` caught: a target that calls
``sys.exit()`` or raises ``KeyboardInterrupt`` is a ``NO_CRASH`` finding, never the end
of kvspec (a CI gate would pass on exit 0). A real Ctrl-C (SIGINT delivered to the
process, ``watchdog.real_interrupt``) still stops kvspec. Findings carry the last of
what the target printed (``Violation.target_output``).

A hang is paid for once
-----------------------
A call that hangs is remembered, per Target object, with the configuration and the
steps before it (``_OBSERVED_HANGS``). A later session on the same target that
reaches the same call after the same steps reports the same ``NO_HANG`` without
calling it again: Hypothesis's final replay of the failing example, the report's
step view and the minimizer's first check reuse the observed hang instead of
waiting out the op timeout again. A repro file (a fresh process) calls it for real.

Such a replay also gives the calls *before* the hang, which returned when it was
observed, at least ``REPLAY_GRACE_S`` (``_limit``): with a tiny ``--op-timeout`` any call
may overrun it, and an earlier call caught this time would make Hypothesis's replay
of the failing example end elsewhere (a "flaky" error instead of the finding).

This module is longer than 450 lines because the one step and the boundary every target
call crosses (op timeout, remembered hangs, captured output, a target's SystemExit or
KeyboardInterrupt) share one Session's state; splitting them would put that state in two
places.
"""
from __future__ import annotations


import os
import sys
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Optional, Sequence

from kvspec.check import coverage
from kvspec.spec.config import Config
from kvspec.spec.fast_check import FastStep, RequestsView, fast_check
from kvspec.spec.invariants import StepContext, check_step
from kvspec.spec.misuse import documented_errors
from kvspec.spec.model import CacheModel, model_for
from kvspec.spec.observation import BlockState, LiveObservation, Observation, splice_walk
from kvspec.spec.ops import Admit, Op
from kvspec.spec.shadow import HashMap, ShadowKV
from kvspec.targets.base import Target, TargetError
from kvspec.spec.violation import Violation
from kvspec.targets import watchdog
from kvspec.targets.target_output import Tail, streams
from kvspec.targets.watchdog import OpTimeout


INCREMENTAL_MIN_BLOCKS = 64
ASK = object()   # Session.apply's default ``misuse``: ask the model
CAPTURE = True   # capture the target's stdout/stderr during its calls (off only to measure what it costs)
REPLAY_GRACE_S = 1.0  # the least limit for a call that returned before, replayed on the way to a seen hang

# id(target) -> (target, {op: [(config, steps before op, op timeout), ...]}): hangs seen (module doc)
_OBSERVED_HANGS: dict[int, tuple[Target, dict]] = {}


class _Escaped(BaseException):
    """A target call raised SystemExit or KeyboardInterrupt (not a real Ctrl-C): carried
    out of ``_call`` past every ``except Exception`` to the finding it becomes."""

    def __init__(self, exc: BaseException) -> None:
        super().__init__(exc)
        self.exc = exc


def _escape_words(e: BaseException) -> str:
    if isinstance(e, watchdog.TargetCalledExit):
        return f"{e} (kvspec raised SystemExit in its place, so the process lived on)"
    if isinstance(e, SystemExit):
        return f"called sys.exit({e.code!r}) (raised SystemExit)"
    return f"raised {type(e).__name__}{': ' + str(e) if str(e) else ''} (no Ctrl-C reached kvspec)"


def _binding_error(e: BaseException) -> Optional[str]:
    """kvspec.targets.contract.binding_error where it exists: a one-line reason when the
    exception is kvspec's own call not fitting the class (a TargetError, not a finding)."""
    try:
        from kvspec.targets.contract import binding_error
    except ImportError:
        return None
    return binding_error(e)


def _chooser(obs: Observation, result: Any) -> Callable[[int, Any], Optional[list]]:
    """What the target took, for the model under free order "any" (``PoolModel.alloc``):
    a pool-level Alloc's returned blocks; at the cache level, the blocks at ``where``
    (request, group, table position) of the request's table after the step."""
    def choose(n: int, where: Any) -> Optional[list]:
        if where is None:
            return list(result) if isinstance(result, (list, tuple)) else None
        rid, g, start = where
        rs = obs.requests.get(rid)
        if rs is None:
            return None
        tables = (rs.table,) + tuple(rs.groups)
        return list(tables[g][start:start + n]) if g < len(tables) else None
    return choose


def _want_incremental(config: Config, incremental: Optional[bool]) -> bool:
    if incremental is not None:
        return incremental
    env = os.environ.get("KVSPEC_INCREMENTAL", "").strip().lower()
    if env in ("1", "on", "true", "yes"):
        return True
    if env in ("0", "off", "false", "no"):
        return False
    return config.num_blocks >= INCREMENTAL_MIN_BLOCKS


class TrackedList(list):
    """A list (the model's ref counts or hashes) that notes each index assigned, with
    the value it held before. Anything other than item assignment marks it all."""

    def __init__(self, items=()) -> None:
        super().__init__(items)
        self.log: dict = {}
        self.everything = False

    def __setitem__(self, i, v) -> None:
        if type(i) is int:
            log = self.log
            if i < 0:
                i += len(self)
            if i not in log:
                log[i] = list.__getitem__(self, i)
        else:
            self.everything = True
        list.__setitem__(self, i, v)

    def _all(self, *_a, **_kw) -> None:
        if "everything" in self.__dict__:  # not while unpickling
            self.everything = True

    def __delitem__(self, i):
        self._all()
        list.__delitem__(self, i)

    def __iadd__(self, other):
        self._all()
        return list.__iadd__(self, other)

    def __imul__(self, n):
        self._all()
        return list.__imul__(self, n)

    def insert(self, i, v):
        self._all()
        list.insert(self, i, v)

    def pop(self, *a):
        self._all()
        return list.pop(self, *a)

    def remove(self, v):
        self._all()
        list.remove(self, v)

    def clear(self):
        self._all()
        list.clear(self)

    def sort(self, **kw):
        self._all()
        list.sort(self, **kw)

    def reverse(self):
        self._all()
        list.reverse(self)


# StepContext's fields in the order ``Session._context`` passes them positionally (a step is
# built per op, on the model checker's hot path); another order: by name.
_CTX_POSITIONAL = tuple(f.name for f in fields(StepContext)) == (
    "op", "config", "traits", "prev", "obs", "model", "misuse", "error", "result", "expected", "shadow", "hashes")


class Session:
    # The model checker's hook: checks a step in place of ``check_step`` (it runs the
    # state invariants once per distinct state, see kvspec.mc.search); None: every check.
    step_check: Optional[Any] = None

    def __new__(cls, target: Optional[Target] = None, config: Optional[Config] = None,
                incremental: Optional[bool] = None):
        # no arguments: kvspec.mc.fork builds a bare Session to fill from a saved state
        if config is not None and config.level == "engine":  # the engine level's session (kvspec.engine.session)
            from kvspec.engine.session import EngineSession
            engine = EngineSession(target, config, incremental, cache_session=cls)
            coverage.instrument(engine.engine, "engine")  # what the run called (kvspec.check.coverage)
            return engine
        return super().__new__(cls)

    def __init__(self, target: Target, config: Config, incremental: Optional[bool] = None) -> None:
        self.target = target
        self.config = config
        self.traits = target.traits
        self.op_timeout = watchdog.default()  # seconds per target call (--op-timeout; an op and the read of the state after it count as one); None: no limit
        self.output = Tail()  # what the target printed during this session's calls
        self._streams = streams(self.output)
        watchdog.note_sigint()  # so that a target's own KeyboardInterrupt can be told from a Ctrl-C
        known = _OBSERVED_HANGS.get(id(target))
        self._hangs: Optional[dict] = known[1] if known is not None and known[0] is target else None
        # the seen hangs on this configuration whose steps before it this session may be replaying
        self._replaying: list = [] if self._hangs is None else [
            before for entries in self._hangs.values() for cfg, before, _ in entries if cfg == config]
        limit = self._limit()
        try:  # a target that cannot even be built or read in time is a broken target (exit 2), not a finding
            self.driver = self._call(limit, target.driver, config)
            coverage.instrument(self.driver, config.level)  # what the run called (kvspec.check.coverage)
            first_obs = self._call(limit, self.driver.observe)
        except OpTimeout as t:
            raise TargetError(f"target {target.name}: building or observing it did not return within "
                              f"{t.seconds:g} s (--op-timeout)") from None
        except _Escaped as x:
            raise TargetError(f"target {target.name}: building or observing it {_escape_words(x.exc)}") from None
        self.model = model_for(config, self.traits)
        self.shadow = ShadowKV(config.block_size) if config.level == "cache" else None
        self.hashes = HashMap()
        self.steps: list[Op] = []
        self.last_result: Any = None  # what the target returned for the last op
        self.last_expected: Any = None  # what the model said it should return (None after a misuse)
        self.dead = False  # a call hung (or tried to end the process): the target is not touched again
        self._dead_escape: Optional[BaseException] = None  # the SystemExit/KeyboardInterrupt that did it
        self.obs: Observation = first_obs
        self.initial: list[Violation] = self._with_output(
            check_step(self._context(None, self.obs, None, None, None, None)))
        # incremental checking (see the module docstring): on when asked and offered
        # (the incremental check knows nothing of KV-cache groups: the group-aware model goes the full way)
        # free order "any": the model follows the target's choice of blocks, read from a full
        # observation before the model's step, so such a target goes the full way
        self._follow = getattr(self._model_pool(), "order", None) == "any"
        self.incremental = (_want_incremental(config, incremental) and not hasattr(self.model, "groups")
                            and not self._follow
                            and callable(getattr(self.driver, "observe_delta", None))
                            and callable(getattr(self.driver, "track_changes", None)))
        self._live: Optional[LiveObservation] = None
        self._model_held = 0
        self.fast_steps = 0   # steps vouched for by the incremental check (the rest went the full way)
        if self.incremental and not self.initial:
            self._resync(self.obs)

    def __getattr__(self, name: str) -> Any:
        # In incremental mode ``obs`` is built on demand from the live observation.
        if name == "obs":
            live = self.__dict__.get("_live")
            if live is not None:
                obs = live.materialize()
                self.__dict__["obs"] = obs
                return obs
        raise AttributeError(name)

    def _limit(self) -> Optional[float]:
        """The op timeout, or at least ``REPLAY_GRACE_S`` while replaying the steps that led
        to a seen hang (module doc)."""
        t = self.op_timeout
        if self._replaying and t is not None and t < REPLAY_GRACE_S:
            return REPLAY_GRACE_S
        return t

    def _call(self, seconds: Optional[float], fn: Callable, *args: Any) -> Any:
        """``fn(*args)``, a call into the target: under ``seconds`` (the op timeout, see
        ``_limit``), its prints captured, SystemExit / KeyboardInterrupt (not a real
        Ctrl-C) turned into ``_Escaped``. On the hot path: two attribute swaps, no more."""
        so, se = sys.stdout, sys.stderr
        if CAPTURE:
            sys.stdout, sys.stderr = self._streams
        try:
            return watchdog.guarded(seconds, fn, *args)
        except (SystemExit, KeyboardInterrupt) as e:
            if isinstance(e, KeyboardInterrupt) and watchdog.real_interrupt(e):
                raise
            raise _Escaped(e) from e
        finally:
            sys.stdout, sys.stderr = so, se

    def _with_output(self, found: list[Violation]) -> list[Violation]:
        """The findings, each carrying the last of what the target printed (if anything)."""
        if not found or not self.output.total:
            return found
        text = self.output.text()
        return [replace(v, target_output=text) for v in found]

    def _context(self, op, obs, misuse, error, result, expected) -> StepContext:
        if _CTX_POSITIONAL:   # (a dataclass's __init__ binds positional arguments a few times faster)
            return StepContext(op, self.config, self.traits, self.obs, obs, self.model, misuse, error, result,
                               expected, self.shadow, self.hashes)
        return StepContext(op=op, config=self.config, traits=self.traits, prev=self.obs, obs=obs,
                           model=self.model, misuse=misuse, error=error, result=result, expected=expected,
                           shadow=self.shadow, hashes=self.hashes)

    @property
    def documents_misuse(self) -> bool:
        return bool(self.traits.misuse_errors)

    def misuse_reason(self, op: Op) -> Optional[str]:
        return self.model.misuse_reason(op)

    def apply(self, op: Op, misuse: Any = ASK) -> list[Violation]:
        """Run ``op`` on target and model; return the violations it exposed (most specific first).

        ``misuse``: what ``self.model.misuse_reason(op)`` returns in the model's present
        state, when the caller already has it (the model checker asks once per set of
        enabled ops, ``kvspec.mc.search``); by default the model is asked here."""
        live = self._live if self.incremental else None
        if live is not None:
            pool = self._arm_model()
            q_before, qlen_before = pool.queue, len(pool.queue)
        if misuse is ASK:
            misuse = self.model.misuse_reason(op)
        error: Optional[BaseException] = None
        result: Any = None
        if self.dead:
            return self._hung(op, None) if self._dead_escape is None else self._escaped(op, self._dead_escape)
        limit = self.op_timeout
        if self._hangs is not None:
            if op in self._hangs:
                secs = self._seen_hang(op)
                if secs is not None:
                    return self._hung(op, None, secs, seen=True)
            if self._replaying:
                i = len(self.steps)
                self._replaying = [b for b in self._replaying if len(b) > i and b[i] == op]
                limit = self._limit()
        # Where the state is read in full right after the op (not incremental, not following
        # the target's choice), one guarded call does both: a step sets up the guard (streams,
        # os._exit, the deadline) once, not twice (a tenth of a model checker's transition);
        # the op timeout then bounds the op and the reading of its state together.
        both = live is None and not self._follow
        obs: Optional[Observation] = None
        obs_error: Optional[BaseException] = None
        try:
            if both:
                result, error, obs, obs_error = self._call(limit, self._op_then_state, op)
            else:
                result = self._call(limit, self.driver.apply, op)
        except OpTimeout as t:
            return self._hung(op, t)
        except _Escaped as x:
            return self._escaped(op, x.exc)
        except TargetError:
            raise  # the adapter could not build the target's inputs or read its state: not a finding
        except Exception as e:  # the target's own failure is a finding, not ours
            error = e
        if error is not None:
            why = _binding_error(error)
            if why:
                raise TargetError(why) from None  # kvspec's own call did not fit the class: not a finding
        if both and obs is None:   # reading the state failed: the last observation stands in (as _observe)
            obs = self.obs
            if error is None:
                error = obs_error
        if self._follow and misuse is None and error is None:
            # free order "any": the model takes the blocks the target took, read off it now
            obs, error, ended = self._observe(op, limit, error)
            if ended is not None:
                return ended
            if error is None:
                self._model_pool().chooser = _chooser(obs, result)
        # A model that may follow the target's choice among the results it allows (a hit
        # between the floor it proves and the bound it states: GroupCacheModel) reads it here.
        # (a lookup in the instance's dict: ``hasattr`` pays for an AttributeError on every
        # other model, on every step; ``target_result`` is an instance field where it exists)
        follows = "target_result" in getattr(self.model, "__dict__", ())
        if follows:
            self.model.target_result = result if misuse is None and error is None else None
        try:
            expected = self.model.apply(op) if misuse is None else None
        finally:
            if self._follow:
                self._model_pool().chooser = None
            if follows:
                self.model.target_result = None
        if live is not None and (misuse is None) == (error is None):
            try:
                delta = self.driver.observe_delta()
            except Exception:
                delta = None
            if delta is not None and (self._fast(op, result, expected, delta, pool, q_before, qlen_before)
                                      if misuse is None else self._fast_rejected(error, delta, misuse)):
                self.steps.append(op)
                self.__dict__.pop("obs", None)
                self.last_result, self.last_expected = result, expected
                self.fast_steps += 1
                return []
        # The full way: what every step does without deltas, and the reference.
        if obs is None:
            obs, error, ended = self._observe(op, limit, error)
            if ended is not None:
                return ended
        if self.shadow is not None and misuse is None and error is None:
            self._write_shadow(op, result, obs)
        ctx = self._context(op, obs, misuse, error, result, expected)
        found = (self.step_check or check_step)(ctx)
        self.steps.append(op)
        self.obs = obs
        self.last_result, self.last_expected = result, expected
        if self.incremental:
            # The incremental check assumes the state before each step passed *every*
            # check. A valid, comparable step that found nothing ran them all; a rejected
            # misuse that found nothing left a state that had passed them as it was.
            if not found and (ctx.comparable or (misuse is not None and live is not None)):
                self._resync(obs)
            else:
                self._live = None
        return self._with_output(found) if found else found

    def _op_then_state(self, op: Op) -> tuple:
        """``driver.apply(op)``, then ``driver.observe()``, run by ``apply`` as one guarded
        call: (result, the op's error, the observation or None, the observer's error). A
        target's exception is returned, as ``apply`` and ``_observe`` treat one; a TargetError
        (kvspec's adapter could not do its part) and a BaseException (a timeout, an exit)
        go through."""
        result = error = None
        try:
            result = self.driver.apply(op)
        except TargetError:
            raise
        except Exception as e:
            error = e
        try:
            return result, error, self.driver.observe(), None
        except TargetError:
            raise
        except Exception as e:
            return result, error, None, e

    def _observe(self, op: Op, limit: Optional[float], error: Optional[BaseException]):
        """The target's state after ``op``: (observation, error, None), the error being the
        step's own or else the observer's (the last observation stands in); or
        (None, error, findings) when reading it hung or tried to end the process."""
        try:
            return self._call(limit, self.driver.observe), error, None
        except OpTimeout as t:
            return None, error, self._hung(op, t)
        except _Escaped as x:
            return None, error, self._escaped(op, x.exc)
        except TargetError:
            raise
        except Exception as e:
            return self.obs, error if error is not None else e, None

    def _hung(self, op: Op, t: Optional[OpTimeout], secs: Optional[float] = None,
              seen: bool = False) -> list[Violation]:
        """A target call did not return within the op timeout: a NO_HANG finding. The
        target may be mid-update (or still running in an abandoned thread), so the
        session is dead from here on: every later op reports the same. ``seen``: this
        call, after these steps, already hung on this target (not called again)."""
        if secs is None:
            secs = (t.seconds if t is not None else 0.0) or self.op_timeout or 0.0
        if t is not None:  # remembered, so that the same steps on this target do not hang again
            known = _OBSERVED_HANGS.get(id(self.target))
            if known is None or known[0] is not self.target:
                known = _OBSERVED_HANGS[id(self.target)] = (self.target, {})
            known[1].setdefault(op, []).append((self.config, tuple(self.steps), secs))
            self._hangs = known[1]
            self._replaying = []
        self.dead = True
        self.steps.append(op)
        self.last_result = self.last_expected = None
        return self._with_output([Violation(
            "NO_HANG", f"{op!r} did not return within the op timeout of {secs:g} s",
            "the state before it is the last observed; the target is not observed again")])

    def _seen_hang(self, op: Op) -> Optional[float]:
        """The op timeout ``op`` hung under after exactly these steps on this target, if it
        did, and if this session's limit is no longer than that one (a longer limit might
        have seen it return)."""
        for config, before, secs in self._hangs.get(op, ()):
            if config == self.config and self.op_timeout is not None and self.op_timeout <= secs \
                    and len(before) == len(self.steps) and list(before) == self.steps:
                return secs
        return None

    def _escaped(self, op: Op, e: BaseException) -> list[Violation]:
        """The target called sys.exit() or raised KeyboardInterrupt: a NO_CRASH finding,
        whether or not the op was valid (leaving the process is no way to refuse one).
        What state the target was left in is not read."""
        self.dead = True  # later ops are not tried on a target that tried to end the process
        self.steps.append(op)
        self.last_result = self.last_expected = None
        self._dead_escape = e
        return self._with_output([Violation(
            "NO_CRASH", f"{op!r}: the target {_escape_words(e)}; kvspec caught it, so the process did not end",
            "the state after it is not observed")])

    # -- incremental checking ------------------------------------------------------
    def _resync(self, obs: Observation) -> None:
        """Take a full observation as the live one, and (re)arm the driver's tracking."""
        self._live = None
        if obs.queue_problems or len(set(obs.queue)) != len(obs.queue):
            return  # not a clean list: stay on the full path until it is
        try:
            armed = self.driver.track_changes()
        except Exception:
            armed = False
        if not armed:
            return
        self._live = LiveObservation(obs)
        self.__dict__["obs"] = obs
        pool = self._arm_model(force=True)
        self._model_held = sum(1 for b in pool.usable() if pool.ref[b] > 0)

    def _model_pool(self):
        return self.model.pool if isinstance(self.model, CacheModel) else self.model

    def _arm_model(self, force: bool = False):
        """Wrap the model's ref and hash lists so that a step's changes can be read back."""
        pool = self._model_pool()
        for name in ("ref", "hash"):
            lst = getattr(pool, name)
            if type(lst) is not TrackedList:
                setattr(pool, name, TrackedList(lst))
            else:
                lst.log.clear()
                lst.everything = False
        return pool

    def _fast(self, op: Op, result: Any, expected: Any, delta, pool, q_before, qlen_before) -> bool:
        """Advance the live observation by ``delta`` if the incremental check vouches for
        the step; leave everything as it was (and return False) otherwise."""
        live = self._live
        ctx = StepContext(op=op, config=self.config, traits=self.traits, prev=RequestsView(live.requests),
                          obs=RequestsView(delta.requests), model=self.model, result=result, expected=expected,
                          shadow=self.shadow, hashes=self.hashes)
        if not ctx.comparable or type(pool.ref) is not TrackedList or type(pool.hash) is not TrackedList \
                or pool.ref.everything or pool.hash.everything:
            return False
        links = {b: (d[2], d[3]) for b, d in delta.blocks.items()}
        walk = splice_walk(live.queue, live.is_queued, len(live.blocks), links, delta.head_next, delta.tail_prev)
        if walk is None:
            return False
        queue, visited, left = walk
        new = {}
        for b, d in delta.blocks.items():
            new[b] = BlockState(d[0], d[1], b in visited)
        for b in left:
            if b not in new:
                old = live.blocks[b]
                new[b] = BlockState(old.ref, old.hash, False)
        model_changed = set(pool.ref.log)
        model_changed.update(pool.hash.log)
        step = FastStep(ctx=ctx, live=live, new=new, queue=queue, delta=delta, pool=pool,
                        model_changed=model_changed, model_held=self._model_held,
                        queue_may_differ=(queue is not live.queue or pool.queue is not q_before
                                          or len(pool.queue) != qlen_before or bool(pool.ref.log)))
        if self.shadow is not None:
            self._write_shadow(op, result, None, delta.requests, live.requests)
        if not fast_check(step):
            return False
        # commit
        for b, st in new.items():
            live.blocks[b] = st
        # Equal to the model's queue now; keeping the model's own int objects makes the
        # next comparison (and the slices of the next walk) mostly identity checks.
        live.queue = list(pool.queue) if step.queue_may_differ else queue
        for h, ids in delta.index.items() if not delta.index_complete else ():
            if ids is None:
                live.index.pop(h, None)
            else:
                live.index[h] = ids
        if delta.index_complete:
            live.index = dict(delta.index)
        live.free_count = delta.free_count
        live.requests = dict(delta.requests)
        live.zero = step.zero
        self._model_held = step.model_held
        step.commit_hashes(self.hashes)
        return True

    def _fast_rejected(self, error: BaseException, delta, misuse: Optional[str] = None) -> bool:
        """A misuse the target refused with a documented error: clean if nothing observable
        changed (what ATOMIC_REJECT asks; every other check then sees the clean state
        before, and skips or passes on a misuse)."""
        live = self._live
        documented = documented_errors(self.traits, misuse)
        if not documented or not isinstance(error, documented) or delta.free_count != live.free_count \
                or delta.index_complete or dict(delta.requests) != live.requests:
            return False
        for b, d in delta.blocks.items():
            old = live.blocks[b]
            if d[0] != old.ref or d[1] != old.hash:
                return False
        for h, ids in delta.index.items():
            if ids != live.index.get(h):
                return False
        links = {b: (d[2], d[3]) for b, d in delta.blocks.items()}
        walk = splice_walk(live.queue, live.is_queued, len(live.blocks), links, delta.head_next, delta.tail_prev)
        return walk is not None and not walk[2] and all(live.blocks[b].queued for b in walk[1]) \
            and (walk[0] is live.queue or walk[0] == live.queue)

    def _write_shadow(self, op: Op, result: Any, obs: Optional[Observation], requests=None, before_requests=None) -> None:
        """Record the KV the target just computed, at the slots its tables name."""
        assert isinstance(self.model, CacheModel)
        requests = obs.requests if requests is None else requests
        before_requests = self.obs.requests if before_requests is None else before_requests
        if hasattr(self.model, "groups"):
            from kvspec.spec.group_checks import write_shadow
            null = obs.null_block if obs is not None else self.obs.null_block
            write_shadow(self.shadow, self.model, op, result, requests, before_requests, null)
            return
        for rid, rs in requests.items():
            q = self.model.reqs.get(rid)
            if q is None:
                continue
            before = before_requests.get(rid)
            if isinstance(op, Admit) and op.req == rid and isinstance(result, int):
                start = result  # positions below the hit are read from the cache, not written
            elif before is not None:
                start = before.computed
            else:
                start = rs.computed
            self.shadow.write(rs.table, q.tokens, start, min(rs.computed, len(rs.table) * self.config.block_size,
                                                             len(q.tokens)))


@dataclass
class Outcome:
    """Where a step list first fails: ``index`` of the failing step (-1: at construction)."""
    index: Optional[int]
    violations: list[Violation] = field(default_factory=list)
    steps: list[Op] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return self.index is not None

    @property
    def invariant(self) -> Optional[str]:
        return self.violations[0].invariant if self.violations else None


def run_steps(target: Target, config: Config, steps: Sequence[Op]) -> Outcome:
    """Replay ``steps`` from a fresh allocator; stop at the first violation."""
    session = Session(target, config)
    if session.initial:
        return Outcome(-1, session.initial, [])
    for i, op in enumerate(steps):
        found = session.apply(op)
        if found:
            return Outcome(i, found, list(steps[: i + 1]))
    return Outcome(None, [], list(steps))
