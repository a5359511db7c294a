"""vLLM's real v1 ``Scheduler`` on the CPU, driving its real ``KVCacheManager``.

No model runs: the scheduler is built from a tiny Llama ``config.json`` written to a
temporary folder (``skip_tokenizer_init``, so nothing is downloaded), a CPU
``DeviceConfig``, a hand-built ``KVCacheConfig`` (``kvspec.vllm.groups``) and a
``StructuredOutputManager``. Each engine step is ``schedule()`` and then
``update_from_output()`` with a made-up ``ModelRunnerOutput``: every scheduled request
that reached the end of its known tokens samples the step's token.

What the scheduler asks of the KV manager is recorded, call by call, by a thin proxy in
front of the manager (``_Recorder``): each ``allocate_slots`` and ``free`` becomes a
``ManagerCall`` with the manager's state right after it, which the engine-level checker
replays through the cache-level reference model.

With async scheduling drawn (``EngineShape.async_scheduling``) the scheduler is vLLM's
``AsyncScheduler`` and a step runs as the engine core's batch queue of two runs it
(``_step_async``): a batch is scheduled while the one before it is still in flight. A
connector that loads asynchronously has its loads reported finished in a later step's
output (``_output``; kvspec.vllm.connector).

With a diff (``--patch``) the whole ``vllm.v1.core`` family, the scheduler included, is
loaded patched (``kvspec.vllm.patch``), so a diff of
``vllm/v1/core/sched/scheduler.py`` is a scheduler under test.
"""
from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass
from typing import Any, Optional

from kvspec.vllm import engine_compat as compat   # HOOK: older releases' API (0.9.x), see that module
from kvspec.engine.protocol import ManagerCall, Sampler, StepFacts
from kvspec.errors import TargetError
from kvspec.spec.observation import Observation, RequestState
from kvspec.targets.v1_driver import observe_pool
from kvspec.vllm.engine_async import AsyncStepping, async_scheduler
from kvspec.vllm.compat import build_kv_cache_config
from kvspec.vllm.groups import parse_extra
from kvspec.vllm.tiny_model import model_config, tiny_model_dir

SCHEDULER_MODULE = "vllm.v1.core.sched.scheduler"
OLD_SCHEDULER_MODULE = "vllm.v1.core.scheduler"   # where 0.8.1 and before keep it


def scheduler_module() -> str:
    """The installed vLLM's Scheduler module (found by its package, without importing it)."""
    import importlib.util
    try:
        return SCHEDULER_MODULE if importlib.util.find_spec("vllm.v1.core.sched") is not None else OLD_SCHEDULER_MODULE
    except ImportError:   # no vllm.v1.core at all: the import that follows says so
        return SCHEDULER_MODULE


@dataclass(frozen=True)
class EngineShape:
    """What a vLLM engine is built with: the KV pool and the scheduler's limits."""
    block_size: int = 4
    num_blocks: int = 12          # the null block included, as at the cache level
    caching: bool = True
    kv_groups: str = "full"
    max_num_seqs: int = 4
    max_num_batched_tokens: int = 16
    max_model_len: int = 128
    spec_tokens: int = 0          # speculative decoding with this many draft tokens; 0: off
    spec_method: str = "ngram"    # the drafter: "ngram" (no draft model, so no lookahead slots), or
                                  # "draft_model" / "eagle" (spec_tokens lookahead slots: kvspec.vllm.inputs)
    policy: str = "fcfs"          # the scheduling policy ("priority": kvspec.vllm.inputs)
    connector: Optional[str] = None   # remote prefixes a CPU KV connector serves (kvspec.vllm.connector)
    async_scheduling: bool = False    # vLLM's AsyncScheduler, two batches in flight (kvspec.vllm.inputs)


@functools.lru_cache(maxsize=16)
def vllm_config(shape: EngineShape) -> Any:
    """The ``VllmConfig`` of a CPU engine of this shape (built once per shape: it is slow)."""
    from vllm.config import CacheConfig, DeviceConfig, ParallelConfig, SchedulerConfig, VllmConfig

    logging.getLogger("vllm").setLevel(logging.ERROR)  # its notes on a tiny budget are not findings
    compat.cpu_platform()
    compat.require_spec_by_method()   # every shape: the machine draws speculative decoding
    model = model_config(shape.max_model_len)
    sched = SchedulerConfig(**compat.accepted(SchedulerConfig, dict(
        max_num_seqs=shape.max_num_seqs, max_num_batched_tokens=shape.max_num_batched_tokens,
        max_model_len=shape.max_model_len, enable_chunked_prefill=True, is_encoder_decoder=False,
        **({"policy": shape.policy} if shape.policy != "fcfs" else {}),
        # a consumer connector with overlapped steps defers block frees (#45357's fence): without
        # async scheduling drawn, the connector runs with it off, as a deployment sets --no-async-scheduling
        **({"async_scheduling": shape.async_scheduling}
           if shape.connector is not None or shape.async_scheduling else {}))))
    cache = compat.construct(CacheConfig, dict(block_size=shape.block_size, enable_prefix_caching=shape.caching),
                             tiny_model_dir())
    cache.num_gpu_blocks = shape.num_blocks
    parallel = ParallelConfig()
    spec = None
    if shape.spec_tokens and shape.spec_method != "ngram":
        from kvspec.vllm.inputs import drafter_config
        spec = drafter_config(shape.spec_method, shape.spec_tokens, tiny_model_dir(), model, parallel)
    elif shape.spec_tokens:
        from vllm.config import SpeculativeConfig
        spec = SpeculativeConfig(method="ngram", num_speculative_tokens=shape.spec_tokens, prompt_lookup_max=3,
                                 prompt_lookup_min=1, target_model_config=model, target_parallel_config=parallel)
    kv_transfer = {}
    if shape.connector is not None:
        from kvspec.vllm.connector import transfer_config
        kv_transfer["kv_transfer_config"] = transfer_config(shape.connector)
    return VllmConfig(model_config=model, scheduler_config=sched, cache_config=cache, parallel_config=parallel,
                      device_config=DeviceConfig(device="cpu"), speculative_config=spec, **kv_transfer)


class _Recorder:
    """Stands in front of the scheduler's ``KVCacheManager``: every call goes through to
    it; ``allocate_slots`` and ``free`` are also reported to the engine, after the call."""

    def __init__(self, mgr: Any, engine: "VllmEngine") -> None:
        self._mgr = mgr
        self._engine = engine
        self._alloc_sig = inspect.signature(mgr.allocate_slots)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._mgr, name)

    def allocate_slots(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        status = request.status
        before = self._engine.computed_of(request)
        drafts = tuple(request.spec_token_ids)
        result = self._mgr.allocate_slots(request, *args, **kwargs)
        bound = self._alloc_sig.bind(request, *args, **kwargs)
        bound.apply_defaults()
        self._engine.on_allocate(request, status, before, dict(bound.arguments), result is not None, drafts)
        return result

    def cache_blocks(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        result = self._mgr.cache_blocks(request, *args, **kwargs)
        self._engine.on_cache(request)
        return result

    def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> Any:
        result = self._mgr.reset_prefix_cache(*args, **kwargs)
        self._engine.on_reset(bool(result))
        return result

    def free(self, request: Any) -> Any:
        was_running = request.status == self._engine.status.RUNNING
        result = self._mgr.free(request)
        self._engine.on_free(request, preempt=was_running)
        return result

    def pop_blocks_for_free(self, request: Any) -> Any:
        """A free deferred behind an in-flight step (#45357's fence, async scheduling with a
        consumer connector): the request's table is dropped now, its blocks return later."""
        was_running = request.status == self._engine.status.RUNNING
        result = self._mgr.pop_blocks_for_free(request)
        self._engine.on_free(request, preempt=was_running, deferred=bool(result))
        return result


class VllmEngine(AsyncStepping):
    """``EngineDriver`` over vLLM's v1 Scheduler (see the module doc)."""

    # the extra keys an arrival may carry here (the engine machine draws only these): a
    # cache salt, and a LoRA adapter (``LoRARequest``; vLLM hashes its name into the blocks)
    extra_kinds: tuple[str, ...] = ("salt", "lora")

    def __init__(self, mods: dict[str, Any], shape: EngineShape) -> None:
        self.shape = shape
        self.block_size = shape.block_size
        self.num_blocks = shape.num_blocks
        sched_mod = mods.get(SCHEDULER_MODULE) or mods[OLD_SCHEDULER_MODULE]
        self.request_mod = mods["vllm.v1.request"]
        self.status = self.request_mod.RequestStatus
        self.SamplingParams = mods["vllm.sampling_params"].SamplingParams
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.structured_output import StructuredOutputManager

        self.ModelRunnerOutput = ModelRunnerOutput
        try:
            cfg = vllm_config(shape)
        except (TypeError, AttributeError, ImportError) as e:   # a release whose config API the engine does not know
            raise TargetError(f"target vllm: the engine level cannot build this vLLM release's configuration on "
                              f"the CPU ({type(e).__name__}: {e}); the pool and cache levels still run") from None
        iface = mods["vllm.v1.kv_cache_interface"]
        if not compat.takes_kv_cache_config(sched_mod.Scheduler):   # 0.8.2 and before: the pool from CacheConfig
            kv = compat.one_full_group(shape.kv_groups)
        elif compat.is_legacy(self.request_mod):
            kv = compat.legacy_kv_cache_config(iface, shape.kv_groups, shape.num_blocks, shape.block_size)
        else:
            kv = build_kv_cache_config(shape.kv_groups, shape.num_blocks, shape.block_size, iface)
        logging.getLogger("vllm").setLevel(logging.ERROR)
        som = compat.structured_output_manager(StructuredOutputManager, cfg, compat.is_legacy(self.request_mod))
        sched_cls = async_scheduler(sched_mod) if shape.async_scheduling else sched_mod.Scheduler
        self.sched = sched_cls(**compat.scheduler_args(sched_mod.Scheduler, cfg, kv, som, shape.block_size))
        if getattr(self.sched, "defer_block_free", False) and not shape.async_scheduling:
            raise TargetError("vllm engine: this configuration defers block frees, which the engine level does not model")
        self.mgr = self.sched.kv_cache_manager
        self.sched.kv_cache_manager = _Recorder(self.mgr, self)
        self._late_advance = compat.advances_in_update(sched_mod)
        self.hasher = compat.block_hasher(mods, shape.block_size)   # vLLM's sha256 block hashing, as the engine
        # slots past the scheduled tokens: the scheduler's own count (before 0.28 it sets it
        # itself, from use_eagle(); VllmConfig counts them from 0.28 on)
        own = getattr(self.sched, "num_lookahead_tokens", None)
        self.lookahead = int((own if own is not None else getattr(cfg, "num_lookahead_tokens", 0)) or 0)
        hash_ahead = int(getattr(cfg, "num_hash_lookahead_tokens", 0) or 0)
        if hash_ahead:   # EAGLE: a block's hash covers the tokens after it, as the engine hashes them
            from kvspec.vllm.inputs import lookahead_hasher
            self.hasher = lookahead_hasher(mods, shape.block_size, hash_ahead)
        self.extras: dict[str, Optional[str]] = {}
        self._computed: dict[str, int] = {}   # request -> computed tokens, as the manager calls leave them
        self._calls: list[ManagerCall] = []
        self._accepted: dict[str, int] = {}   # request -> drafts kept, for this step's output update
        self._loaded: dict[str, tuple[int, int]] = {}   # request -> (first, count) a connector loaded this step
        # async scheduling: the steps scheduled and not yet updated, oldest last (the engine core's
        # batch queue), each with the requests that sample when its output comes back
        self._in_flight: list[tuple[Any, set[str]]] = []
        self._scheduling = False               # inside schedule(): a preemption there is one for room
        self._unreclaimed: list[str] = []      # preempted inside schedule() with their blocks' return deferred
        # why the cache model cannot follow this engine's manager calls (kvspec.engine.session):
        # with a step in flight, a decode is scheduled before its token is known, which no
        # cache-level op expresses; the engine-level checks judge such a run
        async_loads = False
        if shape.connector is not None:   # (the connector module needs the release's v1 connector API)
            from kvspec.vllm.connector import loads_async
            async_loads = loads_async(shape.connector)
        self._loads: list[list[str]] = []   # asynchronous loads in flight, by the output that started them
        self.unfollowed: Optional[str] = (
            "async scheduling: requests are scheduled before their last token is sampled" if shape.async_scheduling
            else "the connector loads asynchronously: a request holds blocks while its KV arrives, which no "
                 "cache-level op expresses" if async_loads else None)

    # -- the recorder's reports --------------------------------------------------------
    def computed_of(self, request: Any) -> int:
        return self._computed.get(request.request_id, 0)

    def on_allocate(self, request: Any, status: Any, before: int, args: dict, ok: bool, drafts: tuple = ()) -> None:
        rid = request.request_id
        new = args.get("num_new_tokens", args.get("num_tokens", 0))   # 0.8.x: num_tokens
        admit = status != self.status.RUNNING
        hit = (args["num_new_computed_tokens"] or 0) if "num_new_computed_tokens" in args else \
            len(args.get("new_computed_blocks") or ()) * self.block_size   # 0.8.x: the hit blocks only
        ext = args.get("num_external_computed_tokens", 0) or 0
        if ok:
            self._computed[rid] = (hit + ext if admit else before) + new
            # the connector loads these tokens' KV (kv_reads); before 0.14.0 the scheduler passes
            # them inside num_new_tokens, so the connector's answer says how many there are
            loaded = ext if "num_external_computed_tokens" in args else self._connector_tokens(rid) if admit else 0
            if admit and loaded:
                self._loaded[rid] = (hit, loaded)
        self._calls.append(ManagerCall("admit" if admit else "grow", rid, tuple(request.all_token_ids), new=new,
                                       hit=hit if admit else 0, external=ext if admit else 0,
                                       extra=self.extras.get(rid) if admit else None, ok=ok,
                                       whole=bool(args.get("full_sequence_must_fit", False)),
                                       drafts=() if admit else drafts, obs=self.observe(),
                                       lookahead=int(args.get("num_lookahead_tokens", 0) or 0)))

    def _connector_tokens(self, rid: str) -> int:
        """The tokens kvspec's connector last offered ``rid`` (0 without a connector)."""
        return int(getattr(getattr(self.sched, "connector", None), "matched", {}).get(rid, 0) or 0)

    def on_reset(self, ok: bool) -> None:
        """``reset_prefix_cache`` reached the manager (the scheduler's own, or after its preemptions)."""
        self._calls.append(ManagerCall("reset", "", ok=ok, obs=self.observe()))

    def on_cache(self, request: Any) -> None:
        """The output update cached a drafted request's verified blocks (``cache_blocks``)."""
        rid = request.request_id
        if rid not in self._accepted:
            return   # no drafts were scheduled for it: nothing new is cached
        self._computed[rid] = request.num_computed_tokens
        self._calls.append(ManagerCall("verify", rid, tuple(request.all_token_ids), new=request.num_computed_tokens,
                                       accepted=self._accepted.pop(rid), obs=self.observe()))

    def on_free(self, request: Any, preempt: bool, deferred: bool = False) -> None:
        rid = request.request_id
        if deferred and preempt and self._scheduling:
            self._unreclaimed.append(rid)
        self._computed.pop(rid, None)
        self._calls.append(ManagerCall("preempt" if preempt else "finish", rid, tuple(request.all_token_ids),
                                       obs=self.observe()))

    def manager_calls(self) -> list[ManagerCall]:
        """The manager calls of the last engine event, in order (and forgets them)."""
        calls, self._calls = self._calls, []
        return calls

    # -- engine events -----------------------------------------------------------------
    def arrive(self, req: str, prompt: tuple[int, ...], max_tokens: int, extra: Optional[str],
               priority: int = 0, session: bool = False) -> None:
        try:
            kw = compat.request_extras(extra, compat.is_legacy(self.request_mod), parse_extra)
        except ValueError as e:
            raise TargetError(f"vllm engine: {e}") from None
        params = self.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        if priority:
            kw["priority"] = priority   # only drawn where Request takes it (kvspec.vllm.inputs.has_priority_policy)
        if session:
            kw["resumable"] = True      # only drawn where Request takes it ("streaming", kvspec.vllm.inputs)
        r = compat.new_request(self.request_mod, req, list(prompt), params, self.hasher, kw)
        self.extras[req] = extra
        self.sched.add_request(r)

    def stream(self, req: str, prompt: tuple[int, ...], max_tokens: int) -> None:
        """A streaming session's next input, as vLLM's engine hands it to the scheduler: a
        resumable request under the session's id (``add_request`` turns it into the
        session's ``StreamingUpdate``; queued if the session is still running)."""
        kw = compat.request_extras(self.extras.get(req), compat.is_legacy(self.request_mod), parse_extra)
        kw["resumable"] = True
        params = self.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        self.sched.add_request(compat.new_request(self.request_mod, req, list(prompt), params, self.hasher, kw))

    def _schedule(self) -> Any:
        self._scheduling = True
        try:
            return self.sched.schedule()
        finally:
            self._scheduling = False

    def step(self, sample: Sampler, drafts: int = 0, accepted: int = 0) -> StepFacts:
        if self.shape.async_scheduling:
            return self._step_async(sample)
        self._unreclaimed = []
        s = self.sched
        running_before = {r.request_id for r in s.running}
        self._loaded = {}
        out = self._schedule()
        loaded, self._loaded = self._loaded, {}
        prefix = self._common_prefix(out)
        bs = self.block_size
        # a load's request may wait for its KV (an asynchronous load): its table, for the load's writes
        tables: dict[str, tuple[int, ...]] = {rid: self._table(rid, 0) for rid in loaded}
        scheduled = dict(out.num_scheduled_tokens)
        start, slots, sampled, covered = {}, {}, [], {}
        for rid, n in scheduled.items():
            req = s.requests[rid]
            # schedule() already advanced it (0.8.3 on; before, update_from_output does)
            done = req.num_computed_tokens + (n if self._late_advance else 0)
            start[rid] = done - n
            table = tables[rid] = self._table(rid, 0)
            slots[rid] = tuple(table[p // bs] * bs + p % bs for p in range(start[rid], start[rid] + n)
                               if p // bs < len(table))
            covered[rid] = len(table) * bs   # positions the table has room for, lookahead included
            at_end = done >= req.num_tokens
            spec = list(out.scheduled_spec_decode_tokens.get(rid, ()))
            if at_end and spec:
                real = next((i for i, t in enumerate(spec) if t < 0), len(spec))   # -1: a placeholder draft,
                kept = min(accepted, real)                                          # never accepted
                self._accepted[rid] = kept
                sampled.append(spec[:kept] + [sample(rid, req.num_tokens + kept)])
            else:
                sampled.append([sample(rid, req.num_tokens)] if at_end else [])
        preempted = tuple(sorted(rid for rid in running_before
                                 if rid in s.requests and s.requests[rid].status == self.status.PREEMPTED))
        # under the priority policy, the order vLLM documents for preemption: (priority, arrival),
        # the largest first, of every request running when the step was scheduled
        rank = {rid: (s.requests[rid].priority, s.requests[rid].arrival_time) for rid in running_before
                if rid in s.requests} if self.shape.policy == "priority" else {}
        ids = list(scheduled)
        k = min(drafts, self.shape.spec_tokens)
        in_output = compat.drafts_in_output(s)   # 0.9.x: proposals come with the step's output
        mro = self._output(ids, sampled, compat.proposals(ids, k, sample, self.shape.spec_tokens > 0) if in_output else None)
        live = set(s.requests)
        s.update_from_output(out, mro)
        self._accepted.clear()
        finished = tuple(sorted(rid for rid in live
                                if rid not in s.requests or s.requests[rid].is_finished()))
        if k > 0 and not in_output:   # the drafter proposes for the next step (vLLM ignores it for a prefill chunk)
            from vllm.v1.outputs import DraftTokenIds
            ids = [r.request_id for r in s.running]
            s.update_draft_token_ids(DraftTokenIds(ids, [[sample(rid, -1)] * k for rid in ids]))
        return StepFacts(scheduled=scheduled, preempted=preempted, finished=finished, slots=slots, start=start,
                         lookahead=self.lookahead, covered=covered, cap=self.shape.max_model_len, rank=rank,
                         tables=tables, loaded=loaded, unreclaimed=tuple(self._unreclaimed), **prefix)

    def paused(self) -> set[str]:
        """Streaming sessions waiting for their next input (holding their KV)."""
        waiting = getattr(self.status, "WAITING_FOR_STREAMING_REQ", None)
        return {rid for rid, r in self.sched.requests.items() if waiting is not None and r.status == waiting}

    def abort(self, req: str) -> None:
        self.sched.finish_requests(req, self.status.FINISHED_ABORTED)

    def reset_prefix_cache(self, preempt_running: bool = False) -> bool:
        """An operator's ``reset_prefix_cache`` through the scheduler (``preempt_running``:
        its ``reset_running_requests``, only where the release takes it)."""
        kw = {"reset_running_requests": True} if preempt_running else {}
        return bool(self.sched.reset_prefix_cache(**kw))

    def _common_prefix(self, out: Any) -> dict[str, Any]:
        """``StepFacts``' common-prefix fields for a step just scheduled: the count the scheduler
        reported and, where it is not zero, every scheduled request's tables (read now, before
        anything else changes them)."""
        counts = compat.common_prefix_counts(out)
        if not any(counts):
            return {"common_prefix": counts}
        groups = range(len(compat.single_type_managers(self.mgr)))
        return {"common_prefix": counts,
                "group_tables": {rid: tuple(self._table(rid, g) for g in groups) for rid in out.num_scheduled_tokens}}

    # -- reading the state -------------------------------------------------------------
    def _table(self, rid: str, group: int) -> tuple[int, ...]:
        mgr = compat.single_type_managers(self.mgr)[group]
        return tuple(b.block_id for b in mgr.req_to_blocks.get(rid, ()))   # .get: never adds an entry

    def _holders(self) -> list[str]:
        rids: set[str] = set()
        for mgr in compat.single_type_managers(self.mgr):
            rids |= {rid for rid, blocks in mgr.req_to_blocks.items() if blocks}
        return sorted(rids)

    def observe(self) -> Observation:
        groups = len(compat.single_type_managers(self.mgr))
        reqs = {}
        for rid in self._holders():
            t = [self._table(rid, g) for g in range(groups)]
            reqs[rid] = RequestState(t[0], self._computed.get(rid, 0), tuple(t[1:]))
        return observe_pool(self.mgr.block_pool, reqs)

    def tables(self) -> dict[str, tuple[int, ...]]:
        """Every request the manager holds blocks for (group 0's table; a finished,
        aborted or preempted request listed here is one the scheduler forgot to free)."""
        return {rid: self._table(rid, 0) for rid in self._holders()}

    def computed(self) -> dict[str, int]:
        return {rid: r.num_computed_tokens for rid, r in self.sched.requests.items() if not r.is_finished()}

    def tokens(self) -> dict[str, tuple[int, ...]]:
        return {rid: tuple(r.all_token_ids) for rid, r in self.sched.requests.items() if not r.is_finished()}
