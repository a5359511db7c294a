"""The reference models: plain, obviously correct statements of what an allocator
should do. They share no code with ``kvspec.impl`` on purpose."""
from kvspec.spec.model.cache import CacheModel, ReqModel
from kvspec.spec.model.pool import PoolModel

__all__ = ["PoolModel", "CacheModel", "ReqModel", "model_for"]


def model_for(config, traits):
    """The model matching ``config.level``."""
    return CacheModel(config, traits) if config.level == "cache" else PoolModel(config, traits)
