"""The dense oracle: the same two functions as the kernels, in plain torch.

Each sequence's K and V are gathered through its block table into contiguous
tensors, the KV heads are repeated for GQA, and attention is computed with a
max-subtracted softmax. By default everything is float64. With a sliding window only
the keys some query can see are gathered, so table entries of blocks wholly before
the window (an allocator may leave the null block there) are never read. ``compute_dtype`` runs the
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


def gather_kv(cache: torch.Tensor, table_row: torch.Tensor, seq_len: int, start: int = 0) -> torch.Tensor:
    """Positions ``start .. seq_len - 1`` of a sequence, [seq_len - start, kv_heads, head_dim],
    from its blocks; table entries outside those positions (padding, or blocks wholly
    before ``start``) are never read."""
    block_size = cache.shape[1]
    first = start // block_size
    used = -(-seq_len // block_size)
    blocks = table_row[first:used].long()
    dense = cache[blocks].reshape((used - first) * block_size, *cache.shape[2:])
    return dense[start - first * block_size: seq_len - first * block_size]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
              softcap: Optional[float], sliding_window: Optional[int] = None) -> torch.Tensor:
    """q [n_q, Hq, D] over k, v [n_k, Hkv, D]; the queries are the last n_q of the n_k positions.

    A query at position p sees the keys k <= p, and with ``sliding_window`` W only those
    with p - W < k (vLLM's convention; see ``paged_attention``). The masks depend on
    position differences only, so k and v may start at any absolute position."""
    n_q, hq, _ = q.shape
    n_k, hkv, _ = k.shape
    k = k.repeat_interleave(hq // hkv, dim=1)  # query head h reads KV head h // group
    v = v.repeat_interleave(hq // hkv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    q_pos = torch.arange(n_k - n_q, n_k)[:, None]
    k_pos = torch.arange(n_k)[None, :]
    hidden = k_pos > q_pos  # causal, cached prefix included
    if sliding_window is not None:
        hidden = hidden | (k_pos <= q_pos - sliding_window)
    scores = scores.masked_fill(hidden, float("-inf"))
    scores = scores - scores.amax(dim=-1, keepdim=True)
    probs = scores.exp()
    probs = probs / probs.sum(dim=-1, keepdim=True)
    return torch.einsum("hqk,khd->qhd", probs, v)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, *, cu_seqlens_q: Optional[torch.Tensor] = None,
                    scale: Optional[float] = None, softcap: Optional[float] = None,
                    sliding_window: Optional[int] = None,
                    compute_dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Dense attention with the kernel's contract; the result is in ``compute_dtype``.

    ``sliding_window`` W: a query at position p sees the keys p - W < k <= p (the
    kernel's docstring states the convention and where vLLM defines it)."""
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"reference.paged_attention: sliding_window must be None or >= 1; got {sliding_window}")
    dt = compute_dtype
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    out = torch.zeros(q.shape, dtype=dt)
    lens = seq_lens.tolist()
    cu = cu_seqlens_q.tolist() if cu_seqlens_q is not None else list(range(len(lens) + 1))
    for i, n in enumerate(lens):
        lo, hi = cu[i], cu[i + 1]
        if n == 0 or hi == lo:
            continue  # an empty sequence attends to nothing: zeros
        # The first key the earliest query sees; the masks are shift-invariant, so the
        # dense K/V may start there.
        start = 0 if sliding_window is None else max(0, n - (hi - lo) - sliding_window + 1)
        k = gather_kv(k_cache.cpu(), block_tables[i].cpu(), n, start).to(dt)
        v = gather_kv(v_cache.cpu(), block_tables[i].cpu(), n, start).to(dt)
        out[lo:hi] = attention(q[lo:hi].cpu().to(dt), k, v, scale, softcap, sliding_window)
    return out
