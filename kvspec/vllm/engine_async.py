"""vLLM's engine with async scheduling (a step in flight while the next is scheduled, as the
engine core's batch queue of two runs it) and its connector's asynchronous loads: the part of
``VllmEngine`` (``kvspec.vllm.engine``) that steps the release's own ``AsyncScheduler`` and
reports a load finished in a later step's model-runner output (``kvspec.vllm.connector``).
"""
from __future__ import annotations

from typing import Any, Optional

from kvspec.engine.protocol import Sampler, StepFacts
from kvspec.errors import TargetError
from kvspec.vllm import engine_compat as compat

ASYNC_SCHEDULER_MODULE = "vllm.v1.core.sched.async_scheduler"


def async_scheduler(sched_mod: Any) -> type:
    """The release's ``AsyncScheduler`` (what ``async_scheduling`` selects), over the
    scheduler under test: only drawn for an unpatched vLLM (kvspec.engine.machine), whose
    AsyncScheduler subclasses exactly that Scheduler."""
    import importlib
    try:
        cls = importlib.import_module(ASYNC_SCHEDULER_MODULE).AsyncScheduler
    except (ImportError, AttributeError) as e:
        raise TargetError(f"vllm engine: async scheduling: this release has no AsyncScheduler ({e})") from None
    if not issubclass(cls, sched_mod.Scheduler):
        raise TargetError("vllm engine: async scheduling is driven on an unpatched vLLM only")
    return cls


class AsyncStepping:
    """The async-scheduling and asynchronous-load half of ``VllmEngine`` (a mixin: it uses the
    engine's scheduler, tables and shape)."""

    def _output(self, ids: list[str], sampled: list[list[int]], drafts: Optional[list[list[int]]]) -> Any:
        """The step's ``ModelRunnerOutput``, reporting as finished the asynchronous loads
        started ``LOAD_STEPS`` outputs ago (kvspec.vllm.connector)."""
        mro = compat.model_runner_output(self.ModelRunnerOutput, ids, sampled, drafts)
        conn = getattr(self.sched, "connector", None)
        if conn is None:   # no connector (0.8.x has no v1 connector API to import)
            return mro
        from kvspec.vllm.connector import LOAD_STEPS, report_loads
        self._loads.append(list(getattr(conn, "take_started_loads", list)()))
        due = self._loads.pop(0) if len(self._loads) > LOAD_STEPS else []
        return report_loads(mro, due)

    def loading(self) -> set[str]:
        """Requests whose asynchronous load is in flight: they hold the blocks it writes."""
        conn = getattr(self.sched, "connector", None)
        return {r for due in self._loads for r in due} | set(getattr(conn, "loading", ()) or ())

    def _step_async(self, sample: Sampler) -> StepFacts:
        """One engine-core step with async scheduling, as vLLM's batch queue runs it
        (``EngineCore.step_with_batch_queue``, two batches): schedule a new batch while there
        are requests; while fewer than two are in flight that is the whole step; otherwise
        (or with nothing to schedule) the oldest batch's output comes back and updates the
        scheduler. A request samples one token when its batch's output comes back if that
        batch scheduled the last of its known tokens (not a prefill chunk)."""
        s = self.sched
        self._unreclaimed = []
        running_before = {r.request_id for r in s.running}
        scheduled, start, slots, covered = {}, {}, {}, {}
        prefix: dict = {}
        bs = self.block_size
        if s.has_requests():
            out = self._schedule()
            prefix = self._common_prefix(out)
            scheduled = dict(out.num_scheduled_tokens)
            ends = set()
            for rid, n in scheduled.items():
                req = s.requests[rid]
                start[rid] = req.num_computed_tokens - n
                table = self._table(rid, 0)
                slots[rid] = tuple(table[p // bs] * bs + p % bs for p in range(start[rid], start[rid] + n)
                                   if p // bs < len(table))
                covered[rid] = len(table) * bs
                chunk = getattr(req, "is_prefill_chunk", None)
                if not (chunk if chunk is not None else req.num_computed_tokens < req.num_tokens):
                    ends.add(rid)
            self._in_flight.insert(0, (out, ends))
            if len(self._in_flight) < 2 and s.has_requests():
                return self._async_facts(running_before, scheduled, start, slots, covered, (), prefix)
        if not self._in_flight:
            return self._async_facts(running_before, scheduled, start, slots, covered, (), prefix)
        out, ends = self._in_flight.pop()
        ids = list(out.num_scheduled_tokens)
        sampled = [[sample(rid, s.requests[rid].num_tokens)] if rid in ends and rid in s.requests else []
                   for rid in ids]
        mro = self._output(ids, sampled, None)
        live = set(s.requests)
        s.update_from_output(out, mro)
        finished = tuple(sorted(rid for rid in live if rid not in s.requests or s.requests[rid].is_finished()))
        return self._async_facts(running_before, scheduled, start, slots, covered, finished, prefix)

    def _async_facts(self, running_before: set, scheduled: dict, start: dict, slots: dict, covered: dict,
                     finished: tuple, prefix: dict) -> StepFacts:
        s = self.sched
        preempted = tuple(sorted(rid for rid in running_before
                                 if rid in s.requests and s.requests[rid].status == self.status.PREEMPTED))
        rank = {rid: (s.requests[rid].priority, s.requests[rid].arrival_time) for rid in running_before
                if rid in s.requests} if self.shape.policy == "priority" else {}
        return StepFacts(scheduled=scheduled, preempted=preempted, finished=finished, slots=slots, start=start,
                         lookahead=self.lookahead, covered=covered, cap=self.shape.max_model_len, rank=rank,
                         unreclaimed=tuple(self._unreclaimed), **prefix)
