"""What ``VllmEngine`` needs to drive an older vLLM release's v1 ``Scheduler`` (0.9.x on).

The engine level was written against vLLM 0.33.0. A release from before the KV-cache
coordinator (0.9.x) differs in five places the engine touches, and nowhere else:

- ``Request`` takes multimodal inputs, hashes, placeholders, an EOS id and an arrival
  time positionally, and no ``block_hasher`` (the manager hashes a request's tokens
  itself, into ``req_to_block_hashes``: the list vllm#19459 is about);
- ``Scheduler`` takes no ``block_size``;
- ``ModelRunnerOutput`` has required fields beyond the sampled tokens, and carries the
  drafter's proposals (``spec_token_ids``) instead of ``update_draft_token_ids``;
- the manager holds one ``single_type_manager`` instead of a coordinator's list;
- ``Upstream``'s per-request block hasher does not exist.

0.8.x differs further, each read off a signature or the code: ``ModelConfig``/``CacheConfig``
require arguments positionally (``construct``); the Scheduler takes the config's parts, and
before 0.8.3 no ``KVCacheConfig`` (``scheduler_args``, ``takes_kv_cache_config``); the manager
holds its one group's tables itself (``single_type_managers``); before 0.8.3 the output update,
not ``schedule()``, advances computed tokens (``advances_in_update``); 0.8.4's scheduler tells
EAGLE by ``method == "eagle"`` (``scheduler_sees_eagle``); the manager preallocates
(``preallocates``: the engine machine draws scarce pools there). 0.8.0/0.8.1's V0
``SpeculativeConfig`` is refused in one line (``require_spec_by_method``).

Each helper answers for either API, so the 0.33.0 path is unchanged.
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Optional


def is_legacy(request_mod: Any) -> bool:
    """True for a release whose ``Request`` has no ``block_hasher`` (0.9.x)."""
    return "block_hasher" not in inspect.signature(request_mod.Request.__init__).parameters


def block_hasher(mods: dict[str, Any], block_size: int) -> Optional[Any]:
    """The current API's per-request block hasher; None where the manager hashes itself."""
    if is_legacy(mods["vllm.v1.request"]):
        return None
    from kvspec.vllm.target import Upstream
    up = Upstream(mods)
    return up.utils.get_request_block_hasher(block_size, up.hash_fn)


def new_request(request_mod: Any, rid: str, prompt: list[int], params: Any, hasher: Optional[Any],
                kw: dict[str, Any]) -> Any:
    """A ``Request`` built through whichever constructor the release has (its call form
    read once: ``kvspec.vllm.compat.form``). Arguments it requires and the engine
    has no use for (multimodal inputs, pooling, EOS, arrival time) get their empty value;
    an arrival time is passed only where required, so the scheduler's clock stays its own."""
    from kvspec.vllm.compat import form
    f = form(request_mod.Request)
    args: dict[str, Any] = {"request_id": rid, "prompt_token_ids": prompt, "sampling_params": params,
                            "pooling_params": None, "block_hasher": hasher, **kw}
    for name in f.required:
        if name not in args:
            args[name] = 0.0 if name == "arrival_time" else None
    return request_mod.Request(**{n: v for n, v in args.items() if n in f.takes})


# the parts of a ``VllmConfig`` a Scheduler that takes no ``vllm_config`` (0.8.4 and before) takes one by one
CONFIG_PARTS = ("scheduler_config", "model_config", "cache_config", "lora_config", "speculative_config")


def scheduler_args(sched_cls: Any, cfg: Any, kv: Any, som: Any, block_size: int) -> dict[str, Any]:
    """The Scheduler's keyword arguments, in the form its constructor takes (read off its
    signature): the ``VllmConfig`` whole, or its parts (0.8.4 and before); the
    ``KVCacheConfig`` where it takes one (0.8.2 and before size the pool from the cache
    config's ``num_gpu_blocks``); ``block_size`` and ``log_stats`` only where taken."""
    takes = inspect.signature(sched_cls.__init__).parameters
    out: dict[str, Any] = {"structured_output_manager": som}
    if "vllm_config" in takes:
        out["vllm_config"] = cfg
    else:
        out.update({n: getattr(cfg, n, None) for n in CONFIG_PARTS if n in takes})
    if "kv_cache_config" in takes:
        out["kv_cache_config"] = kv
    if "log_stats" in takes:
        out["log_stats"] = False
    if "block_size" in takes:
        out["block_size"] = block_size
    return out


def single_type_managers(mgr: Any) -> list[Any]:
    """The manager's per-group managers (0.9.x has exactly one; 0.8.x's manager holds its
    one group's tables itself, ``req_to_blocks``, so it stands for its group)."""
    coord = getattr(mgr, "coordinator", None)
    if coord is not None:
        return list(coord.single_type_managers)
    return [getattr(mgr, "single_type_manager", None) or mgr]


def model_runner_output(cls: Any, ids: list[str], sampled: list[list[int]],
                        drafts: Optional[list[list[int]]]) -> Any:
    """A ``ModelRunnerOutput``; on a release whose output carries the drafter's proposals,
    ``drafts`` (one list per scheduled request) go in ``spec_token_ids``; the sampled tokens
    in the type the release's field declares (lists, or numpy arrays)."""
    fields = {f.name: f for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
    if "ndarray" in str(getattr(fields.get("sampled_token_ids"), "type", "")):
        # 0.11.1-0.11.2 take one numpy array per request (``.tolist()`` in update_from_output)
        import numpy as np
        sampled = [np.asarray(t, dtype=np.int64) for t in sampled]
    kw: dict[str, Any] = dict(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                              sampled_token_ids=sampled)
    names = set(fields)
    required = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING
                and f.default_factory is dataclasses.MISSING} if names else set()
    if "spec_token_ids" in names:
        kw["spec_token_ids"] = drafts
    for name in required - kw.keys():   # the fields a CPU run without a model leaves empty
        kw[name] = {} if name.endswith("_dict") else None
    return cls(**kw)


def common_prefix_counts(out: Any) -> tuple[int, ...]:
    """The scheduler output's ``num_common_prefix_blocks`` as one count per KV-cache group:
    an int before 0.9.0 (one group), a list after; empty from 0.32.0, where cascade attention
    is gone and the field is deprecated."""
    n = getattr(out, "num_common_prefix_blocks", None)
    if n is None:
        return ()
    return (int(n),) if isinstance(n, int) else tuple(int(x) for x in n)


def drafts_in_output(sched: Any) -> bool:
    """True where proposals travel in the ModelRunnerOutput (no ``update_draft_token_ids``)."""
    return not callable(getattr(sched, "update_draft_token_ids", None))


def proposals(ids: list[str], k: int, sample: Callable[[str, int], int], spec_on: bool) -> Optional[list[list[int]]]:
    """``k`` proposed draft tokens for each request in ``ids``. With speculative decoding
    on, 0.9.x's runner returns a list for every request every step, empty when the
    drafter proposes nothing; its scheduler keeps a request's old drafts otherwise (it
    does not clear ``spec_token_ids`` once scheduled). None: speculative decoding off."""
    return [[sample(rid, -1)] * k for rid in ids] if spec_on else None


# Arguments a release's config constructor requires with no default (0.8.x's ``ModelConfig``
# and ``CacheConfig`` take these positionally) and the engine has no use for: the values
# vLLM's own ``EngineArgs`` defaults give them. The model folder is the tokenizer's too.
NEUTRAL = {"task": "generate", "tokenizer_mode": "auto", "trust_remote_code": False, "seed": 0,
           "gpu_memory_utilization": 0.9, "swap_space": 0, "cache_dtype": "auto"}


def construct(cls: Any, kw: dict[str, Any], model_dir: str) -> Any:
    """``cls(**kw)``, plus a NEUTRAL value for each argument ``cls`` requires and ``kw``
    leaves out (read off its signature: a no-op where none is required, as on 0.9.0 on)."""
    from kvspec.vllm.compat import form
    neutral = {**NEUTRAL, "tokenizer": model_dir}
    return cls(**kw, **{n: neutral[n] for n in form(cls).required if n not in kw and n in neutral})


def require_spec_by_method() -> None:
    """The engine machine draws speculative decoding by drafter (``SpeculativeConfig(method=...)``);
    0.8.1 and before still have V0's ``SpeculativeConfig`` (a draft model config, positionally):
    a TypeError the engine turns into its one-line refusal."""
    from vllm.config import SpeculativeConfig
    if "method" not in inspect.signature(SpeculativeConfig).parameters:
        raise TypeError("this release's SpeculativeConfig takes no drafter method (V0's form), which the "
                        "engine level's speculative decoding needs")


def scheduler_sees_eagle(spec: Any) -> bool:
    """Whether the release's Scheduler reserves lookahead slots for this speculative config:
    its ``use_eagle()`` where it has one (0.8.5 on), else (0.8.4) ``method == "eagle"``, the
    test 0.8.4's ``Scheduler.__init__`` makes."""
    use_eagle = getattr(spec, "use_eagle", None)
    return bool(use_eagle()) if callable(use_eagle) else getattr(spec, "method", None) == "eagle"


def accepted(cls: Any, kw: dict[str, Any]) -> dict[str, Any]:
    """``kw`` less the arguments ``cls`` does not take (0.9.x's ``SchedulerConfig`` has no
    ``is_encoder_decoder``: it reads that off the model config)."""
    params = inspect.signature(cls).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return kw
    return {k: v for k, v in kw.items() if k in params}


def cpu_platform() -> None:
    """0.9.x detects a CPU platform only from a "cpu" build tag or macOS, so here (where
    the installed build is a GPU one) it resolves ``UnspecifiedPlatform``, whose
    ``VllmConfig`` checks raise ``NotImplementedError``. Modules bound that instance at
    import, so it becomes the release's ``CpuPlatform`` in place. A no-op elsewhere."""
    import vllm.platforms as platforms
    from vllm.platforms.cpu import CpuPlatform
    from vllm.platforms.interface import UnspecifiedPlatform
    current = platforms.current_platform
    if type(current) is UnspecifiedPlatform:
        current.__class__ = type("SchedulerOnlyCpuPlatform", (CpuPlatform,), {
            # CpuPlatform's own fix-ups are for its worker (IPEX block sizes, threads, the
            # worker class): no model runs here, so none applies; the scheduler's are kept.
            "check_and_update_config": classmethod(lambda cls, vllm_config: None)})


def takes_kv_cache_config(sched_cls: Any) -> bool:
    """Whether the Scheduler is given a ``KVCacheConfig`` (0.8.3 on); before, its manager
    sizes one full-attention pool from the cache config's ``num_gpu_blocks``."""
    return "kv_cache_config" in inspect.signature(sched_cls.__init__).parameters


def one_full_group(spec: str) -> None:
    """Refuses (one line) any ``--kv-groups`` but one full-attention group; None: no KVCacheConfig."""
    from kvspec.errors import TargetError
    if (spec or "full") != "full":
        raise TargetError(f"vllm engine: --kv-groups {spec}: this release's KV manager runs one group (full) here")
    return None


def legacy_kv_cache_config(iface: Any, spec: str, num_blocks: int, block_size: int) -> Any:
    """0.9.x's ``KVCacheConfig`` (``tensors``; specs need ``use_mla``): one full-attention
    group, the only kind its single-type manager takes here; other ``--kv-groups`` are refused."""
    import torch

    one_full_group(spec)
    group = iface.KVCacheGroupSpec(["model.layers.0.attn"], iface.FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32, use_mla=False))
    return iface.KVCacheConfig(num_blocks=num_blocks, tensors={}, kv_cache_groups=[group])


def structured_output_manager(cls: Any, cfg: Any, legacy: bool) -> Any:
    """0.9.x's ``StructuredOutputManager`` loads a tokenizer in its constructor, even with
    ``skip_tokenizer_init`` (and the tiny model has none). The scheduler only asks it about
    requests with structured output, which are never drawn, so there the real class is
    built without its constructor, holding what those answers read."""
    if not legacy:
        return cls(cfg)
    som = cls.__new__(cls)
    som.backend, som.reasoner, som.vllm_config, som._grammar_bitmask = None, None, cfg, None
    return som


def request_extras(label: Optional[str], legacy: bool, current: Callable[[Optional[str]], dict]) -> dict:
    """An arrival's extra keys as ``Request`` keywords. 0.9.x has no ``MultiModalFeatureSpec``;
    the engine machine draws only cache salts, which it takes as ``cache_salt`` too."""
    if not legacy or not label:
        return current(label)
    out: dict[str, Any] = {}
    for item in label.split(";"):
        kind, _, value = item.partition(":")
        if kind != "salt" or not value:
            raise ValueError(f"extra key {item!r} is not driven on this release (cache salts only)")
        out["cache_salt"] = value
    return out


def _no_replay(self: Any) -> Any:
    raise AttributeError("manager_calls: not replayed on this release (see legacy_engine)")


def legacy_engine(engine_cls: type) -> type:
    """The engine class for an older release (``drivable_legacy``): the same driver, minus
    ``manager_calls``, so the engine session does not replay the scheduler's manager calls
    through the cache model. That model's admission follows the current manager (whose chunked-prefill
    admission 0.9.x's does not share: on 0.9.0 seed 0 it calls an 8-token chunk of a
    16-token prompt with 3 blocks free "admitted although too few blocks were free"), so
    on 0.9.x it would report the model's difference, not a bug. What stays: a crash or
    hang of the scheduler, and the engine-level checks (slots, computed tokens backed,
    preempted/finished requests holding nothing: ``kvspec.engine.checks``)."""
    return type("Legacy" + engine_cls.__name__, (engine_cls,), {"manager_calls": property(_no_replay),
                                                                "extra_kinds": ("salt",)})


def preallocates(manager_cls: Any) -> bool:
    """Whether the KV manager hands an admitted request blocks beyond what its tokens need
    (``num_preallocate_tokens``, 64 tokens by default, up to every free block: 0.8.4 and
    before, read off its constructor)."""
    try:
        return "num_preallocate_tokens" in inspect.signature(manager_cls.__init__).parameters
    except (TypeError, ValueError):
        return False


def advances_in_update(sched_mod: Any) -> bool:
    """Whether the output update, not ``schedule()``, adds a step's scheduled tokens to a
    request's ``num_computed_tokens`` (read off ``update_from_output``'s code: 0.8.2 and
    before add them there; later releases only take back rejected drafts)."""
    try:
        src = inspect.getsource(sched_mod.Scheduler.update_from_output)
    except (OSError, TypeError, AttributeError):
        return False   # no source to read: the current engine
    return "num_computed_tokens +=" in src


def caches_verified_drafts(sched_mod: Any) -> bool:
    """Whether the scheduler's output update caches a drafted request's verified blocks
    (``kv_cache_manager.cache_blocks`` in ``update_from_output``, read off its code). The
    engine's manager-call replay turns that call into the cache model's Verify; a release
    without it (to 0.30.x: its next ``allocate_slots`` caches them) would replay the next
    step as a Step over unverified drafts, the model's misreading, not the release's bug."""
    try:
        src = inspect.getsource(sched_mod.Scheduler.update_from_output)
    except (OSError, TypeError, AttributeError):
        return True   # no source to read: the current engine, as for 0.33.0
    return "cache_blocks" in src


def drivable_legacy(request_mod: Any, sched_mod: Optional[Any] = None) -> bool:
    """True for a release the legacy engine (no manager-call replay) drives, found by
    feature: its manager hashes requests itself (its ``Request`` takes no ``block_hasher``:
    0.9.x and 0.10.x), or its scheduler does not cache verified drafts in the output update
    (``caches_verified_drafts``). Whether its Scheduler then builds on the CPU is the
    engine's own answer (a TargetError naming what failed), not a version list."""
    return is_legacy(request_mod) or (sched_mod is not None and not caches_verified_drafts(sched_mod))
