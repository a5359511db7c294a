"""A tiny chunked-prefill nano-vllm-style package for kvspec's engine-level tests (written
for kvspec): prompts are computed in chunks of at most ``chunk_size`` tokens per step, next
to decodes, in one batch; no prefix caching."""
