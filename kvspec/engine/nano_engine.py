"""A nano-vllm package's own ``Scheduler`` driving its own ``BlockManager`` (engine level).

Targets: ``nanovllm[:PKG]`` (an installed derivative: ``PKG/engine/scheduler.py``) and a
user's fork given by a file of its package (``REPO/nanovllm/engine/block_manager.py`` or
``scheduler.py``): the ``scheduler.py`` beside it is imported under its real name.

Loading and the stand-in config: ``kvspec.engine.nano_load``.

Driving. ``arrive`` builds the package's own Sequence (``NanoDriver.new_seq``: its
constructor by signature, default SamplingParams, the run's block size) with
``max_tokens`` set, and calls ``add``. ``step`` calls ``schedule()`` (whose result may be a
list of sequences or of ``(seq, scheduled tokens)`` pairs, ``(seqs, is_prefill)`` or an object with a ``.sequences``/``.seqs``/
``.scheduled`` field: ``nano_load.check_scheduler`` refuses other shapes before the first
step, ``_batch`` any it meets later), reads what it decided
(the batch, each sequence's scheduled tokens: ``num_scheduled_tokens`` where the package
sets it (chunked prefill), else the uncached prompt on a prefill step and one token on a
decode step; preemptions, from the queues), then plays the model: every scheduled
sequence samples ``sample(req, len(seq))``, and the package's ``postprocess(seqs,
token_ids[, is_prefill])`` appends and finishes. A package without ``postprocess``
(nano-vllm-voxcpm: its model engine appends) gets what its ``LLMEngineBase.step`` does:
append, mark ``seq.stoped`` at ``max_tokens``, then ``scheduler.finish(seq)``. Draft tokens:
nano-vllm has no speculative decoding; ``drafts`` and ``accepted`` are ignored
(``spec_decode`` is False). ``abort`` calls the scheduler's ``cancel``/``abort`` where it has
one; nano-vllm and its forks have none (their engines cannot abort), so kvspec removes a
waiting request from the queue and finishes a running one as the package's own finish
does (``deallocate``, off ``running``): ``native_abort`` says which.

Manager calls. A recording proxy (``kvspec.engine.recording``) stands in front of the
scheduler's ``block_manager`` and records every public method call, whatever its name, with
its arguments bound by name. Once the step's decisions are known, each call is read from
the method's own code (``kvspec.engine.call_meaning``) and what it did to its Sequence's
table, and replayed through the cache-level model (``ManagerCall``): a call that fills an
empty table is an admission (its hit: the Sequence's ``num_cached_tokens``, else an argument
that names cached blocks or tokens), one that adds room to a table a growth (the tokens:
what the scheduler scheduled for that row; a row given room only in ``postprocess``, after
the forward pass, is a late growth, and the engine-level SLOTS check reports the row), one
that empties a table a preemption while ``schedule()`` runs and a finish otherwise, and one
that makes hashes visible a publication (``published``: the model caches only what the
engine has published, ``kvspec.engine.follow``). A refused ``can_*`` gate is a refused
admission (an empty table) or growth; a refused growth is reported only when the scheduler
then preempts that sequence or keeps it (nano-vllm asks again after each preemption it
makes for it). A call that changes the manager in any other way (a copy-on-write remap) is
refused in one line naming it, never a finding.

Observation. ``kvspec.targets.nano_driver.NanoDriver``'s, the cache level's, reading the
scheduler's real ``block_manager``; a request's ``computed`` is the engine's (the tokens
whose KV the steps so far computed, the prefix hit included), not ``len(seq)``.

This module is longer than 450 lines since it records every call the scheduler makes
into the manager (issue 36) and interprets each by its code: the recording, the
publication timing and the batch-shape reading share one driver's per-step state.
Moving the interpretation (``_interpret``, ``_publications``) into its own module is a
follow-up.
"""
from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from typing import Any, Callable, Optional

from kvspec.engine.nano_load import (BATCH_FIELDS, SCHEDULER_CONTRACT, EngineParts, add_method,  # noqa: F401
                                     check_scheduler, config_reads, load_file_engine, load_package_engine,
                                     scheduler_arguments, scheduler_file, stand_in_config)
from kvspec.engine.call_meaning import CACHED_BLOCKS, CACHED_TOKENS, TOKENS, argument_roles, bind, meaning
from kvspec.engine.protocol import ManagerCall, Sampler, StepFacts
from kvspec.engine.recording import RawCall, RecordingManager, leading_published, refuse_uninterpretable
from kvspec.errors import TargetError, UsageError
from kvspec.targets.file_import import reroute_logging
from kvspec.spec.config import Config
from kvspec.spec.observation import Observation, RequestState

NEVER_EOS = -1  # nano-vllm's own "no eos" value; the machines sample tokens >= 0


# -- the driver --------------------------------------------------------------------------------
class NanoEngineDriver:
    """An EngineDriver (``kvspec.engine.protocol``) over a nano-vllm package's Scheduler."""

    spec_decode = False

    def __init__(self, parts: EngineParts, num_blocks: int, block_size: int, max_num_seqs: Optional[int] = None,
                 max_num_batched_tokens: Optional[int] = None, names: Any = None) -> None:
        from kvspec.targets.nano_api import BOOLEAN, detect_nano_api
        from kvspec.targets.nano_driver import NanoDriver
        from kvspec.targets.nanovllm_target import caching_support, default_caching

        self.parts, self.block_size, self.num_blocks = parts, block_size, num_blocks
        self.names = names if names is not None else _names_of(parts)
        self._meanings: dict[str, Any] = {}  # manager method -> its Meaning (call_meaning), read once
        self.max_model_len = num_blocks * block_size
        values = {"num_kvcache_blocks": num_blocks, "kvcache_block_size": block_size, "eos": NEVER_EOS,
                  "max_model_len": self.max_model_len,
                  "max_num_batched_tokens": max(max_num_batched_tokens or 0, self.max_model_len)}
        if max_num_seqs is not None:
            values["max_num_seqs"] = max_num_seqs
        self.config = stand_in_config(parts, values)
        refuse_uninterpretable(parts.name, parts.manager_cls, parts.seq_cls, parts.scheduler_file)
        try:
            kwargs = scheduler_arguments(parts, values)
            self.sched = parts.scheduler_cls(self.config) if kwargs is None else parts.scheduler_cls(**kwargs)
        except TargetError:
            raise
        except Exception as e:
            from kvspec.targets.contract import describe_exception  # a bare assert: where, and its line
            raise TargetError(f"target {parts.name}: cannot build its Scheduler: {describe_exception(e)}") from None
        reroute_logging()  # handlers its constructor set up: their lines go to the captured output
        check_scheduler(parts.name, self.sched)
        self.add_name = add_method(self.sched) or "add"
        mgr = getattr(self.sched, "block_manager", None)
        if mgr is None:
            raise TargetError(f"target {parts.name}: its Scheduler keeps no block_manager")
        try:
            support = caching_support(parts.manager_cls, parts.seq_cls, None, self.names)
            # the API generation matters only to the cache level's driving; the engine level
            # reads each call from its code, so a manager of no known generation is still observed
            try:
                api = detect_nano_api(parts.manager_cls, self.names)
            except TargetError:
                api = BOOLEAN
            # The cache level's driver, as the observer of the scheduler's own manager.
            self.view = NanoDriver(parts.manager_cls, parts.seq_cls, api,
                                   Config(level="cache", num_blocks=num_blocks, block_size=block_size,
                                          caching=default_caching(support) != "off"), names=self._observer_names(),
                                   caching_support=support)
        except (TargetError, UsageError) as e:  # one format at every level: the target's name first
            msg = str(e)
            raise TargetError(msg if msg.startswith("target ") else f"target {parts.name}: {msg}") from None
        self.view.mgr = mgr
        if self.view.bs != block_size or getattr(mgr, "block_size", block_size) != block_size:
            raise TargetError(f"target {parts.name}: its BlockManager keeps block size "
                              f"{getattr(mgr, 'block_size', '?')}, not the run's {block_size}")
        self.sched.block_manager = RecordingManager(mgr, self)
        self.phase = "idle"                 # "schedule" while schedule() runs: a free then is a preemption
        self.calls: list[ManagerCall] = []
        self.raw: list[RawCall] = []        # the manager calls since they were last read (record)
        self.refused: dict[str, ManagerCall] = {}  # req -> its latest refused growth in this schedule()
        self.seen: dict[str, int] = {}      # req -> its length at its last successful allocation
        self.published: dict[str, int] = {}  # req -> tokens of its blocks the engine has published
        self.shown: dict[str, int] = {}     # req -> its computed tokens as its latest ManagerCall showed them
        self.arg_tokens: dict[str, int] = {}  # req -> the token count its allocation call passed this step
        self.pair_tokens: dict[str, int] = {}  # req -> its tokens, where schedule() returns (seq, n) pairs
        self.rows: Optional[list] = None     # those pairs, as returned (postprocess takes them back)
        self.seqs: dict[str, Any] = {}      # live requests (waiting or running)
        self.req_of: dict[int, str] = {}    # id(seq) -> req
        self.max_tokens: dict[str, int] = {}
        self.done: dict[str, int] = {}      # req -> tokens whose KV the engine computed
        self._last_seq: Any = None          # the Sequence of the last call (can_allocate(num_tokens) asks for it)
        post = getattr(self.sched, "postprocess", None)
        self.post_args = _positional(post) if callable(post) else 0
        # postprocess(seqs, token_ids, <the indexes of the seqs that sampled>) (v1-style nano-vllm)
        self.post_indexes = self.post_args >= 3 and _third_is_indexes(post)
        # postprocess(<the object schedule() returned>, token_ids): named for it, not for the sequences
        self.post_takes_output = callable(post) and _first_is_output(post)
        self.native_abort = next((m for m in ("abort", "cancel", "abort_request") if callable(getattr(self.sched, m,
                                                                                                      None))), None)

    # -- protocol ----------------------------------------------------------------------------
    def arrive(self, req: str, prompt: tuple[int, ...], max_tokens: int, extra: Optional[str] = None) -> None:
        if req in self.seqs:
            raise ValueError(f"request {req} already exists")
        if max_tokens < 1 or len(prompt) + max_tokens > self.max_model_len:
            raise ValueError(f"request {req}: prompt {len(prompt)} + max_tokens {max_tokens} tokens do not fit "
                             f"max_model_len {self.max_model_len}")
        seq = self.view.new_seq(list(prompt))
        _set_max_tokens(seq, max_tokens)
        self.seqs[req], self.req_of[id(seq)], self.max_tokens[req], self.done[req] = seq, req, max_tokens, 0
        getattr(self.sched, self.add_name)(seq)

    def step(self, sample: Sampler, drafts: int = 0, accepted: int = 0) -> StepFacts:
        sch = self.sched
        if sch.is_finished():
            return StepFacts(scheduled={})
        was_running = {r for r in self._reqs(sch.running)}
        self.phase = "schedule"
        self.arg_tokens, self.pair_tokens, self.rows = {}, {}, None
        try:
            result = sch.schedule()
        finally:
            self.phase = "update"
        seqs, is_prefill = self._batch(result)
        waiting = set(self._reqs(sch.waiting))
        preempted = tuple(sorted(r for r in was_running if r in waiting))
        extents = {self.req_of[id(seq)]: self._extent(seq, is_prefill) for seq in seqs if id(seq) in self.req_of}
        granted = self._interpret(extents)
        # scheduled rows the scheduler gave no room before the forward pass: a growth for them in
        # postprocess is for the tokens this step computed (too late: check_event's SLOTS says so)
        late = {r: e for r, e in extents.items() if r not in granted}
        self.calls += self.refused.values()  # refusals the scheduler kept (neither appended nor preempted)
        self.refused.clear()
        for r in preempted:
            self.done[r] = 0
        scheduled, slots, start = {}, {}, {}
        for seq in seqs:
            r = self.req_of[id(seq)]
            s, n = extents[r]
            table = list(seq.block_table)
            scheduled[r], start[r] = n, s
            slots[r] = tuple(table[p // self.block_size] * self.block_size + p % self.block_size
                             for p in range(s, s + n) if p // self.block_size < len(table))
            self.done[r] = s + n
        tokens = [sample(self.req_of[id(seq)], len(seq)) for seq in seqs]
        self._postprocess(seqs, tokens, is_prefill, result)
        self._interpret({}, late)
        self._publications()
        self.phase = "idle"
        live = set(self._reqs(sch.running)) | set(self._reqs(sch.waiting))
        finished = tuple(sorted(r for r in self.seqs if r not in live))
        for r in finished:
            self._forget(r)
        return StepFacts(scheduled=scheduled, preempted=preempted, finished=finished, slots=slots, start=start)

    def _batch(self, result: Any) -> "tuple[list, Optional[bool]]":
        """(the scheduled sequences, is_prefill or None) out of what ``schedule()`` returned:
        a list or tuple of sequences, ``(seqs, is_prefill)``, or an object with a
        ``.sequences``/``.seqs``/``.scheduled`` field (and ``.is_prefill``, if it has one);
        any other shape is refused in one line (it is kvspec's mismatch, not a finding)."""
        if result is None:
            return [], None
        if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], bool):
            return list(result[0]), result[1]
        if isinstance(result, (list, tuple)) or type(result).__name__ == "deque":
            items = list(result)
            if all(id(x) in self.req_of or isinstance(x, self.parts.seq_cls) for x in items):
                return items, None
            pairs = _pairs(items, self.req_of, self.parts.seq_cls)
            if pairs is not None:  # [(seq, its scheduled tokens), ...]: the count is the scheduler's word
                self.pair_tokens = {self.req_of[id(q)]: n for q, n in pairs if id(q) in self.req_of}
                self.rows = items  # postprocess gets the pairs, as the package's own engine passes them
                return [q for q, _ in pairs], None
        for f in BATCH_FIELDS:
            v = getattr(result, f, None)
            if isinstance(v, (list, tuple)) or type(v).__name__ == "deque":
                flag = getattr(result, "is_prefill", None)
                return list(v), flag if isinstance(flag, bool) else None
        raise TargetError(f"target {self.parts.name}: its Scheduler's schedule() returned {type(result).__name__}, "
                          f"which kvspec cannot read a batch from (it reads a list of sequences, of (sequence, tokens) pairs, (seqs, is_prefill), "
                          f"or an object with a {'/'.join('.' + f for f in BATCH_FIELDS)} field)")

    def abort(self, req: str) -> None:
        seq = self.seqs.get(req)
        if seq is None:
            return
        sch = self.sched
        self.phase = "abort"
        if self.native_abort is not None:
            fn = getattr(sch, self.native_abort)
            fn(getattr(seq, "seq_id", seq) if _positional(fn) and not _takes_seq(fn) else seq)
        else:  # through the recorder: a finish (of a waiting request's empty table: nano-vllm's no-op)
            _mark(seq, "FINISHED")
            getattr(sch.block_manager, self._free_method())(seq)
            for queue in (sch.waiting, sch.running):
                if any(s is seq for s in queue):
                    queue.remove(seq)
        self._interpret({})
        self.phase = "idle"
        self._forget(req)

    def _free_method(self) -> str:
        """The manager's free (kvspec's ``deallocate``, by its declared name, else the method
        whose code empties a Sequence's table)."""
        cls = self.parts.manager_cls
        name = self.names.resolve(cls, "deallocate") if self.names is not None else None
        if name:
            return name
        for attr in dir(cls):
            if not attr.startswith("_") and callable(getattr(cls, attr, None)) and self.meaning_of(attr).clears:
                return attr
        raise TargetError(f"target {self.parts.name}: its BlockManager has no method that frees a sequence's "
                          f"blocks (declare deallocate in [tool.kvspec.names])")

    def observe(self) -> Observation:
        self.view.seqs = dict(self.seqs)
        self.view.running = {r for r, s in self.seqs.items() if list(s.block_table)}
        obs = self.view.observe()
        return dataclasses.replace(obs, requests={r: RequestState(rs.table, self.done.get(r, 0))
                                                  for r, rs in obs.requests.items()})

    def tables(self) -> dict[str, tuple[int, ...]]:
        return {r: tuple(s.block_table) for r, s in self.seqs.items()}

    def computed(self) -> dict[str, int]:
        return dict(self.done)

    def tokens(self) -> dict[str, tuple[int, ...]]:
        return {r: tuple(s.token_ids) for r, s in self.seqs.items()}

    # -- forking, for the model checker (as NanoDriver forks: deep copies, Sequences attribute
    # by attribute, never pickling) ---------------------------------------------------------
    def snapshot(self) -> dict:
        from kvspec.targets.nano_driver import _clone_state
        rec = self.sched.block_manager
        rec._engine = None  # not copied along (restore points the copy's recorder at the copy)
        try:
            return _clone_state(self.__dict__)
        finally:
            rec._engine = self

    def restore(self, snap: dict) -> "NanoEngineDriver":
        from kvspec.targets.nano_driver import _clone_state
        d = object.__new__(type(self))
        d.__dict__.update(_clone_state(snap))
        d.req_of = {id(seq): r for r, seq in d.seqs.items()}  # the copies' identities
        d.sched.block_manager._engine = d  # the recorder reports to this copy
        return d

    def manager_calls(self) -> list[ManagerCall]:
        """The block manager calls of the last engine event, in order (and forgets them)."""
        calls, self.calls = self.calls, []
        return calls

    def _observer_names(self) -> Any:
        """The names the observing NanoDriver is built with: the declared ones, and, for a
        nano-vllm method the manager has none of (it admits with ``allocate_and_hash``...),
        one of its own methods in its place: the observer never calls them, it reads state."""
        from kvspec.targets.nano_api import NANO_METHODS
        from kvspec.targets.names import Names
        cls, names = self.parts.manager_cls, self.names or Names()
        try:
            missing = [m for m in NANO_METHODS if names.resolve(cls, m) is None]
        except Exception:
            return names
        if not missing:
            return names
        own = [a for a in dir(cls) if not a.startswith("_") and callable(getattr(cls, a, None))]
        growers = [a for a in own if self.meaning_of(a).grows] or own
        if not growers:
            return names
        return Names({**names.declared, **{m: growers[0] for m in missing}}, names.where)

    # -- the manager calls: recorded as made, read once the step's decisions are known -------------
    def meaning_of(self, method: str) -> Any:
        m = self._meanings.get(method)
        if m is None:
            m = self._meanings[method] = meaning(self.parts.manager_cls, method, self.parts.seq_cls)
        return m

    def record(self, method: str, fn: Callable, args: tuple, kwargs: dict) -> Any:
        """One call of the scheduler into its manager (``RecordingManager``): made, and recorded."""
        m = self.meaning_of(method)
        bound = bind(fn, args, kwargs)
        seq = next((v for v in bound.values() if id(v) in self.req_of), None)
        if seq is None and not m.mutates:  # can_allocate(num_tokens) asks for the sequence laid out last
            seq = self._last_seq
        elif seq is not None:
            self._last_seq = seq
        before = tuple(seq.block_table) if seq is not None else ()
        unknown = m.mutates and not m.interpretable
        obs_before = self.view.observe() if unknown else None
        result = fn(*args, **kwargs)
        r = self.req_of.get(id(seq)) if seq is not None else None
        rc = RawCall(method, m, bound, r, self.phase, before, tuple(seq.block_table) if seq is not None else (),
                     tuple(seq.token_ids) if seq is not None else (), result)
        if m.mutates or _refusal(result):  # a refusal is judged against the state it was made in
            self.view.seqs, self.view.running = dict(self.seqs), {q for q, s_ in self.seqs.items() if list(s_.block_table)}
            rc.obs = self.view.observe()
            if unknown and rc.obs != obs_before:
                raise TargetError(f"target {self.parts.name}: its scheduler called {type(self.view.mgr).__name__}."
                                  f"{method}, which changed the manager's state in a way kvspec cannot read as an "
                                  f"allocation, a free or a hash publication ({m.describe()}), so the engine level "
                                  f"cannot follow it")
        if seq is not None:
            rc.cached = _int(seq, "num_cached_tokens")
            roles = argument_roles(self.parts.manager_cls, method)
            for name, v in bound.items():
                role = roles.get(name)
                if type(v) is int and role in (TOKENS, CACHED_TOKENS, CACHED_BLOCKS):
                    rc.extra[role] = v
            if r is not None and m.grows and TOKENS in rc.extra and self.phase == "schedule":
                self.arg_tokens[r] = rc.extra[TOKENS]
        self.raw.append(rc)
        return result

    def _interpret(self, extents: dict[str, tuple[int, int]], late: Optional[dict] = None) -> set:
        """The recorded calls as ManagerCalls (what each allocated, published, freed), in
        order; ``extents``: req -> (first position, tokens) the step computes for it;
        ``late``: the same for rows scheduled without room, whose growth comes after the
        forward pass. Returns the requests whose scheduled tokens an allocation covered."""
        late = dict(late or {})
        raw, self.raw = self.raw, []
        granted: set[str] = set()  # requests whose scheduled tokens an allocation already covered
        for rc in raw:
            r = rc.req
            if r is None:
                continue
            m = rc.meaning
            if not m.mutates:
                if _refusal(rc.result) and rc.method.startswith("can"):
                    if rc.before:
                        self._emit(ManagerCall("grow", r, rc.tokens, new=rc.extra.get(TOKENS, 1), ok=False,
                                               obs=self._obs(rc, None)), refusal=True)
                    else:  # refused for the chunk it asked for (can_allocate(seq, n)), else the whole prompt
                        self._emit(ManagerCall("admit", r, rc.tokens, new=rc.extra.get(TOKENS, len(rc.tokens)),
                                               ok=False, obs=self._obs(rc, None)))
                continue
            if rc.before and not rc.after:  # freed
                self.done[r] = 0
                self.published[r] = 0
                self._emit(ManagerCall("preempt" if rc.phase == "schedule" else "finish", r, rc.tokens,
                                       obs=self._obs(rc, r)))
                continue
            pub = leading_published(rc.obs, rc.after, self.block_size) if rc.obs is not None else 0
            if not rc.before and rc.after:  # admitted
                hit = rc.cached or rc.extra.get(CACHED_TOKENS, 0) or rc.extra.get(CACHED_BLOCKS, 0) * self.block_size
                s, n = extents.get(r, (hit, rc.extra.get(TOKENS, len(rc.tokens) - hit)))
                new = max(0, s + n - hit) if r not in granted else 0
                granted.add(r)
                self.done[r] = hit + new
                self.seen[r] = len(rc.tokens)
                self.published[r] = pub
                self._emit(ManagerCall("admit", r, rc.tokens, new=new, hit=hit, obs=self._obs(rc, r), published=pub))
                continue
            if m.grows and rc.before:  # a growth (a new block, or room in the last one)
                if r in granted or (r not in late and rc.after == rc.before and self.seen.get(r) is not None
                                    and len(rc.tokens) <= self.seen[r] and r not in extents):
                    if pub > self.published.get(r, 0):
                        self._publish(r, rc, pub)
                    continue
                granted.add(r)
                if r in late:  # the step's tokens, computed already (done counts them)
                    new = late.pop(r)[1]
                elif r in extents:
                    s, n = extents[r]
                    new = max(1, s + n - self.done.get(r, 0))
                    self.done[r] = self.done.get(r, 0) + new
                else:
                    new = rc.extra.get(TOKENS, 1)
                    self.done[r] = self.done.get(r, 0) + new
                self.seen[r] = len(rc.tokens)
                self.published[r] = pub
                self._emit(ManagerCall("grow", r, rc.tokens, new=new, obs=self._obs(rc, r), published=pub))
                continue
            if pub > self.published.get(r, 0):  # a publication (hash_blocks after the forward pass...)
                self._publish(r, rc, pub)
        return granted

    def _publish(self, r: str, rc: Optional[RawCall], pub: int, obs: Any = None) -> None:
        self.published[r] = pub
        self._emit(ManagerCall("publish", r, rc.tokens if rc is not None else tuple(self.seqs[r].token_ids),
                               obs=self._obs(rc, r) if rc is not None else obs, published=pub))

    def _publications(self) -> None:
        """Hashes the engine made visible outside any recorded call (its ``postprocess``
        writing the index itself): one ``publish`` per request, with the state now."""
        obs = None
        for r, seq in self.seqs.items():
            table = tuple(seq.block_table)
            if not table:
                continue
            if obs is None:
                obs = self.observe()
            pub = leading_published(obs, table, self.block_size)
            if pub > self.published.get(r, 0):
                self._publish(r, None, pub, obs)

    def _obs(self, rc: Optional[RawCall], r: Optional[str]) -> Any:
        """The state recorded right after ``rc``, with the engine's computed tokens as now known."""
        # each request's computed tokens as of its own latest call: a row's tokens count from the
        # call that gave them room (another request's earlier call must not show them computed)
        if r is not None:
            self.shown[r] = self.done.get(r, 0)
        obs = rc.obs if rc is not None and rc.obs is not None else self.observe()
        return dataclasses.replace(obs, requests={q: RequestState(rs.table, self.shown.get(q, self.done.get(q, 0)))
                                                  for q, rs in obs.requests.items()})

    def _emit(self, call: ManagerCall, refusal: bool = False) -> None:
        """A refused growth is a question the scheduler asks again after each preemption it
        makes for that sequence: only the last refusal counts, and only if the sequence is
        then preempted itself, or keeps waiting (nano-vllm's engine never appends after a
        refusal it keeps)."""
        r = call.req
        if refusal:
            self.refused[r] = call
            return
        if call.kind == "grow":
            self.refused.pop(r, None)
        elif r in self.refused and call.kind != "publish":
            self.calls.append(self.refused.pop(r))
        self.calls.append(call)

    # -- helpers -----------------------------------------------------------------------------
    def _reqs(self, queue: Any) -> list[str]:
        return [self.req_of[id(s)] for s in queue if id(s) in self.req_of]

    def _extent(self, seq: Any, is_prefill: Optional[bool]) -> tuple[int, int]:
        """(first position, tokens) the step computes for ``seq``, as its scheduler decided."""
        cached = _int(seq, "num_cached_tokens")
        n = getattr(seq, "num_scheduled_tokens", None) or getattr(seq, "num_new_tokens", None)
        if isinstance(n, int) and not isinstance(n, bool) and n > 0:  # a chunked-prefill generation says
            return cached, n  # its computed tokens so far: where the chunk (or the decode token) starts
        r = self.req_of.get(id(seq))
        if r in self.pair_tokens:  # schedule() paired the row with its token count
            start = max(cached, self.done.get(r, 0))
            return start, max(0, min(self.pair_tokens[r], len(seq) - start))
        if r in self.arg_tokens and is_prefill is not False:  # allocate_incremental(seq, chunk): the call says
            start = max(cached, self.done.get(r, 0))
            return start, min(self.arg_tokens[r], len(seq) - start)
        if is_prefill is False:
            return len(seq) - 1, 1
        return cached, len(seq) - cached

    def _postprocess(self, seqs: list, tokens: list[int], is_prefill: Optional[bool], result: Any = None) -> None:
        sch = self.sched
        if self.post_takes_output and result is not None and not isinstance(result, (list, tuple)):
            sch.postprocess(result, tokens)   # postprocess(scheduler_output, token_ids)
            return
        if self.post_indexes:  # only the sequences whose step reaches their last token sample one
            idx = [i for i, s in enumerate(seqs) if not hasattr(s, "num_new_tokens")
                   or _int(s, "num_cached_tokens") + _int(s, "num_new_tokens") >= len(s)]
            sch.postprocess(seqs, [tokens[i] for i in idx], idx)
            return
        if self.post_args:
            rows = self.rows if self.rows is not None else seqs
            args = (rows, tokens, is_prefill)[:max(2, min(self.post_args, 3))]
            sch.postprocess(*args)
            return
        for seq, t in zip(seqs, tokens):  # the model engine's postprocess (nano-vllm-voxcpm's LLMEngineBase)
            seq.append_token(t)
            if len(seq) - _int(seq, "num_prompt_tokens") >= self.max_tokens[self.req_of[id(seq)]]:
                seq.stoped = True
        for seq in seqs:
            if getattr(seq, "stoped", False):
                if callable(getattr(sch, "finish", None)):
                    sch.finish(seq)
                else:
                    raise TargetError(f"target {self.parts.name}: its Scheduler has neither postprocess nor finish")

    def _forget(self, req: str) -> None:
        seq = self.seqs.pop(req)
        self.req_of.pop(id(seq), None)
        self.max_tokens.pop(req, None)
        self.done.pop(req, None)
        self.seen.pop(req, None)
        self.shown.pop(req, None)
        self.published.pop(req, None)


def _set_max_tokens(seq: Any, n: int) -> None:
    """``max_tokens`` where the Sequence keeps it (its copy of SamplingParams.max_tokens, or
    the SamplingParams object itself)."""
    if hasattr(seq, "max_tokens"):
        seq.max_tokens = n
    sp = getattr(seq, "sampling_params", None)
    if sp is not None and hasattr(sp, "max_tokens"):
        try:
            seq.sampling_params = dataclasses.replace(sp, max_tokens=n)
        except TypeError:
            sp.max_tokens = n


def _mark(seq: Any, status: str) -> None:
    st = getattr(seq, "status", None)
    member = getattr(type(st), status, None) if st is not None else None
    if member is not None:
        seq.status = member




def _pairs(items: list, req_of: dict, seq_cls: type) -> Optional[list]:
    """``items`` as (sequence, scheduled tokens) pairs, when every item is one; else None."""
    out = []
    for x in items:
        if not (isinstance(x, tuple) and len(x) == 2 and (id(x[0]) in req_of or isinstance(x[0], seq_cls))
                and type(x[1]) is int):
            return None
        out.append(x)
    return out


def _refusal(answer: Any) -> bool:
    """A gate's no: False, None, or a negative count (``can_allocate -> -1``)."""
    return answer is False or answer is None or (type(answer) is int and answer < 0)


def _first_is_output(fn: Callable) -> bool:
    try:
        params = [p for p in inspect.signature(fn).parameters.values() if p.name != "self"]
    except (TypeError, ValueError):
        return False
    if not params:
        return False
    name, ann = params[0].name.lower(), str(params[0].annotation)
    return "seq" not in name and any(w in name or w in ann.lower() for w in ("output", "batch", "sched"))


def _names_of(parts: EngineParts) -> Any:
    """The package's declared names (``[tool.kvspec.names]`` or ``kvspec_names``), as the
    cache level reads them for its manager."""
    from kvspec.targets.names import load_names
    try:
        src = Path(inspect.getsourcefile(parts.manager_cls) or "")
    except (TypeError, OSError):
        src = None
    try:
        return load_names(parts.manager_cls, src if src and src.is_file() else None)
    except Exception as e:  # a malformed declaration: one line, the target's name first
        raise TargetError(f"target {parts.name}: {e}") from None


def _int(obj: Any, name: str) -> int:
    v = getattr(obj, name, 0)
    return v if isinstance(v, int) and not isinstance(v, bool) else 0


def _positional(fn: Callable) -> int:
    try:
        return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return 2


def _third_is_indexes(fn: Callable) -> bool:
    """Whether postprocess's third parameter is the indexes of the sequences that computed
    logits (``seq_need_compute_logits``), not ``is_prefill``."""
    try:
        p = list(inspect.signature(fn).parameters.values())[2]
    except (TypeError, ValueError, IndexError):
        return False
    return "prefill" not in p.name and any(w in p.name for w in ("logits", "index", "indices", "idx"))


def _takes_seq(fn: Callable) -> bool:
    try:
        first = next(iter(inspect.signature(fn).parameters.values()))
    except (TypeError, ValueError, StopIteration):
        return False
    return first.name in ("seq", "sequence") or "Sequence" in str(first.annotation)



# -- the targets' engine ---------------------------------------------------------------------------
_PARTS: dict[tuple, EngineParts] = {}  # loaded once per (package or file, patch): examples build drivers


def has_scheduler(target: Any) -> bool:
    """Whether a nano-vllm-style target ships a scheduler the engine level can drive."""
    package = getattr(target, "package", None)
    if package:
        from kvspec.targets.nano_loader import package_dir
        try:
            return (package_dir(package) / "engine" / "scheduler.py").is_file()
        except TargetError:
            return False
    source = getattr(target, "source", None)
    try:
        return source is not None and scheduler_file(Path(source)).is_file()
    except TargetError:
        return False


def engine_driver_for(target: Any, config: Config) -> NanoEngineDriver:
    """The engine of a ``nanovllm[:PKG]`` target (``target.package``) or of a user's
    nano-vllm-style FILE target (``target.source``: the manager's file, with the package's
    ``scheduler.py`` beside it), patched with ``target.patch_text`` where it has one."""
    package, patch = getattr(target, "package", None), getattr(target, "patch_text", None)
    if not package and getattr(target, "source", None) is None:
        raise TargetError(f"target {getattr(target, 'name', target)}: not a nano-vllm-style target")
    key = (package or str(target.source), patch)
    if key not in _PARTS:
        _PARTS[key] = load_package_engine(package, patch) if package else load_file_engine(Path(target.source), patch)
    parts = _PARTS[key]
    from kvspec.targets.nanovllm_target import caching_support
    support = caching_support(parts.manager_cls, parts.seq_cls)
    if support != "both" and config.caching != (support == "on"):
        raise TargetError(f"target {getattr(target, 'name', target)}: its engine "
                          f"{'always caches prefixes (its Config has no switch)' if support == 'on' else 'has no prefix cache'}")
    names = getattr(target, "names", None)
    return NanoEngineDriver(parts, config.num_blocks, config.block_size, names=names)
