"""A nano-vllm-style package written for kvspec's engine-level tests (issue 36): its manager
admits with ``allocate(seq, num_cached_blocks)`` (the count ``can_allocate`` returned), and
its scheduler publishes the hashes of the blocks a step filled in ``postprocess``, after the
forward pass (``commit_hashes``).

Like nano-vllm, importing the package itself needs what only a GPU machine has."""
from nanolate.gpu_runtime_not_installed import LLM  # noqa: F401  (never importable here)
