"""A nano-vllm-style package written for kvspec's tests whose Sequence reads a global
config; its __init__ needs a GPU runtime that is not installed here."""
from nanoglobal.gpu_runtime_not_installed import LLM  # noqa: F401
