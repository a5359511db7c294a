"""Paged attention in Triton: decode and varlen extend/prefill over a block table.

One program handles one (sequence, KV head, query tile, context split). Its rows are
the query heads that share the KV head (GQA packing), times the query tile, so a KV
tile is loaded once per group instead of once per query head. Keys are gathered token
by token through the block table, which is why any ``block_size`` works: the tile
size (``BLOCK_N``) and the block size are independent.

With more than one split, each program stores an unnormalised partial result
(running max ``m``, denominator ``l``, accumulator ``acc``) and ``_merge_kernel``
combines the splits with a log-sum-exp merge.

With a sliding window, a program's key range starts at the first key its earliest
query may see, and the splits divide that range, not the whole context: keys (and so
blocks) before it are never loaded, which is what lets an allocator hand those
blocks back and leave the null block in their table entries.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

# Tuning defaults. On the CPU interpreter every program instance costs milliseconds,
# so tiles are wide there; on a GPU they are sized for registers and occupancy.
_CPU_TILE_N, _GPU_TILE_N = 16, 64
# Decode on a GPU takes the wide key tile where shared memory holds its pipeline: on an
# H200 it cut decode time by 12-13% at contexts 4096 and 16384 against the 64-key tile
# (interleaved A/B, reports/kernels.md).
_GPU_DECODE_TILE_N = 128
_CPU_ROWS, _GPU_ROWS = 64, 64  # target rows (query positions x heads) per extend program
_SPLIT_TOKENS = 256  # a split covers at least this many context tokens
_CPU_MERGE_ROWS, _GPU_MERGE_ROWS = 128, 16  # (token, head) rows per merge program


@triton.jit
def _finite_or_zero(m):
    # The -inf guard: a row that has seen no key yet (an empty split, or every key
    # causally masked) has max -inf, and exp(-inf - -inf) would be NaN.
    return tl.where(m == float("-inf"), 0.0, m)


@triton.jit
def _dot(a, b, FP32: tl.constexpr):
    # FP32: products in full fp32 ("ieee", no TF32). Used for fp32 inputs, where TF32 would
    # miss the tolerance, and under the interpreter, whose bf16 dot is wrong; the products of
    # two fp16/bf16 values are exact in fp32, so the result is what tensor cores compute.
    if FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _attn_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, cu_q_ptr,
    out_ptr, m_ptr, l_ptr, acc_ptr,
    scale, softcap, window,
    num_q_heads, head_dim, block_size, split_len, total_q,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr, VARLEN: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    USE_WINDOW: tl.constexpr, FP32_DOT: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_tile = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS

    seq_len = tl.load(seq_lens_ptr + seq)
    if VARLEN:
        q_first = tl.load(cu_q_ptr + seq)
        q_len = tl.load(cu_q_ptr + seq + 1) - q_first
    else:
        q_first = seq
        q_len = 1
    q_start = q_tile * BLOCK_Q
    if q_start >= q_len:
        return

    # Rows: query position (q_start + r // GROUP_PAD) x query head in the group.
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    rows = tl.arange(0, BLOCK_M)
    q_idx = q_start + rows // GROUP_PAD
    g = rows % GROUP_PAD
    q_head = kv_head * GROUP + g
    row_ok = (q_idx < q_len) & (g < GROUP) & (q_head < num_q_heads)  # never index past the heads
    q_pos = seq_len - q_len + q_idx  # absolute position: causal limit for the row

    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim  # head_dim need not be a power of two
    q_off = (q_first + q_idx)[:, None].to(tl.int64) * stride_qt + q_head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    # This program's context range: its split, cut at the last key any row may see.
    kv_end = tl.minimum(seq_len, seq_len - q_len + tl.minimum(q_start + BLOCK_Q, q_len))
    kv_start = 0
    if USE_WINDOW:  # the first key the tile's earliest query sees; nothing before it is loaded
        kv_start = tl.maximum(seq_len - q_len + q_start - window + 1, 0)
    lo = kv_start + split * split_len
    hi = tl.minimum(lo + split_len, kv_end)
    n_pages = (seq_len + block_size - 1) // block_size

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    n = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        kv_pos = start + n
        kv_ok = kv_pos < hi
        page = kv_pos // block_size
        slot = kv_pos % block_size
        # Pages past the sequence's last block are never read: the table may hold -1.
        block = tl.load(bt_ptr + seq * stride_bt + page, mask=page < n_pages, other=0).to(tl.int64)
        k_off = block[:, None] * stride_kb + slot[:, None] * stride_ks + kv_head * stride_kh + d[None, :]
        k = tl.load(k_ptr + k_off, mask=kv_ok[:, None] & d_ok[None, :], other=0.0)
        v_off = block[:, None] * stride_vb + slot[:, None] * stride_vs + kv_head * stride_vh + d[None, :]
        v = tl.load(v_ptr + v_off, mask=kv_ok[:, None] & d_ok[None, :], other=0.0)

        s = _dot(q, tl.trans(k.to(q.dtype)), FP32_DOT)
        s = s * scale
        if USE_SOFTCAP:  # softcap * tanh(s / softcap), tanh written out via exp
            t = tl.exp(-2.0 * tl.abs(s / softcap))
            th = (1.0 - t) / (1.0 + t)
            s = softcap * tl.where(s < 0, -th, th)
        visible = kv_ok[None, :] & (kv_pos[None, :] <= q_pos[:, None])
        if USE_WINDOW:  # q_pos - window < kv_pos: the window most recent positions, the query's own included
            visible = visible & (kv_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = _finite_or_zero(m_new)
        alpha = tl.exp(m_i - m_use)
        p = tl.exp(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        pv = _dot(p.to(v.dtype), v, FP32_DOT)  # P rounded to the input dtype, as on tensor cores
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    row_t = (q_first + q_idx).to(tl.int64)
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # no key at all: zeros
        o_off = row_t[:, None] * stride_ot + q_head[:, None] * stride_oh + d[None, :]
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        # Partials, contiguous [split, token, head] (m, l) and [split, token, head, d] (acc).
        idx = (split * total_q + row_t) * num_q_heads + q_head
        tl.store(m_ptr + idx, m_i, mask=row_ok)
        tl.store(l_ptr + idx, l_i, mask=row_ok)
        tl.store(acc_ptr + idx[:, None].to(tl.int64) * head_dim + d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _merge_kernel(
    out_ptr, m_ptr, l_ptr, acc_ptr,
    num_q_heads, head_dim, num_rows, num_splits,
    stride_ot, stride_oh,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # Rows are (query token, head) pairs, flattened as the partials store them. For each:
    # out = sum_s w_s acc_s / sum_s w_s l_s with w_s = exp(m_s - max_s m_s), so every
    # split's partial is rescaled from its own running max to the common one.
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    r_ok = r < num_rows
    rd_ok = r_ok[:, None] & (d < head_dim)[None, :]

    m_max = tl.full([BLOCK_R], float("-inf"), tl.float32)
    for s in range(0, num_splits):
        m_s = tl.load(m_ptr + s * num_rows + r, mask=r_ok, other=float("-inf"))
        m_max = tl.maximum(m_max, m_s)
    m_use = _finite_or_zero(m_max)  # every split empty (seq_len 0)

    num = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    den = tl.zeros([BLOCK_R], tl.float32)
    for s in range(0, num_splits):
        idx = s * num_rows + r
        m_s = tl.load(m_ptr + idx, mask=r_ok, other=float("-inf"))
        w = tl.exp(m_s - m_use)
        den += w * tl.load(l_ptr + idx, mask=r_ok, other=0.0)
        num += w[:, None] * tl.load(acc_ptr + idx[:, None].to(tl.int64) * head_dim + d[None, :], mask=rd_ok, other=0.0)
    out = num / tl.where(den == 0.0, 1.0, den)[:, None]
    t = r // num_q_heads
    h = r % num_q_heads
    o_off = t[:, None].to(tl.int64) * stride_ot + h[:, None] * stride_oh + d[None, :]
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=rd_ok)


def _check_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor, cu_seqlens_q: Optional[torch.Tensor]) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"paged_attention: want q [tokens, heads, dim] and two caches [blocks, block_size, kv_heads,"
                         f" dim]; got q {tuple(q.shape)}, k {tuple(k_cache.shape)}, v {tuple(v_cache.shape)}")
    hq, dim = q.shape[1], q.shape[2]
    hkv = k_cache.shape[2]
    if k_cache.shape[3] != dim or hkv == 0 or hq % hkv:
        raise ValueError(f"paged_attention: {hq} query heads of dim {dim} do not fit {hkv} KV heads of dim "
                         f"{k_cache.shape[3]}")
    if block_tables.dim() != 2 or block_tables.dtype != torch.int32 or seq_lens.dim() != 1:
        raise ValueError("paged_attention: block_tables must be int32 [num_seqs, max_blocks], seq_lens 1-D")
    if block_tables.shape[0] != seq_lens.shape[0]:
        raise ValueError("paged_attention: block_tables and seq_lens disagree on the number of sequences")
    if cu_seqlens_q is None and q.shape[0] != seq_lens.shape[0]:
        raise ValueError("paged_attention: decode wants one query per sequence")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("paged_attention: the caches' head_dim must be contiguous (stride 1)")
    n = seq_lens.shape[0]
    if cu_seqlens_q is not None and (cu_seqlens_q.dtype != torch.int32 or cu_seqlens_q.shape != (n + 1,)):
        raise ValueError("paged_attention: cu_seqlens_q must be int32 [num_seqs + 1]")


def _num_splits(num_seqs: int, num_kv_heads: int, max_len: int, tile_n: int, on_gpu: bool) -> int:
    """Split the context only when there are too few (sequence, head) programs to fill
    the machine; each split keeps at least _SPLIT_TOKENS tokens. ``max_len`` is the
    most keys one program can see (with a sliding window, at most the window)."""
    most = max(1, triton.cdiv(max_len, max(_SPLIT_TOKENS, tile_n)))
    if on_gpu:
        sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        want = triton.cdiv(2 * sms, max(1, num_seqs * num_kv_heads))
    else:
        want = 4 if max_len > 4 * _SPLIT_TOKENS else 1  # long context only: interpreter programs are slow
    return max(1, min(most, want, 64))


@functools.lru_cache(maxsize=None)
def _shared_memory_bytes(device: int) -> int:
    """Shared memory one program may use on ``device`` (the opt-in limit); 0 when unknown."""
    try:
        return int(triton.runtime.driver.active.utils.get_device_properties(device)["max_shared_mem"])
    except Exception:  # an unknown backend: the narrow tile, which fits everywhere, is taken
        return 0


def _gpu_decode_tile(q: torch.Tensor, block_d: int, num_stages: int) -> int:
    """The decode key tile: ``_GPU_DECODE_TILE_N`` if ``num_stages`` K and V tiles of that
    width fit this device's shared memory (a Hopper's 227 KB holds 128 x 128 bf16 at 3
    stages, 192 KB; an A100's 163 KB does not), else ``_GPU_TILE_N``."""
    need = num_stages * 2 * _GPU_DECODE_TILE_N * block_d * q.element_size() + 16 * 1024  # + Q tile, scratch
    device = torch.cuda.current_device() if q.device.index is None else q.device.index
    return _GPU_DECODE_TILE_N if _shared_memory_bytes(device) >= need else _GPU_TILE_N


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, *, cu_seqlens_q: Optional[torch.Tensor] = None,
                    scale: Optional[float] = None, softcap: Optional[float] = None,
                    sliding_window: Optional[int] = None,
                    num_splits: Optional[int] = None, tile_n: Optional[int] = None,
                    out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention of ``q`` over the paged K/V cache (contract: DESIGN.md, "Kernels").

    ``sliding_window``: ``None`` (the default) attends to the whole causal context. An
    int ``W >= 1`` lets a query at absolute position ``p`` attend to the key positions
    ``k`` with ``p - W < k <= p``: the ``W`` most recent positions, its own included
    (``W = 1`` sees only itself; ``W >= seq_len`` is the same as no window). This is
    vLLM's convention: its attention backends turn ``sliding_window`` into the
    FlashAttention window ``(sliding_window - 1, 0)`` for decoder attention, i.e.
    ``0 <= p - k <= W - 1`` (vllm/v1/attention/backends/triton_attn.py and
    flash_attn.py; the unified Triton kernel masks ``p - k < SLIDING_WINDOW`` with
    ``SLIDING_WINDOW = 1 + window_size[0]``). Table entries of blocks that hold no
    key the sequence's earliest query (in this call) can see are never read, nor are
    the K/V slots of such keys, so an allocator may point them at a null block.

    ``num_splits``, ``tile_n`` and ``out`` are tuning and testing knobs beyond the
    contract: force the split-KV path, set the key tile width, and write into a given
    (e.g. NaN-poisoned) output tensor.
    """
    _check_inputs(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q)
    if sliding_window is not None and (isinstance(sliding_window, bool) or int(sliding_window) != sliding_window
                                       or sliding_window < 1):
        raise ValueError(f"paged_attention: sliding_window must be None or an int >= 1; got {sliding_window!r}")
    num_seqs = seq_lens.shape[0]
    total_q, hq, dim = q.shape
    _, block_size, hkv, _ = k_cache.shape
    group = hq // hkv
    on_gpu = q.is_cuda
    if q.stride(-1) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError("paged_attention: out must match q in shape and dtype, with head_dim contiguous")
    if total_q == 0 or num_seqs == 0:
        return out

    # Host-side sizes for the grid: one host sync per call.
    lens = seq_lens.tolist()
    max_len = max(lens)
    if min(lens) < 0 or max_len > block_tables.shape[1] * block_size:  # why: the table row would be overrun
        raise ValueError(f"paged_attention: seq_lens must lie in [0, {block_tables.shape[1] * block_size}] "
                         f"(max_blocks x block_size); got {min(lens)}..{max_len}")
    if cu_seqlens_q is None:
        q_lens = [1] * num_seqs
    else:
        cu = cu_seqlens_q.tolist()
        q_lens = [cu[i + 1] - cu[i] for i in range(num_seqs)]
        if cu[0] != 0 or cu[-1] != total_q or any(ql < 0 or ql > sl for ql, sl in zip(q_lens, lens)):
            raise ValueError("paged_attention: cu_seqlens_q must rise from 0 to total_q, each query count <= seq_len")

    group_pad = triton.next_power_of_2(group)
    # On a GPU, wide heads or fp32 halve the tiles so they fit in shared memory (untested on hardware yet).
    big = on_gpu and (dim > 128 or q.element_size() > 2)
    if cu_seqlens_q is None:
        block_q = max(1, 16 // group_pad)  # tl.dot wants at least 16 rows
    else:
        block_q = max(1, (_GPU_ROWS // (2 if big else 1) if on_gpu else _CPU_ROWS) // group_pad)
    block_d = max(16, triton.next_power_of_2(dim))
    num_stages = 2 if big else 3
    if tile_n:
        block_n = tile_n
    elif not on_gpu:
        block_n = _CPU_TILE_N
    elif big or cu_seqlens_q is not None:  # extend is measured only at the narrow tile
        block_n = _GPU_TILE_N // (2 if big else 1)
    else:
        block_n = _gpu_decode_tile(q, block_d, num_stages)
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError("paged_attention: tile_n must be a power of two >= 16")
    # The most keys one program covers: the whole context, or with a window the keys
    # its query tile can see (its query positions span tile_q - 1, plus the window).
    tile_q = max(1, min(block_q, max(q_lens)))
    span = max_len if sliding_window is None else min(max_len, int(sliding_window) + tile_q - 1)
    if num_splits is None:
        num_splits = _num_splits(num_seqs, hkv, span, block_n, on_gpu) if cu_seqlens_q is None else 1
    num_splits = max(1, int(num_splits))
    split_len = triton.cdiv(triton.cdiv(max(span, 1), num_splits), block_n) * block_n  # tile-aligned
    q_tiles = triton.cdiv(max(q_lens), block_q) if max(q_lens) else 1

    if num_splits > 1:
        m_buf = torch.empty((num_splits, total_q, hq), device=q.device, dtype=torch.float32)
        l_buf = torch.empty_like(m_buf)
        acc_buf = torch.empty((num_splits, total_q, hq, dim), device=q.device, dtype=torch.float32)
    else:
        m_buf = l_buf = acc_buf = out  # unused
    grid = (num_seqs, hkv, q_tiles * num_splits)
    _attn_kernel[grid](
        q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q if cu_seqlens_q is not None else seq_lens,
        out, m_buf, l_buf, acc_buf,
        float(scale if scale is not None else dim ** -0.5), float(softcap or 0.0), int(sliding_window or 0),
        hq, dim, block_size, split_len, total_q,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_N=block_n, BLOCK_D=block_d,
        NUM_SPLITS=num_splits, VARLEN=cu_seqlens_q is not None, USE_SOFTCAP=bool(softcap),
        USE_WINDOW=sliding_window is not None,
        FP32_DOT=q.dtype == torch.float32 or not on_gpu,
        num_warps=8 if big else 4, num_stages=num_stages,
    )
    if num_splits > 1:
        rows = total_q * hq
        block_r = _GPU_MERGE_ROWS if on_gpu else _CPU_MERGE_ROWS
        _merge_kernel[(triton.cdiv(rows, block_r),)](
            out, m_buf, l_buf, acc_buf, hq, dim, rows, num_splits, out.stride(0), out.stride(1),
            BLOCK_R=block_r, BLOCK_D=block_d,
        )
    return out
