"""write_kv against the reference store, on the CPU under TRITON_INTERPRET=1.

The caches start as NaN, so a slot the kernel must not touch (-1, or any slot not
in the mapping) is checked bit for bit, NaN included.
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import kvspec.kernels as kernels  # noqa: E402
from kvspec.kernels.sweep import KernelCase, run_case  # noqa: E402

CHEAP = settings(max_examples=25, deadline=None, derandomize=True, database=None,
                 phases=[Phase.explicit, Phase.generate],  # shrinking is slow under the interpreter
                 suppress_health_check=[HealthCheck.too_slow])


def same(a: "torch.Tensor", b: "torch.Tensor") -> bool:
    """Bit-for-bit equal, NaN in the same places."""
    return a.dtype == b.dtype and torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(
        torch.nan_to_num(a), torch.nan_to_num(b))


@st.composite
def writes(draw):
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    bs = draw(st.sampled_from([1, 3, 5, 16]))
    blocks = draw(st.integers(1, 6))
    heads = draw(st.sampled_from([1, 2, 3]))
    dim = draw(st.sampled_from([16, 64, 80]))
    free = list(range(blocks * bs))
    slots = draw(st.lists(st.one_of(st.sampled_from(free), st.just(-1)), max_size=40))
    seen: set[int] = set()
    slots = [s if s == -1 or s not in seen and not seen.add(s) else -1 for s in slots]  # a slot is written once
    idx_dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    return dtype, bs, blocks, heads, dim, slots, idx_dtype, draw(st.integers(0, 99))


@CHEAP
@given(writes())
def test_write_kv_matches_reference(args):
    dtype, bs, blocks, heads, dim, slots, idx_dtype, seed = args
    g = torch.Generator().manual_seed(seed)
    key = torch.randn(len(slots), heads, dim, generator=g).to(dtype)
    value = torch.randn(len(slots), heads, dim, generator=g).to(dtype)
    k, v = (torch.full((blocks, bs, heads, dim), float("nan"), dtype=dtype) for _ in range(2))
    k_ref, v_ref = k.clone(), v.clone()
    mapping = torch.tensor(slots, dtype=idx_dtype)
    kernels.write_kv(key, value, k, v, mapping)
    kernels.reference.write_kv(key, value, k_ref, v_ref, mapping)
    assert same(k, k_ref) and same(v, v_ref)


def test_minus_one_slots_are_skipped():
    k, v = (torch.full((2, 4, 1, 16), float("nan")) for _ in range(2))
    before = k.clone()
    kernels.write_kv(torch.ones(3, 1, 16), torch.ones(3, 1, 16), k, v, torch.tensor([-1, -1, -1]))
    assert same(k, before) and same(v, before)


def test_write_casts_to_the_cache_dtype():
    key = torch.randn(2, 2, 16)
    k, v = (torch.zeros(1, 2, 2, 16, dtype=torch.bfloat16) for _ in range(2))
    kernels.write_kv(key, -key, k, v, torch.tensor([1, 0]))
    assert torch.equal(k[0, 1], key[0].bfloat16()) and torch.equal(v[0, 0], (-key[1]).bfloat16())


def test_slot_past_the_cache_is_rejected():
    k, v = (torch.zeros(2, 4, 1, 16) for _ in range(2))
    with pytest.raises(ValueError, match="past the cache"):
        kernels.write_kv(torch.ones(1, 1, 16), torch.ones(1, 1, 16), k, v, torch.tensor([8]))


def test_written_cache_is_read_back_by_paged_attention():
    # write_kv lays tokens out where paged_attention looks for them (slot = block * bs + offset).
    torch.manual_seed(0)
    bs, heads, dim, n = 3, 2, 64, 10
    table = torch.tensor([[5, 1, 7, 2]], dtype=torch.int32)
    k, v = (torch.full((8, bs, heads, dim), float("nan")) for _ in range(2))
    key, value = torch.randn(n, heads, dim), torch.randn(n, heads, dim)
    slots = torch.tensor([int(table[0, p // bs]) * bs + p % bs for p in range(n)])
    kernels.write_kv(key, value, k, v, slots)
    q = torch.randn(1, heads * 2, dim)
    out = kernels.paged_attention(q, k, v, table, torch.tensor([n], dtype=torch.int32))
    dense = kernels.reference.attention(q.double(), key.double(), value.double(), dim ** -0.5, None)
    assert (out.double() - dense).abs().max().item() < 1e-5


def test_run_case_sanity():
    # The harness itself: a healthy case passes and reports a finite error.
    r = run_case(KernelCase(seq_lens=(3,), block_size=2, seed=1))
    assert r.ok and r.err < r.bound
