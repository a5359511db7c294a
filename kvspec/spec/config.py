"""The configuration an allocator is built with for one run (part of every repro)."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional


@dataclass(frozen=True)
class Config:
    level: str = "pool"        # "pool" or "cache"
    num_blocks: int = 8        # including the null block where the target has one
    block_size: int = 2        # tokens per block (cache level)
    caching: bool = True       # prefix caching on
    kv_groups: str = "full"    # KV-cache groups sharing the pool, e.g. "full,swa:4" (cache level)
    max_model_len: Optional[int] = None  # per-request token cap (cache level); None: none
    use_eagle: bool = False    # cache level: an EAGLE/MTP drafter reads the KV-cache, so a prefix hit drops the
                               # last block it matched (the drafter recomputes it): spec.model.groups.eagle_hit
    spec_tokens: int = 0       # engine level: speculative decoding with this many draft tokens per step; 0: off
    spec_method: str = "ngram" # engine level: the drafter ("ngram": no lookahead slots; "draft_model", "eagle":
                               # the drafter writes KV past the scheduled tokens, spec_tokens lookahead slots)
    policy: str = "fcfs"       # engine level: the scheduling policy ("fcfs" or "priority")
    connector: Optional[str] = None  # engine level: a KV connector serving these prompt prefixes' KV
                               # (token lists joined by '|'; kvspec.vllm.connector); None: none
    async_scheduling: bool = False  # engine level: a step in flight while the next is scheduled (vLLM's
                               # AsyncScheduler, two batches in flight: kvspec.vllm.inputs)

    def to_dict(self) -> dict:
        return asdict(self)
