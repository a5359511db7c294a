"""A nano-vllm-style package written for kvspec's engine-level tests (issue 36): its scheduler
admits with ``allocate_and_hash(seq, n)``, grows with ``allocate_incremental(seq, chunk)``,
and its ``schedule()`` returns a dataclass with a ``.sequences`` field.

Like nano-vllm, importing the package itself needs what only a GPU machine has."""
from nanomixed.gpu_runtime_not_installed import LLM  # noqa: F401  (never importable here)
