"""The dense oracle: the same two functions as the kernels, in plain torch.

Each sequence's K and V are gathered through its block table into contiguous
tensors, the KV heads are repeated for GQA, and attention is computed with a
max-subtracted softmax. By default everything is float64. ``compute_dtype`` runs the
very same maths in another dtype: the tolerance rule (``tolerance.py``) measures how
far that lands from float64 to decide how close the kernel must be.
"""
from __future__ import annotations

from typing import Optional

import torch


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Token i goes to slot ``slot_mapping[i]`` (flattened over blocks x block_size); -1 is skipped."""
    block_size = k_cache.shape[1]
    for i, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        k_cache[slot // block_size, slot % block_size] = key[i].to(k_cache.dtype)
        v_cache[slot // block_size, slot % block_size] = value[i].to(v_cache.dtype)


def gather_kv(cache: torch.Tensor, table_row: torch.Tensor, seq_len: int) -> torch.Tensor:
    """A sequence's logical [seq_len, kv_heads, head_dim] from its blocks; padding is never read."""
    block_size = cache.shape[1]
    used = -(-seq_len // block_size)
    blocks = table_row[:used].long()
    return cache[blocks].reshape(used * block_size, *cache.shape[2:])[:seq_len]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
              softcap: Optional[float]) -> torch.Tensor:
    """q [n_q, Hq, D] over k, v [n_k, Hkv, D]; the queries are the last n_q of the n_k positions."""
    n_q, hq, _ = q.shape
    n_k, hkv, _ = k.shape
    k = k.repeat_interleave(hq // hkv, dim=1)  # query head h reads KV head h // group
    v = v.repeat_interleave(hq // hkv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    q_pos = torch.arange(n_k - n_q, n_k)[:, None]
    k_pos = torch.arange(n_k)[None, :]
    scores = scores.masked_fill(k_pos > q_pos, float("-inf"))  # causal, cached prefix included
    scores = scores - scores.amax(dim=-1, keepdim=True)
    probs = scores.exp()
    probs = probs / probs.sum(dim=-1, keepdim=True)
    return torch.einsum("hqk,khd->qhd", probs, v)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, *, cu_seqlens_q: Optional[torch.Tensor] = None,
                    scale: Optional[float] = None, softcap: Optional[float] = None,
                    compute_dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Dense attention with the kernel's contract; the result is in ``compute_dtype``."""
    dt = compute_dtype
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    out = torch.zeros(q.shape, dtype=dt)
    lens = seq_lens.tolist()
    cu = cu_seqlens_q.tolist() if cu_seqlens_q is not None else list(range(len(lens) + 1))
    for i, n in enumerate(lens):
        lo, hi = cu[i], cu[i + 1]
        if n == 0 or hi == lo:
            continue  # an empty sequence attends to nothing: zeros
        k = gather_kv(k_cache.cpu(), block_tables[i].cpu(), n).to(dt)
        v = gather_kv(v_cache.cpu(), block_tables[i].cpu(), n).to(dt)
        out[lo:hi] = attention(q[lo:hi].cpu().to(dt), k, v, scale, softcap)
    return out
