"""Target adapters: one module per allocator family (``impl_target``, ``vllm_target``,
``nanovllm_target``, ``user_target``), the shared vLLM-v1 driver (``v1_driver``),
in-place snapshots (``snapshot``), patched imports (``patched``, ``vllm_patch``,
``nano_loader``), ``registry`` (a target spec string -> a Target) and ``bench``.

May import: spec, errors, patching, ``kvspec.impl``. Never check, mc, corpus, report or cli.
"""
from .base import Driver, Target, TargetError, Traits
from .registry import load_target

__all__ = ["Driver", "Target", "TargetError", "Traits", "load_target"]
