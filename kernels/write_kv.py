"""Store new tokens' K and V into the paged cache at ``slot_mapping`` (a slot of -1 is skipped)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_CPU_TOKENS, _GPU_TOKENS = 64, 8  # tokens per program: few programs under the interpreter


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    num_tokens, head_dim, block_size,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch,
    BLOCK_T: tl.constexpr, BLOCK_HD: tl.constexpr, HD: tl.constexpr,
):
    # Tile: BLOCK_T tokens x (kv_heads * head_dim) flattened, padded to a power of two.
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    hd = tl.arange(0, BLOCK_HD)
    h = hd // head_dim
    d = hd % head_dim
    t_ok = t < num_tokens
    slot = tl.load(slot_ptr + t, mask=t_ok, other=-1).to(tl.int64)
    ok = (t_ok & (slot >= 0))[:, None] & (hd < HD)[None, :]
    block = slot // block_size
    off = slot % block_size

    src_k = key_ptr + t[:, None].to(tl.int64) * stride_kt + h[None, :] * stride_kh + d[None, :]
    src_v = value_ptr + t[:, None].to(tl.int64) * stride_vt + h[None, :] * stride_vh + d[None, :]
    dst_k = k_cache_ptr + block[:, None] * stride_kcb + off[:, None] * stride_kcs + h[None, :] * stride_kch + d[None, :]
    dst_v = v_cache_ptr + block[:, None] * stride_vcb + off[:, None] * stride_vcs + h[None, :] * stride_vch + d[None, :]
    k = tl.load(src_k, mask=ok)
    v = tl.load(src_v, mask=ok)
    tl.store(dst_k, k, mask=ok)
    tl.store(dst_v, v, mask=ok)


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write ``key``/``value`` [tokens, kv_heads, head_dim] to slot ``block * block_size + offset``
    of the caches [blocks, block_size, kv_heads, head_dim], in place."""
    if key.dim() != 3 or key.shape != value.shape or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"write_kv: want key/value [tokens, kv_heads, dim] and caches [blocks, block_size, "
                         f"kv_heads, dim]; got {tuple(key.shape)}, {tuple(value.shape)}, {tuple(k_cache.shape)}")
    if tuple(key.shape[1:]) != tuple(k_cache.shape[2:]):
        raise ValueError(f"write_kv: token shape {tuple(key.shape[1:])} != cache slot shape {tuple(k_cache.shape[2:])}")
    if slot_mapping.shape != (key.shape[0],) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError("write_kv: slot_mapping must be an int32/int64 vector with one slot per token")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("write_kv: the caches' head_dim must be contiguous (stride 1)")
    num_blocks, block_size, heads, dim = k_cache.shape
    n = key.shape[0]
    if n == 0:
        return
    # Under the interpreter a stray store corrupts host memory; on a GPU the check would cost a sync.
    if not key.is_cuda and int(slot_mapping.max()) >= num_blocks * block_size:
        raise ValueError(f"write_kv: slot {int(slot_mapping.max())} is past the cache "
                         f"({num_blocks * block_size} slots)")
    # Cast on the host: the interpreter rounds fp32 -> bf16 toward zero, torch and GPUs to
    # nearest even; done here the store is a bit-exact copy everywhere.
    key = key.to(k_cache.dtype)
    value = value.to(v_cache.dtype)
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    block_t = _GPU_TOKENS if key.is_cuda else _CPU_TOKENS
    _write_kv_kernel[(triton.cdiv(n, block_t),)](
        key, value, k_cache, v_cache, slot_mapping,
        n, dim, block_size,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        BLOCK_T=block_t, BLOCK_HD=triton.next_power_of_2(heads * dim), HD=heads * dim,
    )
