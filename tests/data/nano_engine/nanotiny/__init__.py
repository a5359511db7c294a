"""A tiny nano-vllm-style package for kvspec's engine-level tests (written for kvspec).

Like nano-vllm, its ``__init__`` imports what only a GPU machine has; kvspec must load
``nanotiny.engine.scheduler`` without running it."""
from nanotiny.gpu_runtime_not_installed import LLM  # noqa: F401  (never importable here)
