"""The reference models: plain, obviously correct statements of what an allocator
should do. They share no code with ``kvspec.impl`` on purpose."""
from kvspec.spec.model.cache import CacheModel, ReqModel
from kvspec.spec.model.pool import PoolModel

__all__ = ["PoolModel", "CacheModel", "ReqModel", "model_for"]


def model_for(config, traits):
    """The model matching ``config.level``; at the cache level, the group-aware one for
    targets that declare ``cache_features`` (groups, chunks, drafts, extra keys...)."""
    if config.level != "cache":
        return PoolModel(config, traits)
    if getattr(traits, "cache_features", False):
        from kvspec.spec.model.hybrid import GroupCacheModel
        return GroupCacheModel(config, traits)
    if getattr(config, "kv_groups", "full") != "full" or getattr(config, "max_model_len", None) is not None:
        from kvspec.errors import TargetError
        raise TargetError(f"this target does not support KV-cache groups or max_model_len "
                          f"(kv_groups={config.kv_groups!r}, max_model_len={config.max_model_len!r})")
    return CacheModel(config, traits)
