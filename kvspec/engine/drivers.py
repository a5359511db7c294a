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


def engine_shape(config: Config) -> Any:
    from kvspec.engine.vllm_engine import EngineShape
    return EngineShape(block_size=config.block_size, num_blocks=config.num_blocks, caching=config.caching,
                       kv_groups=config.kv_groups or "full")


def supports_engine(target: Any) -> bool:
    from kvspec.targets.vllm_target import VllmTarget
    return callable(getattr(target, "engine_driver", None)) or isinstance(target, VllmTarget)


def engine_driver(target: Any, config: Config) -> EngineDriver:
    """The engine of ``target`` built for ``config`` (TargetError: it has none)."""
    own = getattr(target, "engine_driver", None)
    if callable(own):
        return own(config)
    from kvspec.targets.vllm_target import VllmTarget
    if isinstance(target, VllmTarget):
        from kvspec.engine.vllm_engine import SCHEDULER_MODULE, VllmEngine
        from kvspec.targets.vllm_patch import import_vllm
        if not getattr(target, "groups", False):
            raise TargetError("vllm: the engine level needs vLLM 0.26.0 or later (the current manager API)")
        mods = import_vllm(getattr(target, "patch_text", None), (SCHEDULER_MODULE,))
        return VllmEngine(mods, engine_shape(config))
    raise TargetError(f"target {getattr(target, 'name', target)} has no engine (the engine level drives "
                      f"vllm and nanovllm[:PKG])")
