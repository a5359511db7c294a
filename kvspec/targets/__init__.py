"""Target adapters: one module per allocator family (``impl_target``,
``nanovllm_target``, ``user_target``; vLLM's is the package ``kvspec.vllm``), the shared
vLLM-v1-shaped driver (``v1_driver``, also used by impl and users' v1-style pools),
in-place snapshots (``snapshot``), patched imports (``patched``, ``nano_loader``),
``registry`` (a target spec string -> a Target) and ``bench``.

May import: spec, errors, patching, ``kvspec.impl``. Never check, mc, corpus, report or cli.
"""
from .base import Driver, Target, TargetError, Traits
from .registry import load_target

__all__ = ["Driver", "Target", "TargetError", "Traits", "load_target"]
