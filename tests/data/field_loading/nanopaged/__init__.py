"""A nano-vllm-style package written for kvspec's tests whose blocks are split into pages
of a size tied to the block size; its __init__ needs a GPU runtime not installed here."""
from nanopaged.gpu_runtime_not_installed import LLM  # noqa: F401
