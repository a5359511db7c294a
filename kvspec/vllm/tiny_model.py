"""The tiny model a CPU engine is configured with: a two-layer Llama's ``config.json``
in a temporary folder, and its ``ModelConfig``. No weights, no tokenizer: vLLM's
scheduler reads only the shape. Its own module because the engine and the drafter
inputs (``kvspec.vllm.inputs``) both build on it, and neither should import the other."""
from __future__ import annotations

import functools
import json
import os
import tempfile
from typing import Any

from kvspec.vllm import engine_compat as compat

VOCAB = 1000  # token ids drawn stay below it


@functools.lru_cache(maxsize=2)
def tiny_model_dir(name: str = "llama") -> str:
    """A folder holding only the config.json of a two-layer Llama with a tiny vocabulary:
    enough for vLLM's ``ModelConfig``; no weights, no tokenizer. ``name`` goes into the
    folder's name (an EAGLE head's folder says "eagle-": 0.8.x tells the drafter by it)."""
    d = tempfile.mkdtemp(prefix=f"kvspec-tiny-{name}-")
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
           "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 2,
           "vocab_size": VOCAB, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "torch_dtype": "float32",
           "bos_token_id": 1, "eos_token_id": 2}
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    return d


def model_config(max_model_len: int) -> Any:
    """The tiny model's ``ModelConfig`` (arguments an older release requires: ``engine_compat.construct``)."""
    from vllm.config import ModelConfig
    return compat.construct(ModelConfig, dict(model=tiny_model_dir(), skip_tokenizer_init=True, dtype="float32",
                                              max_model_len=max_model_len), tiny_model_dir())
