"""A v1-style nano-vllm package written for kvspec's tests; like nano-vllm, its __init__
needs a GPU runtime that is not installed here."""
from nanolayout.gpu_runtime_not_installed import LLM  # noqa: F401
