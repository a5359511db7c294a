"""Inputs real vLLM deployments send, beyond arrivals, steps and aborts (issue 37, part 3),
each detected on the installed release by feature (its classes and signatures), never by
version number, and each with the meaning the checks give it:

- ``reset_prefix_cache`` mid-run (``ResetPrefixCache``): the scheduler's own method. It
  succeeds only when no block is held (the manager returns False otherwise, and nothing
  changes); with ``reset_running_requests`` it first preempts every running request, and
  then it must succeed. The cache-level model replays it as the pool's ``Reset``: a
  success forgets every hash, so no later admission hits a block cached before it.
- lookahead slots of a drafter that writes its own KV (``spec_method`` "draft_model" or
  "eagle", vLLM's ``num_lookahead_tokens``: ``VllmConfig`` counts them from 0.28; before,
  the scheduler sets them from ``use_eagle()``, so there only EAGLE is drawn with slots;
  the engine reads the scheduler's own count): every request's table covers its scheduled
  tokens plus that many slots (capped at ``max_model_len``) once the step is scheduled
  (SLOTS, ``kvspec.engine.checks``). The cache-level model has no op for slots reserved
  past the computed tokens, so a run with lookahead is judged by the engine-level checks
  (``translate.Unexpressible``): slots, leaks, the scheduler's and manager's own asserts.
  EAGLE brings the rest of its configuration with it: the trailing-block drop on a prefix
  hit, the prefill lookahead, and block hashes that cover the token after each block
  (the requests are built with that hasher, as vLLM's engine builds them).
- the priority policy (``policy="priority"``, ``Arrive.priority``): when the scheduler
  must preempt, it preempts the running request that is last in (priority, arrival)
  order; a request that survives a step's preemptions never comes after one that was
  preempted (PRIORITY, ``kvspec.engine.checks``).

- a KV connector (``Config.connector``; ``kvspec.vllm.connector``, a small CPU
  connector against the release's own ``KVConnectorBase_V1``) serving a drawn set of
  prompt prefixes: the scheduler admits a request with the connector's tokens as
  external computed tokens, which the cache-level model replays as ``Admit.external``
  (slots for them, the KV of exactly that prefix, never cached as the request's own
  computation until its blocks are full). Where the scheduler parks a request while its
  KV loads (``WAITING_FOR_REMOTE_KVS``), half the connectors load asynchronously (the
  connector's ``load_kv_async``; the load reports finished two steps later): the
  request holds the blocks the load writes until it reports, even if aborted meanwhile
  (NO_LEAK waits for the report); a run with such loads is judged by the engine-level
  checks (the cache model has no op for blocks held while KV arrives).

- streaming input sessions (``Arrive.session``, ``StreamInput``; vLLM's resumable requests,
  where ``Request`` takes ``resumable`` and the release has ``StreamingUpdate``): a session
  that reaches its ``max_tokens`` waits, holding its KV, for its next input, which keeps
  its tokens up to the last sampled one and appends the new prompt. The KV of the kept
  tokens stays valid; every later slot must be recomputed for the new tokens, and a block
  cached under a hash of tokens it no longer holds serves wrong KV to the next request
  that hits it (KV_INTEGRITY at the engine level, ``kvspec.engine.kv_reads``). Streaming
  examples also draw follow-up requests whose prompt repeats a sequence the engine has
  held (a prompt plus its output, as a multi-turn client resends it), so such a hit is drawn.

- async scheduling (``Config.async_scheduling``, where ``SchedulerConfig`` takes
  ``async_scheduling`` and the release ships ``AsyncScheduler``): a step is scheduled while
  the previous one is in flight, as vLLM's engine core runs its batch queue of two
  (``VllmEngine._step_async``). Its meaning: a request scheduled in a step whose output has
  not come back holds every block that step writes until the output comes back; with a
  consumer connector the scheduler therefore defers the return of a freed request's blocks
  (#45357's fence), and a preemption made to find room must reclaim blocks, so a victim whose
  free is deferred is no victim (NO_LEAK, ``kvspec.engine.checks``). The cache model does not
  follow a run with a step in flight (a decode is scheduled before its token is sampled):
  the engine-level checks judge it.

Not drawn yet (see reports/vllm-engine-inputs.md): the connector's failed loads and
invalid blocks.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any

LOOKAHEAD_DRAFTERS = ("draft_model", "eagle")   # drafters with their own KV: lookahead slots


def _params(fn: Any) -> set[str]:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


@functools.lru_cache(maxsize=1)
def features() -> frozenset[str]:
    """What the installed vLLM's scheduler takes, of: "reset", "reset_preempt",
    "priority", "connector", "connector_async" (the connector may load asynchronously),
    "async", "streaming", "cascade" (``schedule()`` reports a common prefix for cascade
    attention), and "lookahead:METHOD" for each drafter in LOOKAHEAD_DRAFTERS whose
    speculative config the release accepts with a draft model of the engine's own shape."""
    out: set[str] = set()
    try:
        from vllm.config import SchedulerConfig, VllmConfig
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.request import Request
    except Exception:
        return frozenset()
    reset = getattr(Scheduler, "reset_prefix_cache", None)
    if callable(reset):
        out.add("reset")
        if "reset_running_requests" in _params(reset):
            out.add("reset_preempt")
    fields = getattr(SchedulerConfig, "__dataclass_fields__", {}) or {}
    if "policy" in fields and "priority" in _params(Request.__init__):
        out.add("priority")
    if _connector_pluggable():
        out.add("connector")
        if hasattr(getattr(mods_request(), "RequestStatus", None), "WAITING_FOR_REMOTE_KVS"):
            out.add("connector_async")   # the scheduler parks a request while its KV loads
    if "async_scheduling" in fields and _has_async_scheduler():
        out.add("async")
    if "resumable" in _params(Request.__init__) and _has_streaming_updates():
        out.add("streaming")
    if _reports_common_prefix(Scheduler):
        out.add("cascade")
    if "num_lookahead_tokens" in _params(KVCacheManager.allocate_slots):
        for method in LOOKAHEAD_DRAFTERS:
            if _drafter_reserves(method, isinstance(getattr(VllmConfig, "num_lookahead_tokens", None), property)):
                out.add(f"lookahead:{method}")
    return frozenset(out)


def _reports_common_prefix(scheduler_cls: type) -> bool:
    """Whether ``schedule()`` asks the KV manager for cascade attention's common prefix
    (``get_num_common_prefix_blocks``); 0.32.0 removed cascade attention and the call."""
    try:
        return "get_num_common_prefix_blocks" in inspect.getsource(scheduler_cls.schedule)
    except (OSError, TypeError):
        return False


def _has_streaming_updates() -> bool:
    """Whether the scheduler turns a resumable request under a live session's id into that
    session's next input (``StreamingUpdate``: vLLM's streaming input sessions)."""
    try:
        from vllm.v1.request import StreamingUpdate  # noqa: F401
        return True
    except Exception:
        return False


def mods_request() -> Any:
    import vllm.v1.request as request
    return request


def _has_async_scheduler() -> bool:
    """Whether the release ships the scheduler ``async_scheduling`` selects (``AsyncScheduler``)."""
    try:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: F401
        return True
    except Exception:
        return False


def _connector_pluggable() -> bool:
    """Whether a connector from a module path plugs into this release (``KVTransferConfig``
    takes ``kv_connector_module_path``) and kvspec's connector builds against its base."""
    try:
        from vllm.config import KVTransferConfig
        fields = getattr(KVTransferConfig, "__dataclass_fields__", {}) or {}
        if "kv_connector_module_path" not in fields:
            return False
        from kvspec.vllm.connector import KvspecRemoteConnector
        return not getattr(KvspecRemoteConnector, "__abstractmethods__", None)
    except Exception:
        return False


def _drafter_reserves(method: str, config_counts: bool) -> bool:
    """Whether this release builds a ``SpeculativeConfig`` for ``method`` over the tiny model
    and its scheduler then reserves lookahead slots: where ``VllmConfig`` counts them
    (``config_counts``, 0.28 on) any accepted drafter is drawn (the engine reads the count);
    before, the scheduler sets ``num_lookahead_tokens`` itself, from ``use_eagle()`` alone
    (read in 0.9.0 to 0.27.0's ``Scheduler.__init__``), so only an EAGLE-family config has slots."""
    try:
        from vllm.config import ParallelConfig

        from kvspec.vllm import engine_compat as compat
        from kvspec.vllm.tiny_model import model_config, tiny_model_dir
        compat.cpu_platform()
        spec = drafter_config(method, 2, tiny_model_dir(), model_config(128), ParallelConfig())
        return config_counts or compat.scheduler_sees_eagle(spec)
    except Exception:
        return False


def drafter_config(method: str, k: int, model_dir: str, target_model: Any, parallel: Any) -> Any:
    """A ``SpeculativeConfig`` for a drafter with its own KV: the draft model is the tiny
    target model itself (no weights load: only the scheduler runs), in a folder named as an
    EAGLE head is for the EAGLE drafter (0.8.x sets ``method`` from the draft model's name)."""
    from vllm.config import SpeculativeConfig
    if method == "eagle":
        from kvspec.vllm.tiny_model import tiny_model_dir
        model_dir = tiny_model_dir("eagle-llama")
    return SpeculativeConfig(method=method, model=model_dir, num_speculative_tokens=k,
                             target_model_config=target_model, target_parallel_config=parallel)


def lookahead_hasher(mods: dict[str, Any], block_size: int, ahead: int) -> Any:
    """vLLM's per-request block hasher whose hashes cover ``ahead`` tokens after each block
    (EAGLE's ``num_hash_lookahead_tokens``), as the engine builds its requests with it."""
    from kvspec.vllm.target import Upstream
    up = Upstream(mods)
    return up.utils.get_request_block_hasher(block_size, up.hash_fn, ahead)
