"""A nano-vllm package's own ``Scheduler`` driving its own ``BlockManager`` (engine level).

Targets: ``nanovllm[:PKG]`` (an installed derivative: ``PKG/engine/scheduler.py``) and a
user's fork given by a file of its package (``REPO/nanovllm/engine/block_manager.py`` or
``scheduler.py``): the ``scheduler.py`` beside it is imported under its real name.

Loading and the stand-in config: ``kvspec.engine.nano_load``.

Driving. ``arrive`` builds the package's own Sequence (``NanoDriver.new_seq``: its
constructor by signature, default SamplingParams, the run's block size) with
``max_tokens`` set, and calls ``add``. ``step`` calls ``schedule()``, reads what it decided
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

Manager calls. A recorder stands in front of the scheduler's ``block_manager``, so the
engine-level session can replay what the scheduler asked through the cache-level model
(``ManagerCall``): ``allocate`` is an admission (hit: ``num_cached_tokens``), ``may_append``
a growth by one token, ``deallocate`` a preemption while ``schedule()`` runs and a finish
otherwise; a refused ``can_allocate`` is a refused admission, and a refused
``can_append`` is reported only when the scheduler then preempts that sequence (nano-vllm
asks again after each preemption it makes for it).

Observation. ``kvspec.targets.nano_driver.NanoDriver``'s, the cache level's, reading the
scheduler's real ``block_manager``; a request's ``computed`` is the engine's (the tokens
whose KV the steps so far computed, the prefix hit included), not ``len(seq)``.
"""
from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from typing import Any, Callable, Optional

from kvspec.engine.nano_load import (SCHEDULER_CONTRACT, EngineParts, check_scheduler,  # noqa: F401
                                     config_reads, load_file_engine, load_package_engine, scheduler_file,
                                     stand_in_config)
from kvspec.engine.protocol import ManagerCall, Sampler, StepFacts
from kvspec.errors import TargetError
from kvspec.spec.config import Config
from kvspec.spec.observation import Observation, RequestState

NEVER_EOS = -1  # nano-vllm's own "no eos" value; the machines sample tokens >= 0


# -- the driver --------------------------------------------------------------------------------
class _Recorder:
    """Stands in front of the scheduler's ``block_manager``: every call goes through; the
    allocations (``allocate``, ``may_append``), refusals (``can_allocate``/``can_append``
    False) and frees (``deallocate``) are also reported to the driver, after the call."""

    def __init__(self, mgr: Any, engine: "NanoEngineDriver") -> None:
        self._mgr, self._engine = mgr, engine

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_mgr", "_engine"):  # copying builds one without them
            raise AttributeError(name)
        return getattr(self._mgr, name)

    def get_token_layout(self, seq: Any, *args: Any) -> Any:  # the layout generation: can_allocate(n) is for it
        self._laid_out = seq
        return self._mgr.get_token_layout(seq, *args)

    def can_allocate(self, *args: Any) -> Any:
        answer = self._mgr.can_allocate(*args)
        seq = args[0] if args and not isinstance(args[0], int) else getattr(self, "_laid_out", None)
        if seq is not None and (answer is False or answer is None or (type(answer) is int and answer < 0)):
            self._engine.on_call(seq, "admit", ok=False)
        return answer

    def allocate(self, seq: Any, *args: Any) -> Any:
        fresh = not list(seq.block_table)
        result = self._mgr.allocate(seq, *args)
        # new tokens: allocate(seq, num_tokens)'s count, else (a plan object, or none) what the
        # scheduler set in seq.num_new_tokens (the layout generation), else the uncached rest
        self._engine.on_call(seq, "admit" if fresh else "grow", new=_new_tokens(seq, args))
        return result

    def can_append(self, seq: Any, *args: Any) -> Any:
        answer = self._mgr.can_append(seq, *args)
        if not answer:
            self._engine.on_call(seq, "grow", ok=False)
        return answer

    def may_append(self, seq: Any) -> Any:
        result = self._mgr.may_append(seq)
        self._engine.on_call(seq, "grow", new=_new_tokens(seq, ()))
        return result

    def deallocate(self, seq: Any) -> Any:
        result = self._mgr.deallocate(seq)
        self._engine.on_call(seq, "preempt" if self._engine.phase == "schedule" else "finish")
        return result


class NanoEngineDriver:
    """An EngineDriver (``kvspec.engine.protocol``) over a nano-vllm package's Scheduler."""

    spec_decode = False

    def __init__(self, parts: EngineParts, num_blocks: int, block_size: int, max_num_seqs: Optional[int] = None,
                 max_num_batched_tokens: Optional[int] = None) -> None:
        from kvspec.targets.nano_api import detect_nano_api
        from kvspec.targets.nano_driver import NanoDriver
        from kvspec.targets.nanovllm_target import caching_support, default_caching

        self.parts, self.block_size, self.num_blocks = parts, block_size, num_blocks
        self.max_model_len = num_blocks * block_size
        values = {"num_kvcache_blocks": num_blocks, "kvcache_block_size": block_size, "eos": NEVER_EOS,
                  "max_model_len": self.max_model_len,
                  "max_num_batched_tokens": max(max_num_batched_tokens or 0, self.max_model_len)}
        if max_num_seqs is not None:
            values["max_num_seqs"] = max_num_seqs
        self.config = stand_in_config(parts, values)
        try:
            self.sched = parts.scheduler_cls(self.config)
        except TargetError:
            raise
        except Exception as e:
            from kvspec.targets.contract import describe_exception  # a bare assert: where, and its line
            raise TargetError(f"target {parts.name}: cannot build its Scheduler: {describe_exception(e)}") from None
        check_scheduler(parts.name, self.sched)
        mgr = getattr(self.sched, "block_manager", None)
        if mgr is None:
            raise TargetError(f"target {parts.name}: its Scheduler keeps no block_manager")
        support = caching_support(parts.manager_cls, parts.seq_cls)
        # The cache level's driver, as the observer of the scheduler's own manager.
        self.view = NanoDriver(parts.manager_cls, parts.seq_cls, detect_nano_api(parts.manager_cls),
                               Config(level="cache", num_blocks=num_blocks, block_size=block_size,
                                      caching=default_caching(support) != "off"), caching_support=support)
        self.view.mgr = mgr
        if self.view.bs != block_size or getattr(mgr, "block_size", block_size) != block_size:
            raise TargetError(f"target {parts.name}: its BlockManager keeps block size "
                              f"{getattr(mgr, 'block_size', '?')}, not the run's {block_size}")
        self.sched.block_manager = _Recorder(mgr, self)
        self.phase = "idle"                 # "schedule" while schedule() runs: a deallocate then is a preemption
        self.calls: list[ManagerCall] = []
        self.refused: dict[str, ManagerCall] = {}  # req -> its latest refused can_append in this schedule()
        self.seen: dict[str, int] = {}      # req -> its length at its last successful allocation
        self.seqs: dict[str, Any] = {}      # live requests (waiting or running)
        self.req_of: dict[int, str] = {}    # id(seq) -> req
        self.max_tokens: dict[str, int] = {}
        self.done: dict[str, int] = {}      # req -> tokens whose KV the engine computed
        post = getattr(self.sched, "postprocess", None)
        self.post_args = _positional(post) if callable(post) else 0
        # postprocess(seqs, token_ids, <the indexes of the seqs that sampled>) (v1-style nano-vllm)
        self.post_indexes = self.post_args >= 3 and _third_is_indexes(post)
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
        self.sched.add(seq)

    def step(self, sample: Sampler, drafts: int = 0, accepted: int = 0) -> StepFacts:
        sch = self.sched
        if sch.is_finished():
            return StepFacts(scheduled={})
        was_running = {r for r in self._reqs(sch.running)}
        self.phase = "schedule"
        try:
            result = sch.schedule()
        finally:
            self.phase = "update"
            self.calls += self.refused.values()  # refusals the scheduler kept (neither appended nor preempted)
            self.refused.clear()
        seqs, is_prefill = (list(result[0]), result[1]) if isinstance(result, tuple) else (list(result), None)
        waiting = set(self._reqs(sch.waiting))
        preempted = tuple(sorted(r for r in was_running if r in waiting))
        for r in preempted:
            self.done[r] = 0
        scheduled, slots, start = {}, {}, {}
        for seq in seqs:
            r = self.req_of[id(seq)]
            s, n = self._extent(seq, is_prefill)
            table = list(seq.block_table)
            scheduled[r], start[r] = n, s
            slots[r] = tuple(table[p // self.block_size] * self.block_size + p % self.block_size
                             for p in range(s, s + n) if p // self.block_size < len(table))
            self.done[r] = s + n
        tokens = [sample(self.req_of[id(seq)], len(seq)) for seq in seqs]
        self._postprocess(seqs, tokens, is_prefill)
        live = set(self._reqs(sch.running)) | set(self._reqs(sch.waiting))
        finished = tuple(sorted(r for r in self.seqs if r not in live))
        for r in finished:
            self._forget(r)
        return StepFacts(scheduled=scheduled, preempted=preempted, finished=finished, slots=slots, start=start)

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
            sch.block_manager.deallocate(seq)
            for queue in (sch.waiting, sch.running):
                if any(s is seq for s in queue):
                    queue.remove(seq)
        self.phase = "idle"
        self._forget(req)

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

    def on_call(self, seq: Any, kind: str, ok: bool = True, new: Optional[int] = None) -> None:
        """Record one manager call (``_Recorder``), with the state right after it. A
        ``may_append`` for a token that is no newer than the last successful allocation saw
        (voxcpm's first decode of a wholly cached prompt recomputes its last token in place,
        in the slot its admission already holds) allocates nothing and is not a growth: not
        recorded."""
        r = self.req_of.get(id(seq))
        if r is None:
            return
        n, before = len(seq), self.seen.get(r)
        if kind == "admit":
            hit = _int(seq, "num_cached_tokens") if ok else 0
            new = (n - hit) if new is None else new
            if ok:
                self.done[r] = hit + new
            call = ManagerCall("admit", r, tuple(seq.token_ids), new=new, hit=hit, ok=ok)
        elif kind == "grow":
            if ok and new is None and before is not None and n <= before:
                return
            new = 1 if new is None else new
            if ok:
                self.done[r] = self.done.get(r, 0) + new
            call = ManagerCall("grow", r, tuple(seq.token_ids), new=new, ok=ok)
        else:
            self.done[r] = 0
            call = ManagerCall(kind, r, tuple(seq.token_ids))
        if ok and kind in ("admit", "grow"):
            self.seen[r] = n
        call = dataclasses.replace(call, obs=self.observe())
        # A refused can_append is a question the scheduler asks again after each preemption it
        # makes for that sequence: only the last refusal counts, and only if the sequence is
        # then preempted itself (nano-vllm's engine never appends after a refusal it keeps).
        if kind == "grow" and not ok:
            self.refused[r] = call
            return
        if kind == "grow":
            self.refused.pop(r, None)
        elif r in self.refused:
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
        if is_prefill is False:
            return len(seq) - 1, 1
        return cached, len(seq) - cached

    def _postprocess(self, seqs: list, tokens: list[int], is_prefill: Optional[bool]) -> None:
        sch = self.sched
        if self.post_indexes:  # only the sequences whose step reaches their last token sample one
            idx = [i for i, s in enumerate(seqs) if not hasattr(s, "num_new_tokens")
                   or _int(s, "num_cached_tokens") + _int(s, "num_new_tokens") >= len(s)]
            sch.postprocess(seqs, [tokens[i] for i in idx], idx)
            return
        if self.post_args:
            args = (seqs, tokens, is_prefill)[:max(2, min(self.post_args, 3))]
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


def _new_tokens(seq: Any, args: tuple) -> Optional[int]:
    return args[-1] if args and type(args[-1]) is int else _int(seq, "num_new_tokens") or None


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
    return NanoEngineDriver(parts, config.num_blocks, config.block_size)
