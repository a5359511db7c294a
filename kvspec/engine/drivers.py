"""Which engine drives a target at the engine level.

A target offers its engine by a method ``engine_driver(config) -> EngineDriver``; the
ones kvspec ships are looked up here by kind, so no target module imports the engine
package. (The nano-vllm engine is added here by its module, ``nano_engine``.)
"""
from __future__ import annotations

from typing import Any

from kvspec.engine.protocol import EngineDriver
from kvspec.errors import TargetError
from kvspec.spec.config import Config


CHUNKED_OFF = ("vllm engine: --kv-groups {spec}: VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE is off, and then "
               "vLLM plans chunked local attention as full attention with the hybrid KV-cache manager off "
               "(vllm/v1/core/kv_cache_planning.py), so its engine never runs a chunked group (it is on by default "
               "in vLLM 0.33.0, vllm/envs.py)")
CHUNK_NOT_BLOCKS = ("vllm engine: --kv-groups {spec}: a chunk of {chunk} tokens is not a whole number of "
                    "{block_size}-token blocks, which vLLM's attention metadata refuses "
                    "(assert attn_chunk_size % block_size == 0, vllm/v1/attention/backends/utils.py)")


def _chunked_hybrid_allowed() -> bool:
    """vLLM's own reading of the switch (its default where unset: on in 0.33.0)."""
    try:
        import vllm.envs as envs
        return bool(envs.VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE)
    except Exception:  # an older vLLM without the switch
        import os
        return os.environ.get("VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE", "1") != "0"


def engine_shape(config: Config) -> Any:
    """The vLLM engine's shape for ``config``; a KV-group set vLLM's own validation or
    planning would not build is refused with one line citing the check."""
    from kvspec.vllm.engine import EngineShape
    spec = config.kv_groups or "full"
    chunks = [g.split(":", 1)[1] for g in spec.split(",") if g.strip().startswith("chunked:")]
    if chunks and not _chunked_hybrid_allowed():
        raise TargetError(CHUNKED_OFF.format(spec=spec))
    for c in chunks:
        if c.strip().isdigit() and int(c) % config.block_size:
            raise TargetError(CHUNK_NOT_BLOCKS.format(spec=spec, chunk=int(c), block_size=config.block_size))
    cap = getattr(config, "max_model_len", None)
    return EngineShape(block_size=config.block_size, num_blocks=config.num_blocks, caching=config.caching,
                       kv_groups=spec, spec_tokens=getattr(config, "spec_tokens", 0),
                       spec_method=getattr(config, "spec_method", "ngram"), policy=getattr(config, "policy", "fcfs"),
                       connector=getattr(config, "connector", None),
                       async_scheduling=bool(getattr(config, "async_scheduling", False)),
                       **({"max_model_len": cap} if cap else {}))


def supports_spec_decode(target: Any) -> bool:
    """Whether the engine level draws speculative decoding for ``target`` (vLLM's n-gram drafter)."""
    from kvspec.vllm.target import VllmTarget
    return isinstance(target, VllmTarget)


def draws_deployment_inputs(target: Any) -> bool:
    """Whether the engine level draws the deployment inputs (reset, lookahead, priority, a
    connector) for ``target``: every vLLM release whose engine the groups driver builds,
    the legacy engine's (0.9.x to 0.30.x) included, and the releases before the groups
    driver whose scheduler the legacy engine drives (0.8.x). Each input is drawn only where
    the release has it (``kvspec.vllm.inputs.features``, by feature)."""
    from kvspec.vllm.target import VllmTarget
    return isinstance(target, VllmTarget) and (bool(getattr(target, "groups", False)) or legacy_engine_drives(target))


def preallocating_manager(target: Any) -> bool:
    """Whether ``target``'s KV manager preallocates blocks past a request's tokens (vLLM
    0.8.4 and before, ``kvspec.vllm.engine_compat.preallocates``, found by feature)."""
    from kvspec.vllm.target import VllmTarget
    if not isinstance(target, VllmTarget):
        return False
    from kvspec.vllm.engine_compat import preallocates
    return preallocates(target.up.manager.KVCacheManager)


def legacy_engine_drives(target: Any) -> bool:
    """Whether the legacy engine (``kvspec.vllm.engine_compat.drivable_legacy``, found by feature)
    drives ``target``'s scheduler."""
    from kvspec.vllm.target import VllmTarget
    if not isinstance(target, VllmTarget):
        return False
    from kvspec.vllm.engine_compat import drivable_legacy
    from kvspec.vllm.engine import scheduler_module
    from kvspec.vllm.patch import import_vllm
    name = scheduler_module()
    mods = import_vllm(getattr(target, "patch_text", None), (name,))
    return drivable_legacy(mods["vllm.v1.request"], mods[name])


def supports_engine(target: Any) -> bool:
    from kvspec.targets.nanovllm_target import NanoTarget
    from kvspec.vllm.target import VllmTarget
    if isinstance(target, NanoTarget):
        from kvspec.engine.nano_engine import has_scheduler
        return has_scheduler(target)
    return callable(getattr(target, "engine_driver", None)) or isinstance(target, VllmTarget)


def engine_driver(target: Any, config: Config) -> EngineDriver:
    """The engine of ``target`` built for ``config`` (TargetError: it has none)."""
    own = getattr(target, "engine_driver", None)
    if callable(own):
        return own(config)
    from kvspec.targets.nanovllm_target import NanoTarget
    if isinstance(target, NanoTarget):
        from kvspec.engine.nano_engine import engine_driver_for
        return engine_driver_for(target, config)
    from kvspec.vllm.target import VllmTarget
    if isinstance(target, VllmTarget):
        from kvspec.vllm.engine import VllmEngine, scheduler_module
        from kvspec.vllm.patch import import_vllm
        name = scheduler_module()
        mods = import_vllm(getattr(target, "patch_text", None), (name,))
        from kvspec.vllm.engine_compat import drivable_legacy, legacy_engine   # HOOK: 0.9.x
        if drivable_legacy(mods["vllm.v1.request"], mods[name]):
            return legacy_engine(VllmEngine)(mods, engine_shape(config))
        if not getattr(target, "groups", False):
            raise TargetError("vllm: the engine level needs a KVCacheManager built from a KVCacheConfig that takes "
                              "the hit as num_new_computed_tokens (vLLM 0.9.0 on)")
        return VllmEngine(mods, engine_shape(config))
    raise TargetError(f"target {getattr(target, 'name', target)} has no engine (the engine level drives "
                      f"vllm and nanovllm[:PKG])")
