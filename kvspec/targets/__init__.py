"""Target adapters: how kvspec drives each allocator (see ``base``), and ``load_target``."""
from .base import Driver, Target, TargetError, Traits
from .registry import load_target

__all__ = ["Driver", "Target", "TargetError", "Traits", "load_target"]
