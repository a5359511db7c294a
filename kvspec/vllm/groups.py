"""vLLM's ``KVCacheManager`` with several KV-cache groups (``--kv-groups``), chunked
prefill, draft tokens, extra keys, connector tokens and the ``max_model_len`` cap.

``build_kv_cache_config`` (in ``compat``: the release's own constructors) turns a spec
string (``"full,swa:4"``) into a real ``KVCacheConfig``: one ``KVCacheGroupSpec`` per group, each with its real spec class
(``FullAttentionSpec``, ``SlidingWindowSpec``, ``ChunkedLocalAttentionSpec``), all in
one pool of ``num_blocks`` blocks. ``KVCacheManager`` then picks its own coordinator
(unitary for one group, hybrid for several, no-prefix-cache with caching off).

``VllmGroupsCacheDriver`` plays vLLM's scheduler (``vllm/v1/core/sched/scheduler.py``)
over that manager, on real ``vllm.v1.request.Request`` objects:
- Admit: ``get_computed_blocks``, then ``allocate_slots(req, chunk,
  num_new_computed_tokens=hit, new_computed_blocks=blocks,
  num_external_computed_tokens=ext)``;
- Prefill: ``allocate_slots(req, n)`` for the next chunk;
- Step: append the sampled token, set ``req.spec_token_ids`` to the drafts and
  allocate ``num_tokens_with_spec - num_computed_tokens`` slots (the scheduler's way:
  drafts are scheduled tokens, which ``allocate_slots`` never caches past
  ``req.num_tokens``);
- Verify: append the accepted drafts, roll ``num_computed_tokens`` back past the
  rejected ones (``update_from_output``), clear ``spec_token_ids``;
- Preempt / Finish: ``free`` (and the scheduler's resets).
Where the scheduler itself never schedules a request (past ``max_model_len``), the
driver refuses without calling the manager, as the scheduler does.

Every release from 0.9.0 on is driven (``compat.cache_api``, by feature): arguments a
release does not take are not passed, and the features it lacks are never drawn.
"""
from __future__ import annotations

import sys
import zlib
from typing import Any, Optional

from kvspec.errors import TargetError
from kvspec.spec.config import Config
from kvspec.spec.observation import Observation, RequestState
from kvspec.spec.ops import Admit, Finish, Op, Prefill, Preempt, Step, Verify
from kvspec.vllm import compat as compat
from kvspec.vllm.compat import build_kv_cache_config, build_manager
from kvspec.targets.base import Driver
from kvspec.targets.v1_driver import observe_pool

def lora_request(cls: Any, value: str) -> Any:
    """``NAME`` or ``NAME@PATH`` (the path is the name when left out) -> a LoRARequest.
    Two adapters may share a name; each adapter (name and path) has its own id, since
    older releases key a block by the id and newer ones by name and path."""
    name, _, path = value.partition("@")
    path = path or name
    lora_id = 1 + sum(map(ord, name)) if path == name else 1 + zlib.crc32(f"{name}@{path}".encode()) % (1 << 30)
    return cls(name, lora_id, f"/kvspec/lora/{path}")


def parse_extra(label: Optional[str], layout: str = "features") -> dict:
    """An Admit's extra keys (``lora:A[@PATH];salt:s;mm:X@2[+L]``) -> Request keyword arguments,
    multimodal inputs in the release's layout: ``features`` (``mm_features``, 0.11.0 on)
    or ``hashes`` (``multi_modal_hashes`` and ``multi_modal_placeholders``, before)."""
    if not label:
        return {}
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import PlaceholderRange

    out: dict = {}
    mm = []
    for item in label.split(";"):
        kind, _, value = item.partition(":")
        if kind == "lora" and value and not value.startswith("@"):
            out["lora_request"] = lora_request(LoRARequest, value)
        elif kind == "salt" and value:
            out["cache_salt"] = value
        elif kind == "mm" and "@" in value:
            h, _, where = value.partition("@")
            off, _, length = where.partition("+")
            if not h or not off.isdigit() or (length and not length.isdigit()):
                raise ValueError(f"bad multimodal key {item!r}")
            mm.append((int(off), int(length or 1), h))
        else:
            raise ValueError(f"bad extra key {item!r}")
    mm.sort()   # vLLM assumes offset order
    if mm and layout == "features":
        from vllm.multimodal.inputs import MultiModalFeatureSpec
        out["mm_features"] = [MultiModalFeatureSpec(data=None, modality="image", identifier=h,
                                                    mm_position=PlaceholderRange(off, n)) for off, n, h in mm]
    elif mm:
        out["multi_modal_hashes"] = [h for _, _, h in mm]
        out["multi_modal_placeholders"] = [PlaceholderRange(offset=off, length=n) for off, n, _ in mm]
        out["multi_modal_inputs"] = [{} for _ in mm]   # never read by the KV manager; counted against the others
    return out


class VllmGroupsCacheDriver(Driver):
    """Plays vLLM's scheduler over a ``KVCacheManager`` built from ``config.kv_groups``.
    What differs between releases (0.9.0 on) comes from ``compat.cache_api``: arguments a
    release does not take are not passed, and an op needing a feature it lacks is a
    TargetError (the machines draw none: ``Traits.cache_missing``)."""

    def __init__(self, up: Any, config: Config, api: Optional[compat.CacheApi] = None) -> None:
        self.up = up
        self.api = api = api or compat.cache_api(up)
        if api is None:
            raise TargetError("vllm: this KVCacheManager predates KVCacheConfig and num_new_computed_tokens: "
                              "only the one-group driver drives it")
        self.bs = config.block_size
        self.max_len = getattr(config, "max_model_len", None)
        kv_config = build_kv_cache_config(getattr(config, "kv_groups", "full") or "full", config.num_blocks,
                                          config.block_size, up.interface)
        eagle = bool(getattr(config, "use_eagle", False))
        if eagle and not api.eagle:
            raise TargetError("vllm: this KVCacheManager takes no use_eagle")
        self.mgr = build_manager(up.manager, kv_config, config.block_size, config.caching, self.max_len, eagle)
        guard_counts(self.mgr.block_pool)
        self.num_groups = len(kv_config.kv_cache_groups)
        self.hasher = up.request_hasher(config.block_size)   # None: the manager hashes requests itself
        self.status = up.request.RequestStatus
        # allocate_slots' call form, resolved once: the scheduler's keywords, those this release takes
        self._alloc = self.mgr.allocate_slots
        takes = compat.form(self._alloc).takes
        self._alloc_kw = frozenset(("num_new_computed_tokens", "new_computed_blocks", "num_external_computed_tokens",
                                    "num_draft_tokens")) & takes
        self.reqs: dict[str, Any] = {}
        self.running: set[str] = set()
        self.finished: dict[str, Any] = {}   # a Step of one reaches the manager (a scheduler misuse)

    def _allocate(self, req: Any, n: int, **kw: Any) -> Any:
        return self._alloc(req, n, **{k: v for k, v in kw.items() if k in self._alloc_kw})

    def _new_request(self, rid: str, prompt, extra: Optional[str]) -> Any:
        try:
            kw = parse_extra(extra, self.api.mm_layout)
        except ValueError as e:
            raise TargetError(f"vllm: {e}") from None
        kinds = {item.partition(":")[0] for item in (extra or "").split(";") if item}
        if kinds - self.api.extra:
            raise TargetError(f"vllm: extra keys {extra!r}: this release's Request takes only {sorted(self.api.extra)}")
        return self.up.new_request(rid, prompt, self.hasher, kw)

    def _capped(self, tokens: int) -> bool:
        return self.max_len is not None and tokens > self.max_len

    def apply(self, op: Op) -> Any:
        m = self.mgr
        if isinstance(op, Admit):
            req = self.reqs.get(op.req) if op.prompt is None else self._new_request(op.req, op.prompt, op.extra)
            if req is None:
                raise KeyError(f"no waiting request {op.req}")
            hits, num_hit = m.get_computed_blocks(req)[:2]
            self.reqs[op.req] = req   # only now: a rejected admission must leave the driver as it was
            n = req.num_tokens
            ext = max(0, min(op.external, n - 1 - num_hit))   # a connector never supplies the last token
            new = n - num_hit - ext if op.chunk is None else min(op.chunk, n - num_hit - ext)
            if self._capped(num_hit + ext + new):
                return None  # the scheduler never schedules past max_model_len
            if ext and not self.api.external:
                raise TargetError("vllm: this allocate_slots takes no num_external_computed_tokens")
            if self._allocate(req, new, num_new_computed_tokens=num_hit, new_computed_blocks=hits,
                              num_external_computed_tokens=ext) is None:
                return None
            req.num_computed_tokens = num_hit + ext + new
            req.status = self.status.RUNNING
            self.running.add(op.req)
            return num_hit
        if isinstance(op, Prefill):
            req = self.reqs[op.req]
            new = min(op.n, req.num_tokens - req.num_computed_tokens)
            if self._capped(req.num_computed_tokens + new):
                return False
            if self._allocate(req, new) is None:
                return False
            req.num_computed_tokens += new
            return True
        if isinstance(op, Step):
            if op.req in self.finished and op.req not in self.running:
                return self._allocate(self.finished[op.req], 1)   # the manager must refuse it
            req = self.reqs[op.req]
            req.append_output_token_ids(op.token)  # also hashes any block it fills
            req.spec_token_ids = list(op.drafts)
            new = req.num_tokens_with_spec - req.num_computed_tokens
            # num_draft_tokens: where allocate_slots takes it (0.9.x), the scheduler passes the
            # draft count, so that drafts are never cached
            if self._capped(req.num_computed_tokens + new) or \
                    self._allocate(req, new, num_draft_tokens=len(op.drafts)) is None:
                req.spec_token_ids = []  # not scheduled: the drafts are dropped
                return False
            req.num_computed_tokens += new
            return True
        if isinstance(op, Verify):
            req = self.reqs[op.req]
            drafts = list(req.spec_token_ids)
            req.spec_token_ids = []
            req.num_computed_tokens -= len(drafts) - op.accepted
            if op.accepted:
                req.append_output_token_ids(drafts[: op.accepted])
            return None
        if isinstance(op, (Preempt, Finish)):
            # The scheduler frees a request however it ends; free() of one that holds
            # nothing is a documented no-op.
            end_request(self, m, op).spec_token_ids = []
            return None
        raise TypeError(f"{op!r} is not a cache-level op")

    def _managers(self) -> list:
        coord = getattr(self.mgr, "coordinator", None)
        return list(coord.single_type_managers) if coord is not None else [self.mgr.single_type_manager]

    def tables(self, rid: str) -> tuple[tuple[int, ...], ...]:
        """The request's block table per group (null block included), read without
        adding entries to the managers' defaultdicts."""
        return tuple(tuple(b.block_id for b in mgr.req_to_blocks.get(rid, ())) for mgr in self._managers())

    def observe(self) -> Observation:
        reqs = {}
        for rid in sorted(self.running):
            t = self.tables(rid)
            reqs[rid] = RequestState(t[0], self.reqs[rid].num_computed_tokens, t[1:])
        return observe_pool(self.mgr.block_pool, reqs)


def guard_counts(pool: Any) -> None:
    """Check, at each call, the precondition ``BlockPool.get_new_blocks`` leaves unchecked: a
    count of at least 0. A negative one (a manager that kept more hit blocks than its tokens
    need, H9 of reports/vllm-history.md) passes the pool's "enough free blocks" test and
    raises its free count without popping a block; on a valid call sequence only the
    manager's own arithmetic can produce it, so it is reported as that caller's bug
    (issue 37 part 6), at the call, before the pool is corrupted."""
    from kvspec.spec.blame import PreconditionBroken

    inner = pool.get_new_blocks

    def get_new_blocks(num_blocks: int, *args: Any, **kwargs: Any) -> Any:
        if isinstance(num_blocks, int) and num_blocks < 0:
            raise PreconditionBroken(f"BlockPool.get_new_blocks asked for {num_blocks} blocks: a negative count, "
                                     "which the pool takes unchecked (its free count would rise with no block "
                                     "popped); kvspec stopped the call",
                                     inner, sys._getframe(1))
        return inner(num_blocks, *args, **kwargs)
    pool.get_new_blocks = get_new_blocks


def end_request(driver: Any, mgr: Any, op: Any) -> Any:
    """Preempt or Finish ``op.req`` as vLLM's scheduler does, for either cache driver (one
    group or several): the scheduler frees a request however it ends, running or waiting
    (``free()`` of one that holds nothing is a documented no-op); a preempted request
    starts over, a finished one that ran keeps its computed tokens. Returns the Request."""
    req = driver.reqs.get(op.req) or driver.up.new_request(op.req, [0])
    compat.release(mgr, req, finished=isinstance(op, Finish))
    driver.running.discard(op.req)
    if isinstance(op, Preempt):
        req.num_computed_tokens = 0
        req.status = driver.status.PREEMPTED
        if hasattr(req, "num_preemptions"):  # the scheduler's counter (not in every release)
            req.num_preemptions += 1
    elif driver.reqs.pop(op.req, None) is not None and req.num_computed_tokens:
        driver.finished[op.req] = req   # it ran: its computed tokens stay, as a scheduler's would
    return req
