"""One run at the engine level: engine events in, findings out, with the same surface as
``kvspec.check.session.Session`` (``apply``, ``steps``, ``initial``, ``misuse_reason``),
which builds an ``EngineSession`` for a ``Config`` whose level is ``"engine"``. So the
machines' base, ``run_steps``, ddmin and the repro files' ``replay`` drive the engine
level unchanged.

Each event runs on the engine (``EngineDriver``). Every call its scheduler made into the
KV manager during the event is then replayed, in order, through a cache-level
``Session`` over a stand-in target (``_Replayed``) that answers with what the real
manager returned and the state it was observed in right after the call: so the
reference model, the hash map, the shadow KV store and the whole catalogue judge the
engine's own allocations. Last, the engine's decisions are checked against what the
manager holds (``kvspec.engine.checks``).

A call the cache level has no op for (``translate.Unexpressible``: vLLM's placeholder
drafts on a new decode request) ends the model's part of that run; the engine-level
checks go on to its end.
"""
from __future__ import annotations

import dataclasses
import sys
from typing import Any, Optional

from kvspec.engine.checks import check_event, check_reset
from kvspec.engine.drivers import engine_driver
from kvspec.engine.kv_reads import EngineKV
from kvspec.engine.protocol import EngineDriver, StepFacts
from kvspec.engine.translate import Unexpressible, engine_model, translate
from kvspec.errors import TargetError
from kvspec.spec.config import Config
from kvspec.spec.observation import Observation
from kvspec.spec.ops import Abort, Arrive, EngineStep, Op, ResetPrefixCache, StreamInput
from kvspec.spec.violation import Violation
from kvspec.targets.base import Driver, Target
from kvspec.targets import watchdog
from kvspec.targets.watchdog import OpTimeout
from kvspec.targets.target_output import Tail, streams


class _ReplayDriver(Driver):
    """Answers each cache-level op with the result and observation the engine recorded."""

    def __init__(self, first: Observation) -> None:
        self.obs = first
        self.result: Any = None

    def push(self, result: Any, obs: Observation) -> None:
        self.result, self.obs = result, obs

    def apply(self, op: Op) -> Any:
        return self.result

    def observe(self) -> Observation:
        return self.obs


class _Replayed(Target):
    """The engine's target as the cache-level Session sees it: its name and traits, and a
    driver that replays the engine's manager calls."""

    def __init__(self, target: Target, first: Observation) -> None:
        self.name = target.name
        self.traits = target.traits   # (the group-aware model only for targets that declare cache_features:
        # it does not follow nano-vllm's admit_all_blocks admission)
        self.replay = _ReplayDriver(first)

    def driver(self, config: Config) -> Driver:
        return self.replay

    def describe(self) -> str:
        return self.name


class EngineSession:
    """The engine level's Session (see the module doc)."""

    step_check: Optional[Any] = None

    def __init__(self, target: Target, config: Config, incremental: Optional[bool] = None, *,
                 cache_session: type) -> None:
        # cache_session: kvspec.check.session.Session, handed in by it (Session(target, config)
        # with an engine-level config builds this), so this package never imports the checker
        self.target = target
        self.config = config
        self.traits = target.traits
        self.op_timeout = watchdog.default()
        self.output = Tail()  # what the engine printed during this session's events
        self._streams = streams(self.output)
        self.engine: EngineDriver = engine_driver(target, config)
        # the policies the package's code settles (admission, whole-prompt hits) were read at
        # load, for both levels (kvspec.targets.nano_reading)
        self._replayed = _Replayed(target, self.engine.observe())
        self.cache = cache_session(self._replayed, dataclasses.replace(config, level="cache", spec_tokens=0),
                             incremental=False)
        engine_model(self.cache.model)
        self.initial: list[Violation] = self.cache.initial
        self.steps: list[Op] = []
        self.arrived: set[str] = set()
        self.last_result: Any = None
        self.dead = False
        # why the model stopped following the engine (Unexpressible), or never started to (the engine says)
        self.unfollowed: Optional[str] = getattr(self.engine, "unfollowed", None)
        self._before: dict[str, int] = {}      # computed tokens per request before the current event
        self.last_reset: Optional[bool] = None  # what the last ResetPrefixCache returned
        self.sessions: set[str] = set()        # requests that arrived as streaming sessions
        self._tokens: dict[str, tuple[int, ...]] = {}   # live requests' tokens when the last step was scheduled
        self.kv = EngineKV(self.engine.block_size, loaded_externally=getattr(config, "connector", None) is not None)

    @property
    def model(self) -> Any:
        return self.cache.model

    @property
    def obs(self) -> Observation:
        return self.cache.obs

    @property
    def documents_misuse(self) -> bool:
        return False

    def misuse_reason(self, op: Op) -> Optional[str]:
        if isinstance(op, Arrive):
            if op.req in self.arrived:
                return f"request {op.req} already arrived"
            if not op.prompt:
                return "empty prompt"
            if op.max_tokens < 1:
                return f"max_tokens {op.max_tokens} is not positive"
        if isinstance(op, StreamInput):
            if op.req not in self.sessions:
                return f"{op.req} is not a streaming session that arrived"
            if not op.prompt or op.max_tokens < 1:
                return "an empty input or a max_tokens that is not positive"
        if isinstance(op, EngineStep) and (op.drafts < 0 or not 0 <= op.accepted):
            return "negative draft or accepted count"
        return None

    def _captured(self, op: Op) -> Optional[StepFacts]:
        """``_run`` under the op timeout, with what the engine prints (its print()s, its log
        lines) kept in the session's Tail, as the cache level keeps a target's: never inside
        --json's stdout."""
        saved = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = self._streams
        try:
            return watchdog.guarded(self.op_timeout, self._run, op)
        finally:
            sys.stdout, sys.stderr = saved

    def _run(self, op: Op) -> Optional[StepFacts]:
        e = self.engine
        if isinstance(op, Arrive):
            kw: dict[str, Any] = {}
            if op.priority:   # only drawn for an engine with the priority policy (kvspec.vllm.inputs)
                kw["priority"] = op.priority
            if op.session:    # only drawn for an engine with streaming sessions (kvspec.vllm.inputs)
                kw["session"] = True
            e.arrive(op.req, tuple(op.prompt), op.max_tokens, op.extra, **kw)
            self.arrived.add(op.req)
            self.kv.arrived(op.req, op.extra)
            if op.session:
                self.sessions.add(op.req)
            return None
        if isinstance(op, StreamInput):
            stream = getattr(e, "stream", None)
            if stream is None:
                raise TargetError(f"{op!r}: this engine has no streaming sessions")
            stream(op.req, tuple(op.prompt), op.max_tokens)
            if self.unfollowed is None and hasattr(e, "manager_calls"):
                # the session's tokens after its kept prefix are replaced: a request the cache-level
                # model has no op for; the engine-level checks (KV_INTEGRITY included) go on
                self.unfollowed = "a streaming session's input replaced its tokens after its kept prefix"
            return None
        if isinstance(op, EngineStep):
            token = op.token
            if self.kv.wanted:   # what the step's scheduled tokens are (KV_INTEGRITY's writes)
                self._tokens = e.tokens()
            return e.step(lambda req, pos: token, op.drafts, op.accepted)
        if isinstance(op, Abort):
            e.abort(op.req)
            return None
        if isinstance(op, ResetPrefixCache):
            reset = getattr(e, "reset_prefix_cache", None)
            if reset is None:
                raise TargetError(f"{op!r}: this engine has no reset_prefix_cache")
            self.last_reset = reset(op.preempt_running) if op.preempt_running else reset()
            return None
        raise TargetError(f"{op!r} is not an engine-level op")

    def apply(self, op: Op) -> list[Violation]:
        self.steps.append(op)
        if self.dead:
            return [Violation("NO_CRASH", f"{op!r}: the engine failed earlier and is not driven again")]
        try:
            facts = self._captured(op)
        except OpTimeout as t:
            self.dead = True
            return [Violation("NO_HANG", f"{op!r} did not return within the op timeout of {t.seconds:g} s")]
        except TargetError:
            raise
        except Exception as ex:  # the engine's own failure on a valid event is a finding
            self.dead = True
            from kvspec.spec.blame import crash_words  # where, and the caller that passed a rejected value
            words, where, caller = crash_words(ex, tuple(getattr(self.target.traits, "misuse_errors", ()) or ()))
            return [Violation("NO_CRASH", f"{op!r} is valid here but the engine raised {type(ex).__name__}: {ex}{words}",
                              where=where, caller=caller)]
        except SystemExit as ex:  # sys.exit() or os._exit() (watchdog.TargetCalledExit) inside the engine
            self.dead = True
            what = str(ex) if isinstance(ex, watchdog.TargetCalledExit) else f"called sys.exit({ex.code!r})"
            return [Violation("NO_CRASH", f"{op!r} is valid here but the engine {what}: it must not end the process")]
        self.last_result = facts
        reported = hasattr(self.engine, "manager_calls")
        before = self._before
        calls = self.engine.manager_calls() if reported else []
        allocated: dict[str, int] = {}
        held = dict(before)  # positions below these already had a slot when the step was scheduled
        for call in calls:
            if call.ok and call.kind in ("admit", "grow"):
                allocated[call.req] = allocated.get(call.req, 0) + call.new
            if call.kind in ("preempt", "finish"):
                held[call.req] = 0
            elif call.ok and call.kind == "admit":
                # an admission holds its prefix-cache hit: a whole-prompt hit admitted and decoded in
                # one event (voxcpm) recomputes its last prompt token in a slot the admission holds
                held[call.req] = call.hit
            if self.unfollowed is not None:
                continue
            try:
                cop, result = translate(call, self.cache.model)
            except Unexpressible as why:
                self.unfollowed = str(why)
                continue
            if cop is None:
                continue
            self._replayed.replay.push(result, call.obs if call.obs is not None else self.engine.observe())
            found = self.cache.apply(cop)
            if found:
                return [dataclasses.replace(v, message=f"{op!r}, at the scheduler's call {cop!r}: {v.message}")
                        for v in found]
        self._before = dict(self.engine.computed())
        if isinstance(op, ResetPrefixCache):
            found = check_reset(op, self.last_reset, self.engine)
            if found:
                return found
            if op.preempt_running and self.last_reset is False:
                return [Violation("ACCOUNTING", f"{op!r}: reset_prefix_cache returned False after the engine "
                                                f"preempted every running request")]
        found = check_event(op, facts, self.engine, allocated if reported else None, held,
                            shared_slots=bool(getattr(self.traits, "whole_prompt_hits", False)))
        if isinstance(op, EngineStep) and facts is not None:
            found += self.kv.step(repr(op), facts, self._tokens)
        return found
